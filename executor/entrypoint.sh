#!/bin/sh
# jetrunner executor entrypoint: turns the executor contract (environment variables set by the
# worker that created this Pod or sandbox) into the runner's registration file and runs exactly
# one job with the runner's one-shot mode. See docs/executor.md.
#
# Contract (all required, set by pod-worker / vm-worker):
#   JETRUNNER_FACADE_URL     base URL of jetrunner's facade; becomes the runner's `address`
#   JETRUNNER_ASSIGNMENT_ID  assignment UUID; becomes the runner `uuid`
#   JETRUNNER_RUNNER_TOKEN   per-attempt token; becomes the runner `token` (never printed)
#   JETRUNNER_LABELS         the job's runs-on labels, comma separated
#
# GitHub Actions jobs (JETRUNNER_FORGE=github, set by the worker; JETRUNNER_LABELS is then not
# needed): the executor's credentials fetch the attempt's just-in-time runner config from the
# facade, and GitHub's runner starts with it (config in ACTIONS_RUNNER_INPUT_JITCONFIG, never on
# a command line). The runner then talks to GitHub directly and exits after its one job.
#   EXECUTOR_ACTIONS_RUNNER  the runner's run.sh (default /opt/actions-runner/run.sh)
#
# Image knobs (set by the image or the runner block's `env`):
#   EXECUTOR_RUNNER        act_runner (default) | forgejo-runner
#   EXECUTOR_STATE_DIR     directory for the registration file (default /data); must be writable
#   EXECUTOR_LABEL_SCHEME  how every label runs: host (default) | docker://<image> | lxc://<image>
#                          (lxc only with forgejo-runner)
#   EXECUTOR_CONFIG_FILE   runner config file passed with -c (optional)
#
# Exit status: 78 when the environment is unusable (nothing is started); otherwise the runner's own
# status, because the runner replaces this shell (exec).
set -eu

prog=jetrunner-executor

# The token must never reach stdout/stderr: this script never runs with `set -x`, and no message
# below includes a variable's value except the ones that are not secret.
fail() {
  printf '%s: %s\n' "$prog" "$*" >&2
  exit 78
}

runner=${EXECUTOR_RUNNER:-act_runner}
case $runner in
  act_runner | forgejo-runner) ;;
  *) fail "EXECUTOR_RUNNER must be act_runner or forgejo-runner, not '$runner'" ;;
esac

forge=${JETRUNNER_FORGE:-gitea}
case $forge in
  gitea) required="JETRUNNER_FACADE_URL JETRUNNER_ASSIGNMENT_ID JETRUNNER_RUNNER_TOKEN JETRUNNER_LABELS" ;;
  github) required="JETRUNNER_FACADE_URL JETRUNNER_ASSIGNMENT_ID JETRUNNER_RUNNER_TOKEN" ;;
  *) fail "JETRUNNER_FORGE must be gitea or github, not '$forge'" ;;
esac

missing=
for name in $required; do
  eval "value=\${$name-}"
  if [ -z "$value" ]; then
    missing="$missing $name"
  fi
done
value=
if [ -n "$missing" ]; then
  fail "missing required environment variable(s):$missing; they are set by the jetrunner worker that creates this workload (is the image started outside jetrunner?)"
fi

facade_url=$JETRUNNER_FACADE_URL
assignment_id=$JETRUNNER_ASSIGNMENT_ID
token=$JETRUNNER_RUNNER_TOKEN
routed_labels=${JETRUNNER_LABELS-}

# Everything that goes into the JSON file is checked against a character set that needs no JSON
# escaping: no double quote, no backslash, no control character.
case $facade_url in
  http://?* | https://?*) ;;
  *) fail "JETRUNNER_FACADE_URL must be an http:// or https:// URL, got '$facade_url'" ;;
esac
case $facade_url in
  *[[:cntrl:][:space:]\"\\]*) fail "JETRUNNER_FACADE_URL contains a space, quote, backslash or control character" ;;
esac

case $assignment_id in
  *[!0-9a-fA-F-]*) fail "JETRUNNER_ASSIGNMENT_ID must be a UUID, got '$assignment_id'" ;;
esac
if [ ${#assignment_id} -ne 36 ]; then
  fail "JETRUNNER_ASSIGNMENT_ID must be a UUID (36 characters), got '$assignment_id'"
fi

# Tokens are hex today; the accepted set is what is safe in a JSON string and an HTTP header.
case $token in
  *[!A-Za-z0-9._~+/=-]*) fail "JETRUNNER_RUNNER_TOKEN contains characters outside [A-Za-z0-9._~+/=-] (value not shown)" ;;
esac

state_dir=${EXECUTOR_STATE_DIR:-/data}

# GitHub: ask the facade for the runner config, then become GitHub's runner.
if [ "$forge" = github ]; then
  actions_runner=${EXECUTOR_ACTIONS_RUNNER:-/opt/actions-runner/run.sh}
  [ -x "$actions_runner" ] || fail "EXECUTOR_ACTIONS_RUNNER '$actions_runner' is not an executable file (is this the image's actions-runner target?)"
  command -v curl >/dev/null 2>&1 || fail "curl is needed to fetch the runner config from the facade"
  mkdir -p "$state_dir" 2>/dev/null || fail "cannot create EXECUTOR_STATE_DIR '$state_dir'"
  cd "$state_dir" || fail "cannot enter EXECUTOR_STATE_DIR '$state_dir'"
  umask 077
  answer=".runner-config.$$"
  rm -f "$answer"
  # The credentials reach curl on its standard input as config lines (printf is a builtin), never
  # in an argument list. The facade answers 503 until the worker's workload-created is visible:
  # curl tries again.
  if ! printf 'header = "x-runner-uuid: %s"\nheader = "x-runner-token: %s"\n' "$assignment_id" "$token" |
    curl --silent --show-error --fail --config - --request POST --data '' \
      --retry 60 --retry-delay 1 --retry-max-time 300 --retry-connrefused \
      --output "$answer" "${facade_url%/}/jetrunner/github/v1/runner-config"; then
    rm -f "$answer"
    fail "the facade did not hand out this attempt's runner config"
  fi
  jit=$(sed -n 's/.*"jit_config":"\([A-Za-z0-9+\/=]*\)".*/\1/p' "$answer")
  rm -f "$answer"
  [ -n "$jit" ] || fail "the facade's answer holds no runner config"
  token=
  unset JETRUNNER_RUNNER_TOKEN
  ACTIONS_RUNNER_INPUT_JITCONFIG=$jit
  export ACTIONS_RUNNER_INPUT_JITCONFIG
  jit=
  printf '%s: assignment %s: starting the GitHub runner %s (config from facade %s)\n' \
    "$prog" "$assignment_id" "$actions_runner" "$facade_url" >&2
  exec "$actions_runner"
fi

scheme=${EXECUTOR_LABEL_SCHEME:-host}
case $runner:$scheme in
  *:host | *:docker://?* | forgejo-runner:lxc://?*) ;;
  *) fail "EXECUTOR_LABEL_SCHEME '$scheme' is not supported by $runner (use host or docker://<image>; lxc://<image> with forgejo-runner only)" ;;
esac
case $scheme in
  *[[:cntrl:][:space:]\",\\]*) fail "EXECUTOR_LABEL_SCHEME contains a space, quote, comma, backslash or control character" ;;
esac

# JETRUNNER_LABELS holds label names only; the runner wants `name:scheme[:argument]`.
labels_json=
labels_shown=
rest=$routed_labels,
while [ -n "$rest" ]; do
  label=${rest%%,*}
  rest=${rest#*,}
  case $label in
    '') fail "JETRUNNER_LABELS has an empty label: '$routed_labels'" ;;
    *[[:cntrl:]:\"\\]*) fail "JETRUNNER_LABELS: label '$label' contains a colon, quote, backslash or control character" ;;
  esac
  labels_json="$labels_json${labels_json:+,
}    \"$label:$scheme\""
  labels_shown="$labels_shown${labels_shown:+,}$label:$scheme"
done

if [ -n "${EXECUTOR_CONFIG_FILE:-}" ] && [ ! -r "$EXECUTOR_CONFIG_FILE" ]; then
  fail "EXECUTOR_CONFIG_FILE '$EXECUTOR_CONFIG_FILE' is not a readable file"
fi

mkdir -p "$state_dir" 2>/dev/null || fail "cannot create EXECUTOR_STATE_DIR '$state_dir'"
cd "$state_dir" || fail "cannot enter EXECUTOR_STATE_DIR '$state_dir'"

# act_runner's file has `ephemeral`: true, because these credentials open exactly one task
# (the facade refuses everything after it). forgejo-runner's file has no such field.
case $runner in
  act_runner) ephemeral_line=',
  "ephemeral": true' ;;
  forgejo-runner) ephemeral_line= ;;
esac

# Written under umask 077 into a temporary name and renamed, so the token is never in a file others
# can read and the runner never sees half a file. printf is a shell builtin (dash, ash, bash):
# the token does not appear in any process's argument list.
umask 077
tmp=".runner.tmp.$$"
rm -f "$tmp"
printf '{\n  "WARNING": "%s",\n  "id": 0,\n  "uuid": "%s",\n  "name": "%s",\n  "token": "%s",\n  "address": "%s",\n  "labels": [\n%s\n  ]%s\n}\n' \
  "Written by the jetrunner executor entrypoint for one job; the credentials are valid for this assignment attempt only." \
  "$assignment_id" "jetrunner-$assignment_id" "$token" "$facade_url" "$labels_json" "$ephemeral_line" >"$tmp" ||
  fail "cannot write the registration file in '$state_dir'"
chmod 600 "$tmp"
mv -f "$tmp" .runner

# The job's steps inherit the runner's environment (host mode); they must not see the token.
token=
unset JETRUNNER_RUNNER_TOKEN

set --
if [ -n "${EXECUTOR_CONFIG_FILE:-}" ]; then
  set -- -c "$EXECUTOR_CONFIG_FILE"
fi
case $runner in
  act_runner) set -- "$@" daemon --once ;;
  forgejo-runner) set -- "$@" one-job ;;
esac

printf '%s: assignment %s: starting %s %s (facade %s, labels %s)\n' \
  "$prog" "$assignment_id" "$runner" "$*" "$facade_url" "$labels_shown" >&2
exec "$runner" "$@"

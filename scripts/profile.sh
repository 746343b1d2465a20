#!/usr/bin/env bash
# Profiles the four services under the bench's saturated scale run: starts `bench --scale-only`
# (release), waits until the run's services are up and jobs flow, records each service with
# `perf record` for a fixed window, and prints for each where its CPU went (by task and by kind
# of work, scripts/perf_summary.py) and its top symbols by self time.
#
#   scripts/profile.sh              # [6], one NATS node
#   scripts/profile.sh --r3         # [6c], a three-node cluster with every stream R3
#
# Environment: JOBS (default 6000, so the saturated phase outlasts the recording), SECONDS_REC
# (default 12), OUT (default $CARGO_TARGET_DIR/profile), TOP (symbols printed per service, 25),
# JR_BIN_DIR (profile the release binaries in that folder instead of building this checkout).
# Needs `perf` (Debian: linux-perf) and permission to attach to processes of the same user.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_nats_server
ensure_postgres
target="${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/jetrunner-target}"
export CARGO_TARGET_DIR="$target"
jobs="${JOBS:-6000}"
window="${SECONDS_REC:-12}"
top="${TOP:-25}"
out="${OUT:-$target/profile}"
mode=r1
[[ "${1:-}" == "--r3" ]] && mode=r3
command -v perf >/dev/null || { echo "perf is not installed (Debian: apt-get install linux-perf)" >&2; exit 1; }
mkdir -p "$out"
# JR_BIN_DIR profiles the binaries of another build (bench and the services side by side).
if [[ -n "${JR_BIN_DIR:-}" ]]; then
    bin="$JR_BIN_DIR"
else
    cargo build --release --workspace --bins
    bin="$target/release"
fi

if [[ "$mode" == r3 ]]; then
    run=(--scale-jobs 1 --r3-jobs "$jobs")
else
    run=(--scale-jobs "$jobs" --r3-jobs 0)
fi
"$bin/bench" --scale-only --backlog-jobs 0 "${run[@]}" >"$out/bench-$mode.log" 2>&1 &
bench_pid=$!
trap 'kill "$bench_pid" 2>/dev/null || true' EXIT

# The services of the profiled run: with --r3 the first run ([6], one job) comes and goes first,
# so wait for the header of the R3 run before looking for processes.
marker='\[6\] scale'
[[ "$mode" == r3 ]] && marker='\[6c\] R3'
until grep -q "$marker" "$out/bench-$mode.log"; do
    kill -0 "$bench_pid" 2>/dev/null || { cat "$out/bench-$mode.log"; exit 1; }
    sleep 0.2
done
declare -A pids
for svc in scheduler pod-worker vm-worker reconciler; do
    until pid=$(pgrep -n -f "^$bin/$svc( |$)"); do
        kill -0 "$bench_pid" 2>/dev/null || { cat "$out/bench-$mode.log"; exit 1; }
        sleep 0.2
    done
    pids[$svc]=$pid
done
# Jobs are queued right after the services report ready; give the run a moment to saturate.
sleep 3
recorders=()
for svc in "${!pids[@]}"; do
    perf record -F 499 --call-graph dwarf,16384 -o "$out/$svc-$mode.data" -p "${pids[$svc]}" \
        -- sleep "$window" >/dev/null 2>"$out/$svc-$mode.perf.log" &
    recorders+=($!)
done
wait "${recorders[@]}"
wait "$bench_pid" || true
trap - EXIT
grep -E "host|lifecycles|CPU-ms/job|stored per job|utilisation" "$out/bench-$mode.log" || true
for svc in scheduler pod-worker vm-worker reconciler; do
    echo
    echo "== $svc ($mode)"
    perf script -i "$out/$svc-$mode.data" -F period,ip,sym 2>/dev/null | python3 scripts/perf_summary.py
    echo "-- top $top symbols by self time"
    perf report -i "$out/$svc-$mode.data" --no-children --sort symbol --stdio -g none \
        --percent-limit 0.5 2>/dev/null | grep -E '^ +[0-9]' | sed -E 's/( +-)+ *$//' | head -n "$top"
done
echo
echo "perf data and the bench's output are in $out (perf report -i <file> for call graphs)"

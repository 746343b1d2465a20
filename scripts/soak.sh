#!/usr/bin/env bash
# Long runs kept out of CI: chaos with several fresh seeds, the issue-sized worker scenarios
# (500 jobs), 50 scheduler kills between the forge's reply and the PubAck, repeated warm-executor
# runs under kills, repeated runs of the two-replica HA scenario and of the three-node NATS
# cluster scenario, GitHub jobs under chaos for longer, and the worker's
# property tests at 10,000 cases per property. Every seed used is printed, so a failure replays
# with JR_CHAOS_SEED=<seed>.
#
#   scripts/soak.sh            # all of it (about an hour on 2 cores)
#   SOAK_SEEDS=3 scripts/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_nats_server
ensure_postgres
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/jetrunner-target}"

cargo build --workspace --bins
JR_PROPTEST_CASES=10000 cargo test -p jr-worker --test properties
JR_PROPTEST_CASES=2000 cargo test -p reconciler --lib equivalence
PROPTEST_CASES=10000 cargo test -p jr-placement
JR_PACING_CRASHES=50 cargo test -p jr-scenarios --test pacing forgejo -- --test-threads=1 --nocapture
cargo test -p jr-scenarios --test workers -- --ignored --test-threads=1
for _ in $(seq "${SOAK_SEEDS:-5}"); do
  JR_CHAOS_SEED=random cargo test -p jr-scenarios --test chaos -- --test-threads=1 --nocapture
done
# Warm executors while every service is killed in turn: the kills land at different moments of
# the binding each run.
for _ in $(seq "${SOAK_WARM_RUNS:-10}"); do
  cargo test -p jr-scenarios --test warm -- --test-threads=1 --nocapture
done
# Two replicas of every service, the leaders and the busiest worker replicas killed in turn; and
# the replica coordination's property tests at many cases.
PROPTEST_CASES=5000 cargo test -p jr-lease --test properties
for _ in $(seq "${SOAK_HA_RUNS:-10}"); do
  cargo test -p jr-scenarios --test ha -- --test-threads=1 --nocapture
done
# GitHub jobs under chaos (every service killed, NATS and PostgreSQL restarted), longer runs
# with fresh seeds.
for _ in $(seq "${SOAK_GITHUB_RUNS:-5}"); do
  JR_CHAOS_SEED=random JR_GITHUB_CHAOS_SECS=120 \
    cargo test -p jr-scenarios --test github under_chaos -- --test-threads=1 --nocapture
done
# The three-node JetStream cluster: leader kills, a 20 s stall and a rolling restart, each run
# with a fresh seed for the job mix, held to the recovery target (a claim within 5 s of the new
# leaders; 6 s with these debug builds).
for _ in $(seq "${SOAK_CLUSTER_RUNS:-10}"); do
  JR_CHAOS_SEED=random JR_RECOVERY_TARGET=1 \
    cargo test -p jr-scenarios --test nats_cluster -- --test-threads=1 --nocapture
done

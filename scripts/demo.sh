#!/usr/bin/env bash
# Runs all of jetrunner locally on the simulated forge and backends and shows jobs flowing.
# Options are passed to the demo binary (see `--help`), e.g. `scripts/demo.sh --jobs 200`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_nats_server
ensure_postgres
cargo build --release --workspace --bins
exec "${CARGO_TARGET_DIR:-target}/release/demo" "$@"

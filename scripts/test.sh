#!/usr/bin/env bash
# Runs every test of the workspace: unit, integration, end-to-end scenarios and the bounded
# chaos scenario. Needs cargo; installs nats-server >= 2.10, PostgreSQL and Chromium (the status
# page's browser test) if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_nats_server
ensure_postgres
ensure_chromium

# Formatting and lints first: cheap, and a failure here needs no test run to explain it.
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
# The scenario tests start the service binaries as processes.
cargo build --workspace --bins
# Library, integration and property tests (parallel within each test binary).
cargo test --workspace --exclude jr-scenarios
# Full-system scenarios, one at a time: each runs NATS, PostgreSQL and four services.
# The chaos schedule comes from a fresh seed every run, so CI keeps exploring new schedules; the
# seed is printed, and JR_CHAOS_SEED=<seed> replays a failed run exactly.
cargo test -p jr-scenarios -- --test-threads=1

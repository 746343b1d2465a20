# syntax=docker/dockerfile:1.7
#
# One image for every jetrunner binary; the container command chooses which one runs:
#   docker run jetrunner scheduler --config /etc/jetrunner/jetrunner.toml
# Services: scheduler, pod-worker, vm-worker, reconciler. Admin CLI: jr (`jr decode`, `jr health`).
# Simulated components for development: fake-forge, fake-kube, fake-sandbox, fake-executor.

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /src
ARG BINARIES="scheduler pod-worker vm-worker reconciler jr fake-forge fake-kube fake-sandbox fake-executor"
COPY . .
# The registry, git checkouts and target/ live in BuildKit cache mounts, so a rebuild after a source
# change only recompiles the crates that changed. target/ is a cache mount and is not part of the
# layer, so the binaries are copied out to /out in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    set -eux; \
    bins=""; for b in ${BINARIES}; do bins="${bins} --bin ${b}"; done; \
    cargo build --release --locked ${bins}; \
    mkdir -p /out; \
    for b in ${BINARIES}; do cp "target/release/${b}" /out/; done

FROM debian:bookworm-slim AS runtime
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends ca-certificates; \
    rm -rf /var/lib/apt/lists/*; \
    groupadd --system --gid 10001 jetrunner; \
    useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/jetrunner --no-create-home \
        --shell /usr/sbin/nologin jetrunner; \
    mkdir -p /etc/jetrunner /var/lib/jetrunner; \
    chown 10001:10001 /var/lib/jetrunner
COPY --from=builder /out/ /usr/local/bin/
# /var/lib/jetrunner holds the scheduler's registered runner credentials (forge.credentials_file);
# a named volume mounted there inherits the 10001 ownership from the image.
WORKDIR /var/lib/jetrunner
USER 10001:10001
ENV RUST_BACKTRACE=1
CMD ["jr", "--help"]

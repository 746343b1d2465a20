# syntax=docker/dockerfile:1.7
#
# Two images from one build:
#   production (default target): the services and the admin CLI only
#       docker build -t jetrunner .
#       docker run jetrunner scheduler --config /etc/jetrunner/jetrunner.toml
#     Services: scheduler, pod-worker, vm-worker, reconciler. Admin CLI: jr (`jr decode`, `jr health`).
#   dev (`--target dev`, what compose.yaml builds): the same plus the simulated components
#     fake-forge, fake-kube, fake-sandbox, fake-executor and fake-github, for the demo and local development.
# The production image never contains a fake: a fake forge or Kubernetes API accepts anything.

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /src
ARG BINARIES="scheduler pod-worker vm-worker reconciler jr"
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

# The fakes, built on top of the production binaries (same cache, so only the fakes compile).
FROM builder AS dev-builder
ARG DEV_BINARIES="fake-forge fake-kube fake-sandbox fake-executor fake-github"
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    set -eux; \
    bins=""; for b in ${DEV_BINARIES}; do bins="${bins} --bin ${b}"; done; \
    cargo build --release --locked ${bins}; \
    mkdir -p /out-dev; \
    for b in ${DEV_BINARIES}; do cp "target/release/${b}" /out-dev/; done

FROM debian:bookworm-slim AS runtime-base
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends ca-certificates; \
    rm -rf /var/lib/apt/lists/*; \
    groupadd --system --gid 10001 jetrunner; \
    useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/jetrunner --no-create-home \
        --shell /usr/sbin/nologin jetrunner; \
    mkdir -p /etc/jetrunner /var/lib/jetrunner; \
    chown 10001:10001 /var/lib/jetrunner
# /var/lib/jetrunner holds the scheduler's registered runner credentials (forge.credentials_file);
# a named volume mounted there inherits the 10001 ownership from the image.
WORKDIR /var/lib/jetrunner
ENV RUST_BACKTRACE=1

FROM runtime-base AS dev
COPY --from=builder /out/ /usr/local/bin/
COPY --from=dev-builder /out-dev/ /usr/local/bin/
USER 10001:10001
CMD ["jr", "--help"]

# Last stage: what `docker build .` produces.
FROM runtime-base AS runtime
COPY --from=builder /out/ /usr/local/bin/
USER 10001:10001
CMD ["jr", "--help"]

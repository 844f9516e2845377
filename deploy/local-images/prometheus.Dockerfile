# Stands in for prom/prometheus (the observability profile) with Debian bookworm's Prometheus 2.42: the binary
# as the entrypoint, data in /prometheus. Grafana has no Debian package, so the profile's grafana service has no
# local stand-in.
ARG BASE_IMAGE=debian-local:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]

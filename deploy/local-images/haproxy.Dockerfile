# Stands in for haproxy:2.6: Debian bookworm's HAProxy 2.6 in the foreground (master-worker, as the official
# image runs it) on /usr/local/etc/haproxy/haproxy.cfg, as the user haproxy.
ARG BASE_IMAGE=debian-local:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends haproxy \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /usr/local/etc/haproxy
USER haproxy
# the official image's graceful stop
STOPSIGNAL SIGUSR1
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]

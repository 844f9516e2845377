#!/usr/bin/env bash
# Serves torch's CPU build as a package index for the image build's TORCH_INDEX_URL, where
# download.pytorch.org cannot be reached but a torch CPU wheel is at hand (docs/deployment.md#building-without-
# docker-hub). Collects the wheel from WHEEL_DIR and its dependencies from this machine's pip index into a
# PEP 503 tree and serves it over HTTP on the Docker bridge's address, in the foreground (Ctrl-C stops it):
#   deploy/local-images/torch-index.sh /opt/wheels &
#   TORCH_INDEX_URL=http://172.17.0.1:8599/simple TORCH_TRUSTED_HOST=172.17.0.1 docker-compose build
# Options (environment): TORCH_VERSION (default 2.13.0, as the Dockerfile), PORT (8599), ADDRESS (docker0's
# address: the classic builder's build containers reach the host there).
set -euo pipefail
wheels=${1:?usage: torch-index.sh WHEEL_DIR (a directory holding torch-<version>+cpu-*.whl)}
version=${TORCH_VERSION:-2.13.0}
port=${PORT:-8599}
address=${ADDRESS:-$(ip -4 -o addr show docker0 | awk '{split($4, a, "/"); print a[1]}')}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT

# a local version (+cpu) sorts above the index's plain one, so pip takes the wheel from WHEEL_DIR
python3 -m pip download --quiet --only-binary :all: --dest "$root/files" --find-links "$wheels" "torch==$version"
for file in "$root"/files/*.whl; do
    name=$(basename "$file")
    project=$(echo "${name%%-*}" | tr 'A-Z_.' 'a-z--' | tr -s -)  # PEP 503 normalised
    mkdir -p "$root/simple/$project"
    echo "<a href=\"../../files/$name\">$name</a><br>" >> "$root/simple/$project/index.html"
done
echo "serving $(cd "$root/files" && echo *.whl) TORCH_INDEX_URL=http://$address:$port/simple TORCH_TRUSTED_HOST=$address"
python3 -m http.server --bind "$address" --directory "$root" "$port"

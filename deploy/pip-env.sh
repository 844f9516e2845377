#!/bin/sh
# Runs a command (pip) with the image build's package-index settings (Dockerfile, deploy/gpu.Dockerfile):
# - PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST, PIP_CERT come in as build ARGs; an ARG not given is
#   an empty variable, which pip would take for an empty URL, so empty ones are unset here;
# - a CA bundle for a TLS-intercepting proxy: PEM files (*.pem, *.crt) in deploy/ca/ (copied to $CA_DIR) are
#   added to the system's bundle, and pip (PIP_CERT) and Python's ssl (SSL_CERT_FILE) trust the result.
#   deploy/ca/ holds only a README in the repository: its PEM files are git-ignored.
#     usage: pip-env.sh pip install ...
set -eu
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST PIP_CERT; do
    eval "value=\${$name:-}"
    if [ -z "$value" ]; then unset "$name"; fi
done
ca_dir=${CA_DIR:-/etc/turnstile/ca}
found=""
for file in "$ca_dir"/*.pem "$ca_dir"/*.crt; do
    if [ -f "$file" ]; then found="$found $file"; fi
done
if [ -n "$found" ]; then
    bundle=${CA_BUNDLE_OUT:-/tmp/turnstile-ca-bundle.pem}
    system=""
    for candidate in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
        if [ -f "$candidate" ]; then system=$candidate; break; fi
    done
    # shellcheck disable=SC2086  # $found is a list of paths without spaces (a glob of deploy/ca)
    cat $system $found > "$bundle"
    export PIP_CERT="${PIP_CERT:-$bundle}" SSL_CERT_FILE="$bundle" REQUESTS_CA_BUNDLE="$bundle"
fi
exec "$@"

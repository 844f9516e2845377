#!/usr/bin/env bash
# Validates docker-compose.yml with no Docker daemon and no standard input (.ci/run runs it):
#  1. the file itself, with the first compose tool that can be had: `docker compose config`, `docker-compose
#     config`, Debian's docker-compose package (apt-get, as root or with sudo -n), else the compose-spec JSON
#     Schema (check-jsonschema from PyPI, in a throwaway virtualenv). A tool that cannot be had does not fail
#     this step: it says which check ran.
#  2. always: every service's command against the turnstile CLI, and its NATS and PostgreSQL users and
#     passwords against deploy/ (deploy/check_compose.py, with the project's virtualenv: PYTHON).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

tool=()
if docker compose version >/dev/null 2>&1; then
    tool=(docker compose)
elif docker-compose version >/dev/null 2>&1; then
    tool=(docker-compose)
elif command -v apt-get >/dev/null 2>&1; then
    sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo -n)
    if [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; then
        echo "compose check: installing Debian's docker-compose package"
        if { DEBIAN_FRONTEND=noninteractive timeout 600 "${sudo[@]}" apt-get install -y -q --no-install-recommends docker-compose \
            || { DEBIAN_FRONTEND=noninteractive timeout 300 "${sudo[@]}" apt-get update -q \
                && DEBIAN_FRONTEND=noninteractive timeout 600 "${sudo[@]}" apt-get install -y -q --no-install-recommends docker-compose; }
            } </dev/null >"$log" 2>&1 && docker-compose version >/dev/null 2>&1; then
            tool=(docker-compose)
        else
            echo "compose check: could not install docker-compose with apt-get:"
            tail -5 "$log"
        fi
    fi
fi

checked=""
if [ ${#tool[@]} -gt 0 ]; then
    # --profile gpu: the GPU service is checked too
    if ! "${tool[@]}" -f docker-compose.yml --profile gpu config -q </dev/null; then
        echo "docker-compose.yml: \`${tool[*]} config\` refused it (above)"
        exit 1
    fi
    checked="\`${tool[*]} config\` ($("${tool[@]}" version 2>/dev/null | head -1))"
else
    venv=$(mktemp -d)
    if python3 -m venv "$venv/venv" >"$log" 2>&1 \
        && timeout 600 "$venv/venv/bin/pip" install -q check-jsonschema </dev/null >>"$log" 2>&1; then
        if ! "$venv/venv/bin/check-jsonschema" --builtin-schema vendor.compose-spec docker-compose.yml; then
            echo "docker-compose.yml: the compose-spec schema refused it (above)"
            exit 1
        fi
        checked="the compose-spec JSON Schema (check-jsonschema; no compose tool could be had)"
    else
        echo "compose check: could not install check-jsonschema:"
        tail -5 "$log"
    fi
    rm -rf "$venv"
fi

"$python" deploy/check_compose.py || exit 1
if [ -n "$checked" ]; then
    echo "docker-compose.yml: valid for $checked; every command parses with the turnstile CLI"
else
    echo "docker-compose.yml: NOT checked by a compose tool or schema (none could be had here); every command" \
        "parses with the turnstile CLI (deploy/check_compose.py)"
fi

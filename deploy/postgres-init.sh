#!/usr/bin/env bash
# Runs deploy/postgres-init.sql with the passwords from the environment. The postgres image runs (or sources)
# this from /docker-entrypoint-initdb.d/ once, when it initialises an empty data directory; it can also be
# run by hand against a running server (PGHOST, PGPORT, POSTGRES_USER and POSTGRES_DB say which). No `set`
# line: the image sources the script when it is not executable, and options set here would stay set there.
psql -v ON_ERROR_STOP=1 --no-psqlrc --username "${POSTGRES_USER:-postgres}" --dbname "${POSTGRES_DB:-postgres}" \
    -v runner_password="${TURNSTILE_RUNNER_PASSWORD:?set TURNSTILE_RUNNER_PASSWORD}" \
    -v gateway_password="${TURNSTILE_GATEWAY_PASSWORD:?set TURNSTILE_GATEWAY_PASSWORD}" \
    -v trainer_password="${TURNSTILE_TRAINER_PASSWORD:?set TURNSTILE_TRAINER_PASSWORD}" \
    -v materializer_password="${TURNSTILE_MATERIALIZER_PASSWORD:?set TURNSTILE_MATERIALIZER_PASSWORD}" \
    -v relay_password="${TURNSTILE_RELAY_PASSWORD:?set TURNSTILE_RELAY_PASSWORD}" \
    -v analyst_password="${TURNSTILE_ANALYST_PASSWORD:?set TURNSTILE_ANALYST_PASSWORD}" \
    -v inference_password="${TURNSTILE_INFERENCE_PASSWORD:?set TURNSTILE_INFERENCE_PASSWORD}" \
    --file "${TURNSTILE_POSTGRES_INIT_SQL:-/etc/turnstile/postgres-init.sql}"

#!/bin/bash
# The part of the official postgres image's docker-entrypoint.sh that docker-compose.yml relies on: on an empty
# PGDATA, initdb with POSTGRES_USER / POSTGRES_PASSWORD (password logins over TCP), create POSTGRES_DB, run
# /docker-entrypoint-initdb.d/*.sh (executed if executable, else sourced) and *.sql on a server that listens on
# its socket only, stop it; then run the command (`postgres ...`) as the user postgres.
set -Eeuo pipefail
if [ "${1:0:1}" = - ]; then set -- postgres "$@"; fi
if [ "$1" = postgres ] && [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA"
    chown -R postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [ "$1" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
    export POSTGRES_USER=${POSTGRES_USER:-postgres}
    export POSTGRES_DB=${POSTGRES_DB:-$POSTGRES_USER}
    initdb --username="$POSTGRES_USER" --pwfile=<(printf '%s\n' "$POSTGRES_PASSWORD") \
        --auth-local=trust --auth-host=scram-sha-256 -D "$PGDATA"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
    if [ "$POSTGRES_DB" != postgres ]; then
        psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname postgres \
            -c "CREATE DATABASE \"$POSTGRES_DB\""
    fi
    # shellcheck disable=SC1090  # the scripts compose mounts, as the official image runs them
    for file in /docker-entrypoint-initdb.d/*; do
        case "$file" in
            *.sh) echo "running $file"; if [ -x "$file" ]; then "$file"; else . "$file"; fi ;;
            *.sql) echo "running $file"; psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" \
                --dbname "$POSTGRES_DB" -f "$file" ;;
            *) ;;
        esac
    done
    pg_ctl -D "$PGDATA" -m fast -w stop
fi
exec "$@"

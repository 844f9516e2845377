# Stands in for postgres:16-alpine with Debian bookworm's PostgreSQL 15: the same entrypoint contract
# (POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB, scripts in /docker-entrypoint-initdb.d run once on an empty
# data directory, PGDATA=/var/lib/postgresql/data, the server run as the user postgres).
ARG BASE_IMAGE=debian-local:bookworm
FROM ${BASE_IMAGE}
# the package would otherwise create a cluster of its own at install time (the official Debian image does the same)
RUN mkdir -p /etc/postgresql-common \
 && echo 'create_main_cluster = false' > /etc/postgresql-common/createcluster.conf \
 && apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/postgresql/data /docker-entrypoint-initdb.d /var/run/postgresql \
 && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data LANG=C.UTF-8
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
ENTRYPOINT ["docker-entrypoint.sh"]
# what the official image does: a fast shutdown on `docker stop`
STOPSIGNAL SIGINT
EXPOSE 5432
CMD ["postgres"]

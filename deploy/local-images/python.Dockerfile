# Stands in for python:3.11-slim (the base of the Turnstile image): Debian's python3.11 with venv and pip,
# `python` on the PATH, the CA bundle. Built by build.sh from the local Debian base.
ARG BASE_IMAGE=debian-local:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        python3.11 python3.11-venv python3-pip ca-certificates \
 && ln -s /usr/bin/python3.11 /usr/local/bin/python \
 && ln -s /usr/bin/pip3 /usr/local/bin/pip \
 && rm -rf /var/lib/apt/lists/*
ENV LANG=C.UTF-8
CMD ["python3"]

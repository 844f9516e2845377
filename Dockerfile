# syntax=docker/dockerfile:1
# One image for every Turnstile service (ENTRYPOINT `turnstile`; the command picks the service).
#   docker build -t turnstile .                        CPU: torch's CPU build, the tiny model (the default)
#   docker build --target gpu -t turnstile-gpu .       NVIDIA GPU: CUDA runtime and vLLM
# docker-compose.yml builds both (the gpu one only with --profile gpu).

ARG PYTHON_IMAGE=python:3.11-slim
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------------------
# GPU: vLLM brings its own CUDA build of torch. Triton compiles small launchers when it first runs a kernel,
# so the runtime image keeps a C compiler and the Python headers.
FROM ${CUDA_IMAGE} AS gpu-base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
 && rm -rf /var/lib/apt/lists/*

FROM gpu-base AS gpu-build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PATH=/opt/turnstile/bin:$PATH
RUN python3 -m venv /opt/turnstile
WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY pipeline pipeline
COPY consumers consumers
COPY migrations migrations
RUN pip install ".[vllm]"

FROM gpu-base AS gpu
RUN useradd --create-home --uid 10001 --user-group turnstile \
 && mkdir -p /models /checkpoints \
 && chown turnstile:turnstile /models /checkpoints
COPY --from=gpu-build /opt/turnstile /opt/turnstile
COPY deploy /app/deploy
ENV PATH=/opt/turnstile/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /app
USER turnstile
ENTRYPOINT ["turnstile"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------------------
# CPU (the default target: last in this file).
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# torch comes from its CPU index: from PyPI, `pip install torch` is a multi-GB CUDA build. Behind a mirror,
# pass --build-arg TORCH_INDEX_URL=... (and PIP_INDEX_URL for the rest).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PATH=/opt/turnstile/bin:$PATH
RUN python -m venv /opt/turnstile \
 && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY pipeline pipeline
COPY consumers consumers
COPY migrations migrations
# The pin keeps the CPU build installed above (2.13.0+cpu satisfies ==2.13.0).
RUN pip install ".[torch]" "torch==${TORCH_VERSION}"

FROM ${PYTHON_IMAGE} AS cpu
# The volumes compose mounts at /models and /checkpoints start out owned by this user (a new named volume
# takes the ownership of the image's directory).
RUN useradd --create-home --uid 10001 --user-group turnstile \
 && mkdir -p /models /checkpoints \
 && chown turnstile:turnstile /models /checkpoints
COPY --from=build /opt/turnstile /opt/turnstile
# healthcheck.py, the demo's tasks, the server configs (for reference; compose mounts its own copies)
COPY deploy /app/deploy
ENV PATH=/opt/turnstile/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /app
USER turnstile
ENTRYPOINT ["turnstile"]
CMD ["--help"]

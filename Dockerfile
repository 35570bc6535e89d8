# syntax=docker/dockerfile:1.7
# attnserve: exact attention (FlashAttention kernels in Triton) over HTTP :8000 and gRPC :8001.
#
#   docker build -t attnserve .
#   docker run --gpus all -p 8000:8000 -p 8001:8001 attnserve
#
# Options: ATTNSERVE_* environment variables (every `python -m service --help` flag has one), e.g.
#   docker run --gpus all -p 8000:8000 -p 8001:8001 -e ATTNSERVE_MAX_QUEUE_SIZE=256 \
#     -v attnserve-triton:/var/cache/attnserve/triton attnserve
# See docs/deploy.md. The Python install is docker/install.sh, the same script CI runs.

# CUDA 12.8 runtime + cuDNN 9 on Ubuntu 24.04 (Python 3.12). A CUDA 12.8 build runs on any driver
# >= 570, including the CUDA 13.0 drivers of our GPU hosts. For CUDA 13 use
#   --build-arg CUDA_IMAGE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04 \
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# Pin further by digest (CUDA_IMAGE=nvidia/cuda:...@sha256:...) once the image is pulled in CI.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------
# builder: a venv at /opt/venv with torch (CUDA build), triton==3.6.0 and the pins of
# pyproject.toml, plus the generated gRPC stubs. Nothing here is compiled from source.
# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS builder

ARG TORCH_SPEC=torch==2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
# DL3008 (pin apt versions): Ubuntu's archive drops superseded versions, so exact pins break the
# build within weeks; the base image tag (and digest, when pinned) fixes the distribution instead.

WORKDIR /app
# The context is whitelisted by .dockerignore: pyproject.toml, service/, kernels/, proto/ and the
# two docker/ scripts the image uses (no tests, venvs, wheels, reports or caches).
COPY . /app/

# The pip cache lives in a BuildKit cache mount, so a source change re-runs the install without
# downloading torch and its CUDA libraries again; nothing of it lands in a layer.
RUN --mount=type=cache,target=/root/.cache/pip \
    TORCH_INDEX_URL="${TORCH_INDEX_URL}" sh /app/docker/install.sh /opt/venv "${TORCH_SPEC}" /app

# ---------------------------------------------------------------------------------------------
# runtime
# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS runtime

# Triton JIT-compiles its kernels on first use and, for that, builds a small C launcher module
# against Python.h: the runtime image needs a C compiler (gcc + libc6-dev) and the Python headers
# (python3-dev). ptxas comes inside the triton wheel; libcuda comes from the host driver through
# the NVIDIA container toolkit (`--gpus all`).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# DL3008: as in the builder stage.

# Non-root user; its Triton cache directory is a volume so that restarts skip recompilation
# (mount a named volume or a PersistentVolume there to keep it across containers).
RUN groupadd --system --gid 10001 attnserve \
    && useradd --system --uid 10001 --gid attnserve --create-home --home-dir /home/attnserve \
       --shell /usr/sbin/nologin attnserve \
    && mkdir -p /var/cache/attnserve/triton \
    && chown -R attnserve:attnserve /var/cache/attnserve

COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /app /app

ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    HOME=/home/attnserve \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TRITON_CACHE_DIR=/var/cache/attnserve/triton \
    ATTNSERVE_HOST=0.0.0.0 \
    ATTNSERVE_HTTP_PORT=8000 \
    ATTNSERVE_GRPC_PORT=8001 \
    ATTNSERVE_DEVICE=auto \
    ATTNSERVE_LOG_LEVEL=info

VOLUME ["/var/cache/attnserve/triton"]
WORKDIR /app
# Numeric, so that Kubernetes can verify runAsNonRoot without reading /etc/passwd.
USER 10001:10001
EXPOSE 8000 8001

# Healthy = ready: /readyz answers 200 only once every worker has compiled and warmed its kernels
# (the service warms at start, ATTNSERVE_WARMUP_SHAPES), and 503 again while draining. The start
# period covers a cold Triton cache; with a warm cache volume readiness comes in seconds.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "/app/docker/healthcheck.py"]

# SIGTERM: the server stops taking work, reports not-ready, finishes held requests, exits.
# Give it time: `docker stop -t 90`, compose's stop_grace_period, or Kubernetes'
# terminationGracePeriodSeconds (see docker/).
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "service"]
CMD []

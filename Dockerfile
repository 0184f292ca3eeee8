# syntax=docker/dockerfile:1
#
# The handoff image: one image, three processes. The entrypoint's first argument
# picks the process (lb, node_sidecar, node_engine); the rest are its flags.
#
#   docker build -t handoff:0.1.0 .                                # CUDA (default)
#   docker build --build-arg VARIANT=cpu -t handoff:0.1.0-cpu .    # CPU only
#
# CUDA: torch from PyPI (its wheels bring their own CUDA runtime; the host needs
# only a recent enough NVIDIA driver) plus the `gpu` extra (torch_memory_saver).
# CPU: torch from the PyTorch CPU index, no `gpu` extra.
# Needs BuildKit (the default builder of Docker 23+).

# Which base the image is built on: cuda (default) or cpu.
ARG VARIANT=cuda
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_BASE=python:3.12-slim-bookworm

# ---- bases: a Python 3.11+ interpreter on each; build and runtime share it ----
FROM ${CUDA_BASE} AS base-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM ${CPU_BASE} AS base-cpu

# ---- build: the project and its dependencies in a virtual environment ----
FROM base-${VARIANT} AS build
ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY handoff ./handoff
COPY lb ./lb
COPY node_sidecar ./node_sidecar
COPY node_engine ./node_engine
RUN set -eux; \
    case "$VARIANT" in \
      cuda) pip install "torch==${TORCH_VERSION}" \
            && pip install ".[gpu]" ;; \
      cpu)  pip install --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}" \
            && pip install . ;; \
      *)    echo "VARIANT must be cuda or cpu, not '${VARIANT}'" >&2; exit 1 ;; \
    esac; \
    python -c "import torch, handoff, lb, node_sidecar, node_engine; print('torch', torch.__version__)"

# ---- runtime: the virtual environment, a non-root user, the entrypoint ----
FROM base-${VARIANT} AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="handoff" \
      org.opencontainers.image.description="Control plane that lets RL training and LLM serving share GPUs" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.handoff.variant="${VARIANT}"
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/handoff \
        --shell /usr/sbin/nologin handoff
COPY --from=build /opt/venv /opt/venv
COPY --chmod=0755 docker/entrypoint.sh /usr/local/bin/handoff-entrypoint
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/handoff
USER 10001:10001
WORKDIR /home/handoff
# lb listens on 8000 and node_sidecar on 8080 by the chart's defaults; the engine
# listens on 127.0.0.1 only and is never exposed.
EXPOSE 8000 8080
ENTRYPOINT ["/usr/local/bin/handoff-entrypoint"]
CMD ["--help"]

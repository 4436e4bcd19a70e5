"""The gRPC health services a lorafleet server reports, and what each promises.

Readiness is the overall status (service ``""``) and the status of each served service: SERVING
while the process can do its work now. Liveness is the service ``LIVENESS``: SERVING while the
process is not wedged, whatever it depends on, so that a probe on it restarts only a process that
a restart can help (a Redis outage, a model still loading or a drain is no reason to restart).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from conventions.tls import add_port

LIVENESS = "lorafleet.liveness"


async def serve_health_port(servicer, host: str, port: int) -> grpc.aio.Server | None:
    """Starts a plaintext gRPC server on ``host:port`` with ``servicer`` (grpc.health.v1) as its only
    service, for probes that cannot speak TLS (Kubernetes' gRPC probes) beside a server that serves TLS;
    it tells no more than whether the process is ready and alive. Returns the server, to stop with the
    process, or None when ``port`` is 0. Raises ConfigError naming --health-port when it cannot listen
    there (the port taken, by another process or by this one's own --port or --metrics-port)."""
    if not port:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    add_port(server, f"{host}:{port}", None, "--health-port")
    await server.start()
    return server

"""The control-plane process: wiring, start-up and graceful shutdown.

Health: readiness (service "" and each served service) is SERVING exactly while Redis answers,
since every RPC needs the registry; liveness (``conventions.health.LIVENESS``) is SERVING while the
process runs, through a Redis outage too, so an outage takes replicas out of rotation without
restarting them all at once.

Run with ``python -m control_plane.server --help`` (or ``lorafleet control-plane``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from lorafleet.v1 import adapter_admin_pb2, adapter_admin_pb2_grpc, membership_pb2, membership_pb2_grpc

from control_plane.admin_service import AdapterAdminService
from control_plane.config import ControlPlaneConfig, build_parser, config_from_args
from control_plane.errors import StoreUnavailable
from control_plane.fleet import Fleet
from control_plane.leader import LeaderLease
from control_plane.membership_service import PodMembershipService
from control_plane.metrics import ControlPlaneMetrics
from control_plane.pod_client import PodClients
from control_plane.reconciler import Reconciler
from control_plane.registry import Registry
from control_plane.store import Store
from conventions import logs
from conventions.auth import CONTROL_PLANE_GRANTS, Role, RoleAuthInterceptor
from conventions.health import LIVENESS, serve_health_port
from conventions.process import run_server
from conventions.status import ErrorStatusInterceptor
from conventions.tls import add_port

log = logging.getLogger("control_plane.server")  # not "__main__" under python -m

SERVICES = (
    adapter_admin_pb2.DESCRIPTOR.services_by_name["AdapterAdmin"].full_name,
    membership_pb2.DESCRIPTOR.services_by_name["PodMembership"].full_name,
)
_SHUTDOWN_GRACE_S = 5.0
_REDIS_PING_INTERVAL_S = 0.5
# How long pod records read from Redis are reused (Fleet): short next to a pod's 3 s heartbeat, long
# next to the milliseconds between admin calls under load.
_POD_VIEW_CACHE_S = 0.25


async def serve(config: ControlPlaneConfig, stop: asyncio.Event | None = None) -> None:
    """Serves until ``stop`` is set or the process receives SIGTERM/SIGINT, then drains."""
    stop = stop or asyncio.Event()
    tokens = config.role_tokens()
    metrics = ControlPlaneMetrics()
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.host)
    store = Store(config.redis_url, config.key_prefix, config.event_stream_maxlen)
    fleet = Fleet(store, config.base_model, config.pod_lease_ttl, config.pod_grace, _POD_VIEW_CACHE_S)
    registry = Registry(store, fleet, config.base_model)
    lease = LeaderLease(store, config.replica, config.leader_lease_ttl, metrics)
    tls = config.tls_files()
    pods = PodClients(tokens[Role.POD], config.command_timeout_s, config.pod_probe_timeout, tls.dialer())
    reconciler = Reconciler(config, store, fleet, lease, pods, metrics)

    server = grpc.aio.server(interceptors=[ErrorStatusInterceptor(metrics.observe_rpc),
                                           RoleAuthInterceptor(tokens, CONTROL_PLANE_GRANTS)])
    adapter_admin_pb2_grpc.add_AdapterAdminServicer_to_server(AdapterAdminService(registry), server)
    membership_pb2_grpc.add_PodMembershipServicer_to_server(PodMembershipService(fleet, registry), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    add_port(server, address, tls.server_credentials())

    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    health_server = await serve_health_port(health_servicer, config.host, config.health_port)
    log.info("control plane serving", extra={"address": address, "tls": tls.serving.value,
                                             "to_pods": pods.mode.value, "replica": lease.replica,
                                             "key_prefix": config.key_prefix, "metrics_port": config.metrics_port,
                                             "health_port": config.health_port})
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(_watch_redis(store, health_servicer, metrics, stop)),
             asyncio.create_task(lease.run(stop)), asyncio.create_task(reconciler.run(stop))]
    try:
        await stop.wait()
    finally:
        stop.set()
        log.info("control plane stopping")
        await health_servicer.enter_graceful_shutdown()
        # The loops notice ``stop`` within one interval; lease.run then releases the lease so
        # that another replica takes over at once. Cancelling is the fallback only, because a
        # cancellation inside a Redis call can surface as a connection error instead.
        _, late = await asyncio.wait(tasks, timeout=config.reconcile_interval + _SHUTDOWN_GRACE_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop(_SHUTDOWN_GRACE_S)
        if health_server is not None:
            await health_server.stop(None)
        await pods.close()
        await store.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        log.info("control plane stopped")


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    """Sets readiness; liveness stays as it is."""
    for name in ("", *SERVICES):
        await servicer.set(name, status)


async def _watch_redis(store: Store, servicer: health.aio.HealthServicer, metrics: ControlPlaneMetrics,
                       stop: asyncio.Event) -> None:
    """Readiness SERVING exactly while Redis answers: every RPC needs the registry."""
    up = None
    while not stop.is_set():
        try:
            await store.ping()
            now_up = True
        except StoreUnavailable as e:
            now_up = False
            if up is not False:
                log.warning("Redis unreachable; readiness is NOT_SERVING (liveness stays SERVING)",
                            extra={"error": str(e)})
        if now_up != up:
            up = now_up
            metrics.redis_up.set(1 if up else 0)
            status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
            await _set_health(servicer, status)
            if up:
                log.info("Redis reachable; readiness is SERVING")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), _REDIS_PING_INTERVAL_S)


def main(argv: list[str] | None = None) -> int:
    """``lorafleet control-plane``: parses flags, then serves until SIGTERM or Ctrl-C."""
    args = build_parser().parse_args(argv)

    async def start() -> None:
        config = config_from_args(args)
        logs.configure(args.log_level, config.replica)
        await serve(config)

    return run_server("lorafleet control-plane", start)


if __name__ == "__main__":
    sys.exit(main())

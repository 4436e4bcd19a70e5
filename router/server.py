"""The router process, ``lorafleet router``: wiring, start-up and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from conventions import logs
from conventions.auth import read_token
from conventions.health import serve_health_port
from conventions.pod_cost import Weights
from conventions.process import run_server
from conventions.status import ErrorStatusInterceptor
from conventions.tls import add_port
from router.access import Access, KeysFile, needs_limiter
from router.channels import PodChannels
from router.config import RouterConfig, build_parser, config_from_args, parse_api_keys
from router.door import Door
from router.forwarder import SERVICE, Forwarder
from router.http_api import HttpApi
from router.limits import RateLimiter
from router.metrics import RouterMetrics
from router.picker import PodPicker
from router.refresher import StateRefresher
from router.tenants import open_book, parse_tenants

log = logging.getLogger("lorafleet.router")

_SHUTDOWN_GRACE_S = 5.0


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Serves until ``stop`` is set or the process receives SIGTERM/SIGINT. Health is NOT_SERVING until
    the first read of the control plane, and again while shutting down."""
    stop = stop or asyncio.Event()
    token = read_token(config.token_file)
    metrics = RouterMetrics()
    pod_dialer = config.pod_dialer()
    channels = PodChannels(pod_dialer)
    refresher = StateRefresher(config, token, channels, metrics)
    picker = PodPicker(lambda: refresher.view, Weights(prefix=config.prefix_weight), load_bound=config.load_bound,
                       share_bound=config.share_bound)
    forwarder = Forwarder(picker, channels, metrics, config.retries)
    access = build_access(config, metrics)
    door = Door(forwarder, access, metrics)
    http_api = HttpApi(door, lambda: refresher.view, metrics, access, config.http_max_body_bytes,
                       config.http_timeout)

    server = grpc.aio.server(interceptors=[ErrorStatusInterceptor()])
    server.add_generic_rpc_handlers((door.handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    doors = config.doors_tls()
    add_port(server, address, doors.server_credentials())
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.host)
    await server.start()
    health_server = await serve_health_port(health_servicer, config.host, config.health_port)
    if config.http_port:
        try:
            await http_api.start(config.host, config.http_port, doors.ssl_context())
        except OSError as e:
            await server.stop(None)
            raise SystemExit(f"lorafleet router: cannot serve HTTP on {config.host}:{config.http_port}: {e.strerror}"
                             "; is the port taken?") from None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    refreshing = asyncio.create_task(refresher.run(stop))
    reloading = asyncio.create_task(access.run(stop, config.keys_reload_interval))
    log.info("router listening", extra={"address": address, "http_port": config.http_port,
                                        "control_plane": config.control_plane, "tls": doors.serving.value,
                                        "to_control_plane": config.control_plane_dialer().mode.value,
                                        "to_pods": pod_dialer.mode.value})
    try:
        done, _ = await asyncio.wait([asyncio.create_task(refresher.first_read.wait()),
                                      asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if refresher.first_read.is_set():
            for name in ("", SERVICE):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("router serving", extra={"pods": len(refresher.view.pods),
                                              "adapters": len(refresher.view.adapters)})
        await stop.wait()
    finally:
        stop.set()
        log.info("router stopping")
        await health_servicer.enter_graceful_shutdown()
        await http_api.stop()
        await server.stop(_SHUTDOWN_GRACE_S)
        if health_server is not None:
            await health_server.stop(None)
        await refreshing
        await reloading
        await access.close()
        await refresher.close()
        await channels.close()
        log.info("router stopped")


def build_access(config: RouterConfig, metrics: RouterMetrics) -> Access:
    """The gate of both doors, as the flags say; logs which doors are open."""
    limiter = None
    if config.limits_redis_url:
        limiter = RateLimiter(config.limits_redis_url, on_error=metrics.limits_store_errors.inc)
    if config.tenants_file is not None:
        keys = KeysFile(config.tenants_file, parse_tenants, (lambda book: None) if limiter else needs_limiter)
        log.info("tenants guard both doors", extra={"tenants": [t.name for t in keys.book.tenants],
                                                    "limits": limiter is not None})
        return Access(keys, limiter, grpc_guarded=True)
    if config.api_key_file is not None:
        keys = KeysFile(config.api_key_file, lambda text, source: open_book(parse_api_keys(text, source)))
        log.warning("no tenants configured: --api-key-file keys guard the HTTP API and may use every adapter;"
                    " the gRPC door is open to anyone (--tenants-file guards both)")
        return Access(keys, limiter, grpc_guarded=False)
    log.warning("no tenants configured: both doors are open, every caller may use every adapter with no limit"
                " (give --tenants-file to require keys)")
    return Access(None, limiter, grpc_guarded=False)


def main(argv: list[str] | None = None) -> int:
    """``lorafleet router``: parses flags, then serves until SIGTERM or Ctrl-C."""
    args = build_parser().parse_args(argv)

    async def start() -> None:
        config = config_from_args(args)
        logs.configure(args.log_level)
        await serve(config)

    return run_server("lorafleet router", start)


if __name__ == "__main__":
    sys.exit(main())

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
from conventions.process import run_server
from conventions.status import ErrorStatusInterceptor
from router.channels import PodChannels
from router.config import RouterConfig, build_parser, config_from_args
from router.forwarder import SERVICE, Forwarder
from router.http_api import HttpApi
from router.metrics import RouterMetrics
from router.picker import PodPicker
from router.refresher import StateRefresher

log = logging.getLogger("lorafleet.router")

_SHUTDOWN_GRACE_S = 5.0


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Serves until ``stop`` is set or the process receives SIGTERM/SIGINT. Health is NOT_SERVING until
    the first read of the control plane, and again while shutting down."""
    stop = stop or asyncio.Event()
    token = read_token(config.admin_token_file)
    metrics = RouterMetrics()
    channels = PodChannels()
    refresher = StateRefresher(config, token, channels, metrics)
    forwarder = Forwarder(PodPicker(lambda: refresher.view), channels, metrics, config.retries)
    http_api = HttpApi(forwarder, lambda: refresher.view, metrics, config.api_keys(), config.http_max_body_bytes)

    server = grpc.aio.server(interceptors=[ErrorStatusInterceptor()])
    server.add_generic_rpc_handlers((forwarder.handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"lorafleet router: cannot listen on {address}; is the port taken?")
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.host)
    await server.start()
    if config.http_port:
        try:
            await http_api.start(config.host, config.http_port)
        except OSError as e:
            await server.stop(None)
            raise SystemExit(f"lorafleet router: cannot serve HTTP on {config.host}:{config.http_port}: {e.strerror}"
                             "; is the port taken?") from None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    refreshing = asyncio.create_task(refresher.run(stop))
    log.info("router listening", extra={"address": address, "http_port": config.http_port,
                                        "control_plane": config.control_plane})
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
        await refreshing
        await refresher.close()
        await channels.close()
        log.info("router stopped")


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

"""The data-plane pod process: ``lorafleet data-plane ...``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from lorafleet.v1 import data_plane_admin_pb2, data_plane_admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from prometheus_client import start_http_server

from conventions import logs
from conventions.auth import POD_GRANTS, Role, RoleAuthInterceptor, read_token
from conventions.errors import ConfigError
from conventions.health import serve_health_port
from conventions.process import run_server
from conventions.status import ErrorStatusInterceptor
from conventions.tls import add_port
from data_plane.config import DataPlaneConfig, build_parser
from data_plane.demand import DemandMeter
from data_plane.engine.threads import compute_on_one_thread
from data_plane.health import PodHealth
from data_plane.membership import FencingGuard, MembershipClient
from data_plane.metrics import PodMetrics
from data_plane.model.demo_model import demo_model_dir
from data_plane.pod import build_engine
from data_plane.servicers import EngineHandle
from data_plane.servicers.admin import DataPlaneAdminServicer, pod_state
from data_plane.servicers.generation import GenerationServicer

log = logging.getLogger("lorafleet.data_plane")


async def serve(config: DataPlaneConfig) -> None:
    """Runs the pod until SIGTERM/SIGINT, then drains in-flight requests and exits."""
    compute_on_one_thread(asyncio.get_running_loop())  # first: the model thread's team is the only one
    interceptors = [ErrorStatusInterceptor()]
    if config.admin_token_file:
        tokens = {Role.POD: read_token(config.admin_token_file)}
        if config.reader_token_file:
            tokens[Role.READER] = read_token(config.reader_token_file)
        interceptors.insert(0, RoleAuthInterceptor(tokens, POD_GRANTS))
    server = grpc.aio.server(interceptors=interceptors)
    pod_health = PodHealth(config.stall_timeout)
    health_pb2_grpc.add_HealthServicer_to_server(pod_health.servicer, server)
    await pod_health.set_ready(False)  # live, not ready: the model loads
    reflection.enable_server_reflection(
        (generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
         data_plane_admin_pb2.DESCRIPTOR.services_by_name["DataPlaneAdmin"].full_name,
         health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    tls = config.tls_files()
    add_port(server, f"{config.host}:{config.port}", tls.server_credentials())
    handle = EngineHandle()
    guard = FencingGuard()
    model_id = (config.model or demo_model_dir()).name  # the base-model id adapters are registered against
    demand = DemandMeter(config.demand_window)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(handle, demand), server)
    data_plane_admin_pb2_grpc.add_DataPlaneAdminServicer_to_server(
        DataPlaneAdminServicer(handle, guard, config.resolved_pod_id, model_id), server)
    await server.start()  # health answers NOT_SERVING (and RPCs UNAVAILABLE) while the model loads
    health_server = await serve_health_port(pod_health.servicer, config.host, config.health_port)

    metrics = PodMetrics()
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
    membership = None
    token = read_token(config.admin_token_file) if config.admin_token_file else ""
    engine = None
    control_plane_dialer = config.control_plane_dialer()
    if config.control_plane:
        membership = MembershipClient(
            config.control_plane, token, config.resolved_pod_id, config.resolved_endpoint, model_id,
            lambda: pod_state(engine, config.resolved_pod_id, model_id), config.heartbeat_interval, guard=guard,
            is_ready=lambda: engine is not None and engine.accepting and not pod_health.stalled,
            dialer=control_plane_dialer, demand=demand,
            demand_report_top=config.demand_report_top)

    engine = await asyncio.to_thread(build_engine, config, metrics, membership.resolve if membership else None)
    # The ~300k objects start-up leaves (modules, the model, the tokenizer's tables) live as long as the
    # pod: out of the collector's sight, a full collection no longer walks them, which measured 220-320 ms
    # on the demo model, a whole step's stall for every running stream, against ~0 ms frozen.
    gc.collect()  # start-up's garbage first: frozen, it would stay for good
    gc.freeze()
    metrics.watch(engine.snapshot)
    metrics.set_precision(engine.precision)
    engine.start()
    handle.engine = engine
    heartbeats = asyncio.get_running_loop().create_task(membership.run()) if membership else None
    watchdog = asyncio.get_running_loop().create_task(pod_health.watch(engine))
    await pod_health.set_ready(True)
    log.info("serving", extra={"address": f"{config.host}:{config.port}", "pod_id": config.resolved_pod_id,
                               "tls": tls.serving.value,
                               "to_control_plane": control_plane_dialer.mode.value if membership else None})

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining", extra={"grace_s": config.drain_grace})
    await pod_health.shutdown()
    await engine.drain(config.drain_grace)
    for task in (watchdog, heartbeats):
        if task:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    await server.stop(grace=1.0)
    if health_server is not None:
        await health_server.stop(None)
    await engine.stop()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = DataPlaneConfig.from_args(args)
    except (ValueError, ConfigError) as e:
        parser.error(str(e))
    logs.configure(args.log_level)
    return run_server("lorafleet data-plane", lambda: serve(config))


if __name__ == "__main__":
    sys.exit(main())

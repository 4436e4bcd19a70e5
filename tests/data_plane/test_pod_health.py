"""The pod's health: an engine loop that makes no progress while requests wait turns readiness and
liveness NOT_SERVING, and progress turns them back; an idle engine is never stalled."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.processes import free_port
from conventions.health import LIVENESS
from data_plane.config import DataPlaneConfig
from data_plane.engine.sequence import SamplingParams
from data_plane.health import SERVICES, PodHealth
from data_plane.metrics import PodMetrics
from data_plane.pod import build_engine

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
ALL = ("", *SERVICES, LIVENESS)


class HealthServer:
    """A PodHealth served over gRPC on loopback; ``statuses()`` reads every service's status."""

    def __init__(self, pod_health: PodHealth) -> None:
        self.pod_health = pod_health
        self.port = free_port()

    async def __aenter__(self):
        self.server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.pod_health.servicer, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(0)

    async def statuses(self) -> dict[str, int]:
        return {s: (await self.stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=2)).status for s in ALL}


async def until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := await predicate():
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_an_idle_engine_is_not_stalled_however_long_since_its_last_step():
    engine = SimpleNamespace(last_progress=0.0, snapshot=lambda: SimpleNamespace(running=0, waiting=0))

    async def go():
        pod_health = PodHealth(stall_timeout_s=0.2, clock=lambda: 3600.0)
        async with HealthServer(pod_health) as s:
            await pod_health.set_ready(True)
            watch = asyncio.create_task(pod_health.watch(engine))
            await asyncio.sleep(0.3)
            watch.cancel()
            return pod_health.stalled, await s.statuses()

    stalled, statuses = asyncio.run(go())
    assert not stalled
    assert statuses == dict.fromkeys(ALL, SERVING)


def test_a_loading_pod_is_live_but_not_ready():
    async def go():
        pod_health = PodHealth(stall_timeout_s=30)
        async with HealthServer(pod_health) as s:
            await pod_health.set_ready(False)
            return await s.statuses()

    assert asyncio.run(go()) == {**dict.fromkeys(("", *SERVICES), NOT_SERVING), LIVENESS: SERVING}


@pytest.mark.slow
def test_a_wedged_engine_loop_turns_readiness_and_liveness_not_serving_until_it_moves_again(demo_model_dir):
    config = DataPlaneConfig(model=demo_model_dir, max_loras=1, max_cpu_loras=1, num_kv_blocks=32)
    release = threading.Event()

    async def go():
        engine = build_engine(config, PodMetrics())
        forward = engine.runner.execute

        def wedged(step):  # the forward pass hangs (a stuck device, a deadlock) until released
            release.wait(60)
            return forward(step)

        engine.runner.execute = wedged
        engine.start()
        pod_health = PodHealth(stall_timeout_s=0.5)
        watch = asyncio.create_task(pod_health.watch(engine))
        try:
            async with HealthServer(pod_health) as s:
                await pod_health.set_ready(True)
                before = await s.statuses()
                request = asyncio.create_task(_tokens(engine, engine.tokenizer.encode("Hello"), 4))
                started = time.monotonic()
                # The pod publishes readiness before liveness, and statuses() reads the services one by one,
                # so the read that first sees liveness flipped may have read readiness before the flip: the
                # whole picture is the next read's.
                await until(lambda: _when(s.statuses(), lambda v: v[LIVENESS] == NOT_SERVING), 5,
                            "liveness NOT_SERVING")
                flipped_after = time.monotonic() - started
                during = await s.statuses()
                release.set()
                tokens = await asyncio.wait_for(request, 30)
                await until(lambda: _when(s.statuses(), lambda v: v[LIVENESS] == SERVING), 5, "SERVING again")
                after = await s.statuses()
                return before, during, flipped_after, tokens, after
        finally:
            release.set()
            watch.cancel()
            await engine.stop()

    before, during, flipped_after, tokens, after = asyncio.run(go())
    assert before == after == dict.fromkeys(ALL, SERVING)
    assert during == dict.fromkeys(ALL, NOT_SERVING)
    assert flipped_after >= 0.5  # not before the stall timeout
    assert len(tokens) == 4


async def _tokens(engine, ids: list[int], max_tokens: int) -> list[int]:
    out = []
    async for step in engine.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
        out += [t.id for t in step.tokens]
    return out


async def _when(value, check):
    v = await value
    return v if check(v) else None

"""Adapter loads through the engine on the demo model: one load per name however many requests
wait for it, and each load's outcome counted once in the pod's Prometheus registry."""

from __future__ import annotations

import asyncio

import pytest

from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from data_plane.engine.engine import Engine, EngineLimits
from data_plane.engine.sequence import SamplingParams
from data_plane.errors import AdapterNotFound, InvalidAdapter, LorafleetError
from data_plane.lora.runtime import LoraRuntime
from data_plane.metrics import PodMetrics
from data_plane.model import load_model

pytestmark = pytest.mark.slow

ROOT = demo_adapter_dir(DEMO_ADAPTERS[0]).parent
WRONG_SHA = "0" * 64


@pytest.fixture
def model(demo_model_dir):
    # A model per test: a LoRA runtime wraps the model's layers, once.
    return load_model(demo_model_dir, "float32")


class GatedResolver:
    """Resolves every name to its demo directory with ``sha256``, once ``gate`` opens; counts calls."""

    def __init__(self, sha256: str = "") -> None:
        self.gate = asyncio.Event()
        self.calls = 0
        self._sha256 = sha256

    async def __call__(self, name: str) -> tuple[str, str]:
        self.calls += 1
        await self.gate.wait()
        if name not in DEMO_ADAPTERS:
            raise AdapterNotFound(f"adapter {name!r} is not registered")
        return str(ROOT / name), self._sha256


def engine_on(model, demo_tokenizer, resolver, metrics: PodMetrics) -> Engine:
    lora = LoraRuntime(model, max_loras=1, max_cpu_loras=1, max_rank=16, max_tokens=64, adapter_roots=(ROOT,))
    limits = EngineLimits(max_num_seqs=2, max_num_batched_tokens=64, max_waiting=8, block_size=16, num_kv_blocks=16,
                          max_model_len=2048, max_queue_delay_s=0.0)
    engine = Engine(model, demo_tokenizer, lora, limits, resolver, metrics)
    metrics.watch(engine.snapshot)
    return engine


def sample(metrics: PodMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def drain(engine: Engine, adapter: str) -> None:
    async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2), adapter):
        pass


async def settle() -> None:
    """Waits until every task but this one and the engine's loop has ended: loads in flight too."""
    me = asyncio.current_task()
    while any(t is not me and t.get_name() != "engine-loop" for t in asyncio.all_tasks()):
        await asyncio.sleep(0.01)


def test_a_failed_load_is_counted_once_however_many_requests_wait_for_it(model, demo_tokenizer):
    metrics = PodMetrics()

    async def go():
        resolver = GatedResolver(sha256=WRONG_SHA)
        engine = engine_on(model, demo_tokenizer, resolver, metrics)
        engine.start()
        try:
            requests = [asyncio.create_task(drain(engine, "pirate")) for _ in range(3)]
            while resolver.calls < len(requests):  # every request is resolving before any load starts
                await asyncio.sleep(0.01)
            resolver.gate.set()
            results = await asyncio.gather(*requests, return_exceptions=True)
            await settle()
            return results, engine.snapshot()
        finally:
            await engine.stop()

    results, state = asyncio.run(go())
    assert all(isinstance(r, InvalidAdapter) for r in results), results
    assert sample(metrics, "lorafleet_adapter_loads_total", tier="cpu", outcome="error") == 1
    assert sample(metrics, "lorafleet_adapter_load_seconds_count", outcome="error") == 1
    assert sample(metrics, "lorafleet_adapter_loads_total", tier="cpu", outcome="ok") == 0
    assert metrics.registry.get_sample_value("lorafleet_adapter_load_failures_total") is None
    assert state.adapters == () and state.waiting == 0


def test_an_admin_load_counts_its_outcome_once_and_a_retry_with_the_right_weights_succeeds(model, demo_tokenizer):
    metrics = PodMetrics()

    async def go():
        engine = engine_on(model, demo_tokenizer, GatedResolver(), metrics)
        try:
            with pytest.raises(InvalidAdapter, match="sha256"):
                await engine.adapters.load("shouty", str(ROOT / "shouty"), WRONG_SHA)
            residency = await engine.adapters.load("shouty", str(ROOT / "shouty"))
            pinned = await engine.adapters.pin("shouty")
            return residency, pinned, engine.snapshot()
        finally:
            await engine.stop()

    residency, pinned, state = asyncio.run(go())
    assert residency.name == "shouty" and pinned.pinned
    assert sample(metrics, "lorafleet_adapter_loads_total", tier="cpu", outcome="error") == 1
    assert sample(metrics, "lorafleet_adapter_loads_total", tier="cpu", outcome="ok") == 1
    assert sample(metrics, "lorafleet_adapter_load_seconds_count", outcome="error") == 1
    assert sample(metrics, "lorafleet_adapter_load_seconds_count", outcome="ok") == 1
    assert [(r.name, r.pinned) for r in state.adapters] == [("shouty", True)]
    assert state.slots.pinned == 1 and state.cpu.pinned == 1


def test_an_unknown_adapter_is_refused_before_the_request_is_queued_and_counts_no_load(model, demo_tokenizer):
    metrics = PodMetrics()

    async def go():
        resolver = GatedResolver()
        resolver.gate.set()
        engine = engine_on(model, demo_tokenizer, resolver, metrics)
        try:
            with pytest.raises(AdapterNotFound):
                await drain(engine, "never-registered")
            return engine.snapshot()
        finally:
            await engine.stop()

    state = asyncio.run(go())
    assert state.waiting == 0
    assert sample(metrics, "lorafleet_adapter_loads_total", tier="cpu", outcome="error") == 0
    assert sample(metrics, "lorafleet_adapter_load_seconds_count", outcome="error") == 0


def test_a_load_that_crashes_ends_its_requests_with_internal_once_instead_of_retrying(model, demo_tokenizer):
    metrics = PodMetrics()

    async def go():
        resolver = GatedResolver()
        resolver.gate.set()
        engine = engine_on(model, demo_tokenizer, resolver, metrics)

        def crash(*args):
            raise RuntimeError("disk on fire")

        engine.lora.read = crash  # a fault no domain check foresaw, inside the load's worker thread
        engine.start()
        try:
            result = await asyncio.wait_for(asyncio.gather(drain(engine, "pirate"), return_exceptions=True), 30)
            await asyncio.sleep(0.5)  # time for a retry loop to show, were there one
            await settle()
            return result[0]
        finally:
            await engine.stop()

    error = asyncio.run(go())
    assert isinstance(error, LorafleetError) and error.status == "INTERNAL", error
    assert "RuntimeError" in str(error) and "disk on fire" not in str(error)
    assert sample(metrics, "lorafleet_adapter_loads_total", tier="cpu", outcome="error") == 1

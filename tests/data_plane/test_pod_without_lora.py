"""A pod started without LoRA (--no-enable-lora): plain projections, no adapter slots, no LoRA metadata in
any step; it serves base-model requests and refuses every request or load naming an adapter with
FAILED_PRECONDITION and a message that says what to do instead."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from lorafleet.v1 import data_plane_admin_pb2 as dpa

from benchmarks.processes import PodProcess
from data_plane.config import DataPlaneConfig
from data_plane.engine.sequence import SamplingParams
from data_plane.errors import LoraDisabled
from data_plane.lora.layer import LoRAProjection
from data_plane.metrics import PodMetrics
from data_plane.pod import build_engine
from tests.grpc_helpers import collect, request


def test_an_engine_without_lora_has_no_lora_layers_or_slots_and_refuses_adapters(tiny_pod_files):
    model_dir, root, _ = tiny_pod_files
    config = DataPlaneConfig(model=model_dir, dtype="float32", adapter_roots=(root,), enable_lora=False,
                             num_kv_blocks=64, max_queue_delay=0)
    engine = build_engine(config, PodMetrics())
    assert not any(isinstance(m, LoRAProjection) for m in engine.model.modules())
    assert engine.runner.lora is None and engine.runner.inputs.lora is None
    assert engine.snapshot().slots.capacity == 0

    async def run():
        engine.start()
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            tokens = [t.id for step in [s async for s in engine.generate([5, 6, 7], params)] for t in step.tokens]
            with pytest.raises(LoraDisabled) as refused:
                async for _ in engine.generate([5, 6, 7], params, "fresh-r4"):
                    pass
            with pytest.raises(LoraDisabled):
                await engine.adapters.load("fresh-r4", "fresh-r4")
            return tokens, str(refused.value)
        finally:
            await engine.stop()

    tokens, message = asyncio.run(run())
    assert len(tokens) == 4
    assert "--no-enable-lora" in message and "without an adapter" in message and "fresh-r4" in message
    assert engine.snapshot().adapters == ()


@pytest.fixture(scope="module")
def pod_without_lora(tiny_pod_files, tmp_path_factory):
    model_dir, root, _ = tiny_pod_files
    process = PodProcess(tmp_path_factory.mktemp("no-lora-pod"), "--model", str(model_dir), "--dtype", "float32",
                         "--no-enable-lora", "--adapter-root", str(root), "--num-kv-blocks", "64",
                         "--max-queue-delay", "0", name="no-lora")
    try:
        yield process.start()
    finally:
        process.stop()


@pytest.mark.slow
def test_a_pod_without_lora_serves_the_base_model_and_refuses_adapters_with_failed_precondition(pod_without_lora):
    pod = pod_without_lora
    _, tokens, last = collect(pod, request("w5 w6 w7", max_tokens=4, chat=False, ignore_eos=True))
    assert len(tokens) == 4 and last.usage.completion_tokens == 4

    with pytest.raises(grpc.RpcError) as refused:
        collect(pod, request("w5 w6 w7", "fresh-r4", max_tokens=4, chat=False))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--no-enable-lora" in refused.value.details() and "without an adapter" in refused.value.details()

    with pytest.raises(grpc.RpcError) as load:
        pod.admin().LoadAdapter(dpa.LoadAdapterRequest(name="fresh-r4", source="fresh-r4"), metadata=pod.auth(),
                                timeout=30)
    assert load.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    state = pod.state()
    assert state.slots.capacity == 0 and not state.adapters
    assert pod.metric("lorafleet_gpu_lora_slots_total") == 0
    assert pod.metric("lorafleet_engine_eager_steps_total") == 0

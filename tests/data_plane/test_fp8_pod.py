"""A pod on an FP8 base: a compressed-tensors checkpoint of the tiny Llama (or the unquantized one with
--quantization fp8) serves the adapters made for the unquantized base, unchanged; each request gets the same
bits alone and among fifteen others; in float32 its answers are transformers + peft's on the dequantized
weights; and everything that reports the pod's precision says "+fp8"."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from data_plane.config import DataPlaneConfig
from data_plane.engine.sequence import SamplingParams
from data_plane.metrics import PodMetrics
from data_plane.model.precision import Precision
from data_plane.pod import build_engine
from tests.data_plane.conftest import ADAPTERS, SEED
from tests.data_plane.test_batch_invariance import NUM_REQUESTS, _assert_matches_peft, alone_and_together
from tests.fp8_checkpoints import compressed_tensors_config, write_dequantized, write_fp8


@pytest.fixture(scope="module")
def fp8_pod_files(tiny_pod_files, tmp_path_factory):
    """(FP8 model directory, the unquantized base's adapter root, transformers on the dequantized weights)."""
    from transformers import AutoModelForCausalLM

    model_dir, root, _ = tiny_pod_files
    tmp = tmp_path_factory.mktemp("fp8-pod")
    fp8_dir = write_fp8(model_dir, tmp / "fp8", compressed_tensors_config("channel"))
    reference = AutoModelForCausalLM.from_pretrained(write_dequantized(fp8_dir, tmp / "dequantized"),
                                                     dtype=torch.float32).eval()
    return fp8_dir, root, reference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_pod_gives_every_request_the_same_bits_alone_and_together(fp8_pod_files, dtype):
    fp8_dir, root, _ = fp8_pod_files
    precision, alone, together, shared = alone_and_together(fp8_dir, root, dtype)
    assert precision is Precision(dtype) and shared > 0
    same = sum(a == t for a, t in zip(alone, together, strict=True))
    assert same == NUM_REQUESTS, f"{same}/{NUM_REQUESTS} requests batch-invariant in {dtype}+fp8 (seed {SEED})"


def test_adapters_of_the_unquantized_base_serve_on_the_fp8_base_as_peft_does_on_its_dequantized_weights(
        fp8_pod_files, tiny_pod_files):
    fp8_dir, root, reference = fp8_pod_files
    _, alone, _, _ = alone_and_together(fp8_dir, root, "float32")
    _assert_matches_peft(fp8_dir, root, reference, alone)
    # and close to the unquantized base's answers: the same greedy first token for most requests
    _, unquantized, _, _ = alone_and_together(tiny_pod_files[0], root, "float32")
    first = sum(a[0][0] == b[0][0] for a, b in zip(alone, unquantized, strict=True))
    assert first >= NUM_REQUESTS * 3 // 4, f"{first}/{NUM_REQUESTS} first tokens as on the unquantized base"


def serve_and_report(config: DataPlaneConfig) -> tuple:
    """A pod of ``config`` serves two requests (base model, then an adapter): (its engine, the precision its
    GetState reports, the keys its prompts' cached blocks were looked up under, each request's token ids)."""
    from data_plane.servicers.admin import pod_state

    async def run():
        engine = build_engine(config, PodMetrics())
        salts, match = [], engine.blocks.match_prefix
        engine.blocks.match_prefix = lambda seq, salt: salts.append(salt) or match(seq, salt)
        engine.start()
        try:
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            answers = [[t.id for step in [s async for s in engine.generate(list(range(3, 40)), params, adapter)]
                        for t in step.tokens] for adapter in (None, next(iter(ADAPTERS)))]
        finally:
            await engine.stop()
        return engine, pod_state(engine, "pod-0", "tiny").precision, salts, answers

    return asyncio.run(run())


def test_an_fp8_pod_reports_fp8_in_its_precision_everywhere(tiny_pod_files, caplog):
    model_dir, root, _ = tiny_pod_files
    config = DataPlaneConfig(model=model_dir, dtype="float32", quantization="fp8", adapter_roots=(root,),
                             max_loras=len(ADAPTERS), max_cpu_loras=len(ADAPTERS), max_lora_rank=32, num_kv_blocks=16)
    with caplog.at_level(logging.INFO, logger="lorafleet"):
        engine, reported, salts, _ = serve_and_report(config)
    assert engine.precision == reported == "float32+fp8"
    # cached blocks of an FP8 pod are never an unquantized pod's, with or without an adapter
    assert len(salts) >= 2 and all(salt.startswith("float32+fp8/") for salt in salts), salts
    records = {r.getMessage(): r for r in caplog.records}
    assert records["precision"].precision == "float32+fp8"
    assert records["quantization"].compute == "dequantized" and records["quantization"].source == "--quantization fp8"


def test_quantization_fp8_is_a_flag_of_the_pod():
    from data_plane.config import build_parser

    config = DataPlaneConfig.from_args(build_parser().parse_args(["--quantization", "fp8"]))
    assert config.quantization == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "int4"])


def test_a_pod_with_gpu_layout_fp8_weights_serves_the_adapters(fp8_pod_files, monkeypatch):
    # What a CUDA pod on sm_89+ holds and runs, here on CPU: e4m3 weights in memory, W8A8 through torch's CPU
    # _scaled_mm, adapter slots in the activations' dtype (warm-up fills every slot with a dummy adapter).
    import functools

    from data_plane import pod
    from data_plane.model import load_model
    from data_plane.model.quantization import FP8, Fp8Compute

    fp8_dir, root, _ = fp8_pod_files
    _, dequantized, _, _ = alone_and_together(fp8_dir, root, "float32")
    monkeypatch.setattr(pod, "load_model", functools.partial(load_model, fp8_compute=Fp8Compute.W8A8))
    precision, w8a8, _, _ = alone_and_together(fp8_dir, root, "float32")
    assert precision is Precision.FLOAT32
    first = sum(a[0][0] == b[0][0] for a, b in zip(w8a8, dequantized, strict=True))
    assert first >= NUM_REQUESTS * 3 // 4, f"{first}/{NUM_REQUESTS} first tokens as with dequantized weights"
    assert len({tuple(t for t, _, _ in answer) for answer in w8a8}) > NUM_REQUESTS // 2, "answers barely differ"
    model = pod.load_model(fp8_dir, "float32")
    assert model.layers[0].mlp.down_proj.weight.dtype == FP8

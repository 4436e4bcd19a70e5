"""The same answer whatever shares the step: in every precision a CPU pod runs, a request's greedy tokens
and log-probabilities are the same bits alone and among fifteen others (other adapters, other prompt
lengths, other requests' prefill chunks beside it, its own prompt cut into other chunks), on adapters
and prompts no other test uses; and a pod told float32 gives transformers + peft's float32 answer.

A tiny Llama (2 layers, 4 query and 2 key/value heads) stands in for the demo model: it runs the same
code, at hidden and head sizes that keep a pod's start-up and 32 requests to about a second each.
"""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch

from data_plane.config import DataPlaneConfig
from data_plane.engine.sequence import SamplingParams
from data_plane.metrics import PodMetrics
from data_plane.model.config import ModelConfig
from data_plane.model.llama import Projection
from data_plane.model.precision import Precision
from data_plane.pod import build_engine
from tests.data_plane.conftest import ADAPTERS, SEED, TINY
from tests.tolerances import logits_atol, longest_sum, magnitude

NUM_REQUESTS, NEW_TOKENS = 16, 8


def requests() -> list[tuple[str | None, list[int]]]:
    """NUM_REQUESTS (adapter or None, prompt ids): every adapter and the base model, prompts of 1 to 70
    tokens, so that some span several prefill chunks."""
    rng = random.Random(SEED)
    names = [None, *ADAPTERS]
    return [(names[i % len(names)], [rng.randrange(3, TINY["vocab_size"]) for _ in range(rng.randint(1, 70))])
            for i in range(NUM_REQUESTS)]


async def _answer(engine, adapter, ids) -> list[tuple[int, float, tuple]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    return [(t.id, t.logprob, t.top) async for step in engine.generate(ids, params, adapter) for t in step.tokens]


def alone_and_together(model_dir, root, dtype: str, attention: str = "native",
                       kv_cache_dtype: str = "auto") -> tuple[Precision, list, list, int]:
    """Each request's answer alone, then all at once, on one pod of ``dtype`` computing attention the
    ``attention`` way (--cpu-attention) over a KV cache of ``kv_cache_dtype`` (--kv-cache-dtype); and how many
    steps of the second run mixed prefill chunks with other work (proof that the run together really shared
    steps)."""
    # A 24-token step budget: prompts are cut into chunks, differently alone and together.
    config = DataPlaneConfig(model=model_dir, dtype=dtype, adapter_roots=(root,), max_loras=len(ADAPTERS),
                             max_cpu_loras=len(ADAPTERS), max_lora_rank=32, max_num_seqs=NUM_REQUESTS,
                             max_num_batched_tokens=24, num_kv_blocks=128, max_queue_delay=0,
                             cpu_attention=attention, kv_cache_dtype=kv_cache_dtype)

    async def run():
        engine = build_engine(config, PodMetrics())
        assert engine.model.row_rule.attention_native == (attention == "native"), engine.model.row_rule.describe()
        steps = []
        prepare = engine.runner.prepare
        engine.runner.prepare = lambda batch: steps.append([item.num_new for item in batch]) or prepare(batch)
        engine.start()
        try:
            alone = [await _answer(engine, a, ids) for a, ids in requests()]
            before = len(steps)
            together = await asyncio.gather(*(_answer(engine, a, ids) for a, ids in requests()))
            shared = sum(len(s) > 1 and max(s) > 1 for s in steps[before:])
            return engine.model.precision, alone, together, shared
        finally:
            await engine.stop()

    return asyncio.run(run())


@pytest.mark.parametrize(("dtype", "attention"), [
    ("auto", "native"), ("float32", "native"), ("bfloat16-matmul", "native"), ("bfloat16", "native"),
    ("float32", "tiled"), ("bfloat16", "tiled"),
])
def test_every_request_gets_the_same_bits_alone_and_together(tiny_pod_files, dtype, attention):
    model_dir, root, _ = tiny_pod_files
    precision, alone, together, shared = alone_and_together(model_dir, root, dtype, attention)
    if dtype != "auto":
        assert precision is Precision(dtype)
    assert shared > 0, "no step mixed a prefill chunk with other work: the run together shared nothing"
    same = sum(a == t for a, t in zip(alone, together, strict=True))
    assert same == NUM_REQUESTS, f"{same}/{NUM_REQUESTS} requests batch-invariant in {precision.value} (seed {SEED})"
    assert len({tuple(t for t, _, _ in answer) for answer in alone}) > NUM_REQUESTS // 2, "answers barely differ"


@pytest.mark.parametrize(("dtype", "attention"), [("float32", "native"), ("bfloat16", "native"), ("float32", "tiled")])
def test_every_request_gets_the_same_bits_alone_and_together_over_an_fp8_kv_cache(tiny_pod_files, dtype, attention):
    # --kv-cache-dtype fp8: each token's keys and values quantized by their layer's scale as they are written,
    # whatever shares the step; attention reads them back element by element
    model_dir, root, _ = tiny_pod_files
    precision, alone, together, shared = alone_and_together(model_dir, root, dtype, attention, "fp8")
    assert precision is Precision(dtype) and shared > 0
    same = sum(a == t for a, t in zip(alone, together, strict=True))
    assert same == NUM_REQUESTS, f"{same}/{NUM_REQUESTS} requests batch-invariant in {dtype}+kv-fp8 (seed {SEED})"
    assert len({tuple(t for t, _, _ in answer) for answer in alone}) > NUM_REQUESTS // 2, "answers barely differ"


@pytest.mark.parametrize("attention", ["native", "tiled"])
def test_a_cpu_pod_runs_and_reports_the_row_tiles_it_probed_on_its_cpu(tiny_pod_files, attention):
    from data_plane.model.native_attention import NativeAttention
    from data_plane.model.torch_attention import TorchAttention
    from data_plane.servicers.admin import pod_state

    model_dir, root, _ = tiny_pod_files
    config = DataPlaneConfig(model=model_dir, dtype="float32", adapter_roots=(root,), max_loras=len(ADAPTERS),
                             max_cpu_loras=len(ADAPTERS), max_lora_rank=32, num_kv_blocks=16, cpu_attention=attention)

    async def run():
        engine = build_engine(config, PodMetrics())
        rule = engine.model.row_rule
        assert rule is not None and not rule.broken, rule and rule.describe()
        projections = [(m.packed.rows, m.packed.whole) for m in engine.model.modules() if isinstance(m, Projection)]
        assert projections and set(projections) == {(rule.projection.rows, rule.projection.whole)}
        assert {layer.backend.row_tile for layer in engine.lora.layers.values()} == {rule.lora_rows}
        # the native LoRA kernel builds and keeps a row's bits on a CI machine, and every layer runs it
        assert rule.lora_native and "LoRA native, per row" in rule.describe(), rule.describe()
        assert all(layer.backend.native is not None for layer in engine.lora.layers.values())
        if attention == "native":
            assert rule.attention_native and isinstance(engine.model.attention, NativeAttention)
            assert "attention native, in place" in rule.describe()
        else:
            assert isinstance(engine.model.attention, TorchAttention) and not rule.attention_native
            assert engine.model.attention.row_multiple == rule.attention_rows
        assert pod_state(engine, "pod-0", "tiny").row_rule == rule.describe()

    asyncio.run(run())


def test_float32_named_equals_transformers_and_peft_in_float32(tiny_pod_files):
    model_dir, root, hf_model = tiny_pod_files
    precision, alone, _, _ = alone_and_together(model_dir, root, "float32")
    assert precision is Precision.FLOAT32
    _assert_matches_peft(model_dir, root, hf_model, alone)


def test_each_family_is_batch_invariant_and_float32_matches_peft(family_pod_files):
    # Qwen3, Phi-3 (adapters on its packed projections), Gemma 2, Gemma 3 (see conftest.FAMILIES).
    model_dir, root, hf_model = family_pod_files
    # (bfloat16-matmul runs the same projections as for Llama, above; native attention, the default; an FP8 KV
    # cache under each family's windows and soft-capping)
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")):
        precision, alone, together, shared = alone_and_together(model_dir, root, dtype, kv_cache_dtype=kv)
        assert precision is Precision(dtype) and shared > 0
        same = sum(a == t for a, t in zip(alone, together, strict=True))
        assert same == NUM_REQUESTS, f"{same}/{NUM_REQUESTS} requests batch-invariant in {dtype}, KV cache {kv} " \
                                     f"(seed {SEED})"
        if dtype == "float32":
            _assert_matches_peft(model_dir, root, hf_model, alone)


def _assert_matches_peft(model_dir, root, hf_model, alone) -> None:
    """Each request's greedy tokens are peft's, its log-probabilities within float32's rounding of them."""
    from peft import PeftModel

    names = list(ADAPTERS)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf_model), root / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(root / name, adapter_name=name)
    depth = longest_sum(ModelConfig.from_dir(model_dir), rank=32, tokens=70 + NEW_TOKENS)
    for (adapter, ids), answer in zip(requests(), alone, strict=True):
        tokens = [t for t, _, _ in answer]
        with torch.inference_mode():
            if adapter is None:
                with peft_model.disable_adapter():
                    logits = peft_model(torch.tensor([ids + tokens])).logits[0]
            else:
                peft_model.set_adapter(adapter)
                logits = peft_model(torch.tensor([ids + tokens])).logits[0]
        logprobs = logits[len(ids) - 1: -1].log_softmax(-1)
        assert logprobs.argmax(-1).tolist() == tokens, adapter  # greedy: peft picks the same tokens
        ours = torch.tensor([lp for _, lp, _ in answer])
        theirs = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        # a log-probability moves by at most twice the largest logit error
        assert (ours - theirs).abs().max().item() < 2 * logits_atol(depth, magnitude(logits)), adapter

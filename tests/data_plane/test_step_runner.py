"""The graph runner on CPU: every step padded to a captured shape (decode-only steps to a batch-size bucket,
steps with prompt tokens to a token-count bucket) in the static buffers a CUDA graph reads, run eagerly here,
computes what the unpadded eager step computes; the shape a step takes; steps no bucket fits are counted;
a step without adapters builds no LoRA metadata and replays the graph without LoRA."""

from __future__ import annotations

import pytest
import torch

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.model_runner import ModelRunner
from data_plane.engine.scheduler import ScheduledSeq
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.engine.step_runner import (
    EagerRunner,
    GraphRunner,
    GraphShape,
    decode_buckets,
    mixed_seqs,
    token_buckets,
)
from kernels.lora_meta import LoraMetaBuilder
from tests.data_plane.tiny_model import tiny_lora, tiny_model
from tests.tolerances import logits_atol, longest_sum

MAX_SEQS = 8
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def runners():
    model = tiny_model()
    lora = tiny_lora(model)
    blocks = BlockManager(64, 4, MAX_SEQS, 32)
    cache = model.new_kv_cache(64, 4)
    eager = ModelRunner(model, lora, cache, blocks, MAX_SEQS, MAX_TOKENS)
    padded = ModelRunner(model, lora, cache, blocks, MAX_SEQS, MAX_TOKENS, graphs=True)
    assert isinstance(eager.step_runner, EagerRunner) and isinstance(padded.step_runner, GraphRunner)
    return model, blocks, eager, padded


def _prefilled(model, blocks, runner, slots: list[int]) -> list[Sequence]:
    if not slots:
        return []
    seqs = []
    for i, slot in enumerate(slots):
        seq = Sequence(f"s{i}", None, [(7 * i + j) % 97 for j in range(3 + 2 * i)], SamplingParams(), 64, slot=slot)
        blocks.allocate(seq, seq.num_tokens)
        seqs.append(seq)
    out = runner.run([ScheduledSeq(seq, seq.num_tokens) for seq in seqs])
    for seq, tok in zip(seqs, out, strict=True):
        seq.num_computed = seq.num_tokens
        seq.output_ids.append(tok.id)
        blocks.allocate(seq, 1)
    return seqs


def _prompt(blocks, name: str, length: int, slot: int) -> Sequence:
    seq = Sequence(name, None, [(5 * length + j) % 97 for j in range(length)], SamplingParams(), 64, slot=slot)
    blocks.allocate(seq, length)
    return seq


def _logits(model, runner, batch):
    step = runner.prepare(batch)
    with torch.inference_mode():
        hidden = runner.step_runner.forward(step.inputs)
        return model.logits(hidden.index_select(0, step.inputs.sample_rows)), step


def _assert_same_step(model, blocks, eager, padded, batch):
    want, _ = _logits(model, eager, batch)
    got, step = _logits(model, padded, batch)
    scale = float(want.abs().max())
    atol = logits_atol(longest_sum(model.config, rank=4, tokens=MAX_TOKENS), scale)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    assert [t and t.id for t in padded.run(batch)] == [t and t.id for t in eager.run(batch)]
    return step


def test_decode_buckets_cover_every_batch_size():
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(256)[-3:] == [192, 224, 256]
    assert decode_buckets(100)[-2:] == [96, 100]


def test_token_buckets_double_up_to_512_then_grow_by_256_up_to_the_step_bound():
    assert token_buckets(1024) == [2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024]
    assert token_buckets(1000) == [2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1000]
    assert token_buckets(100) == [2, 4, 8, 16, 32, 64, 100]
    assert token_buckets(2048)[-5:] == [1024, 1280, 1536, 1792, 2048]
    assert token_buckets(1) == []  # a step of one token is a decode


def test_a_step_takes_the_smallest_shape_that_holds_it(runners):
    *_, padded = runners
    runner: GraphRunner = padded.step_runner
    assert runner.padding(3, 3) == (4, 4)  # decodes: the next batch-size bucket
    assert runner.padding(8, 8) == (8, 8)
    assert runner.padding(1, 2) == (2, 2)  # a prompt of two tokens: two sequences, one of them padding
    assert runner.padding(3, 7) == (8, 8)  # up to MAX_SEQS tokens, as many sequences as tokens
    assert runner.padding(3, 10) == (MAX_SEQS + 1, 16)  # beyond: one sequence more than a step holds
    assert runner.padding(8, 40) == (MAX_SEQS + 1, 64)
    assert runner.padding(2, MAX_TOKENS) == (MAX_SEQS + 1, MAX_TOKENS)
    assert runner.padding(2, MAX_TOKENS + 1) == (None, None)  # larger than every bucket
    assert mixed_seqs(64, MAX_SEQS) == MAX_SEQS + 1 and mixed_seqs(4, MAX_SEQS) == 4
    assert GraphShape(MAX_SEQS + 1, MAX_TOKENS, False) in runner.shapes
    assert GraphShape(4, 4, True) in runner.shapes and GraphShape(4, 4, False) in runner.shapes


@pytest.mark.parametrize("slots", [[-1, -1, -1], [0, -1, 2, 1, 0]], ids=["base-3-seqs", "adapters-5-seqs"])
def test_a_padded_decode_step_computes_what_the_unpadded_step_computes(runners, slots):
    model, blocks, eager, padded = runners
    seqs = _prefilled(model, blocks, eager, slots)
    batch = [ScheduledSeq(seq, 1) for seq in seqs]
    try:
        step = _assert_same_step(model, blocks, eager, padded, batch)
        size = next(b for b in (1, 2, 4, 8) if b >= len(seqs))
        assert step.inputs.attn.seq_lens.shape[0] == size and step.inputs.input_ids.shape[0] == size
        assert step.inputs.attn.seq_lens.tolist()[len(seqs):] == [0] * (size - len(seqs))
    finally:
        for seq in seqs:
            blocks.free(seq)


@pytest.mark.parametrize(("slots", "prompts"), [([-1, -1], [(5, -1)]), ([0, -1, 2], [(9, 1), (3, -1)]),
                                                ([1] * 7, [(30, 0)]), ([], [(7, 2), (2, -1)])],
                         ids=["base", "adapters", "beyond-max-seqs", "prompts-only"])
def test_a_padded_mixed_step_computes_what_the_unpadded_step_computes(runners, slots, prompts):
    """Decodes beside prompt chunks, padded to a token-count bucket over ``mixed_seqs`` sequences (padding
    sequences have no context: the padding tokens one each, or all in the first of them), in the static
    buffers a graph of that shape was captured on: the same logits and tokens as the step run as it is."""
    model, blocks, eager, padded = runners
    seqs = _prefilled(model, blocks, eager, slots)
    new = [_prompt(blocks, f"p{i}", length, slot) for i, (length, slot) in enumerate(prompts)]
    batch = [*(ScheduledSeq(seq, 1) for seq in seqs), *(ScheduledSeq(seq, seq.num_tokens) for seq in new)]
    num_tokens = len(seqs) + sum(length for length, _ in prompts)
    try:
        step = _assert_same_step(model, blocks, eager, padded, batch)
        tokens = next(b for b in token_buckets(MAX_TOKENS) if b >= num_tokens)
        shape = GraphShape(mixed_seqs(tokens, MAX_SEQS), tokens, False)
        attn = step.inputs.attn
        assert (attn.seq_lens.shape[0], step.inputs.input_ids.shape[0], step.inputs.decode_only) == (
            shape.seqs, shape.tokens, shape.decode_only)
        assert shape in padded.step_runner.shapes
        real = len(batch)
        assert attn.seq_lens.tolist()[real:] == [0] * (shape.seqs - real)  # padding has no context
        assert attn.query_start.tolist()[real::shape.seqs - real] == [num_tokens, tokens]  # padding's tokens
        assert attn.slot_mapping.tolist()[num_tokens:] == [padded.kv_cache.pad_slot] * (tokens - num_tokens)
        # The graph of this shape reads these very buffers: the dummy step it is captured on writes them too.
        dummy = padded.step_runner.dummy_step(shape, -1)
        for name in ("input_ids", "positions"):
            assert getattr(dummy, name).data_ptr() == getattr(step.inputs, name).data_ptr()
        for name in ("slot_mapping", "block_tables", "seq_lens", "query_start"):
            assert getattr(dummy.attn, name).data_ptr() == getattr(attn, name).data_ptr()
    finally:
        for seq in [*seqs, *new]:
            blocks.free(seq)


def test_no_step_is_eager_while_every_step_fits_a_bucket_and_one_that_does_not_is_counted(runners):
    model, blocks, _, padded = runners
    runner: GraphRunner = padded.step_runner
    before = runner.eager_steps
    seqs = _prefilled(model, blocks, padded, [0, -1, 1])
    long = _prompt(blocks, "long", 40, 2)
    try:
        padded.run([*(ScheduledSeq(seq, 1) for seq in seqs), ScheduledSeq(long, 40)])
        assert runner.eager_steps == before
        # A runner whose largest token bucket is 16: a 40-token prompt runs eagerly, counted.
        small = GraphRunner(model, padded.kv_cache, padded.inputs, decode_buckets(MAX_SEQS), token_buckets(16),
                            runner.max_seq_len, capture=False)
        assert small.padding(1, 40) == (None, None)
        step = padded.inputs.build(*_steps(padded, [ScheduledSeq(long, 40)]))
        with torch.inference_mode():
            small.forward(step)
        assert small.eager_steps == 1
    finally:
        for seq in [*seqs, long]:
            blocks.free(seq)


def _steps(runner: ModelRunner, batch):
    """(SeqStep per sequence, token ids) of a batch, as ``ModelRunner.prepare`` lays them out (no padding)."""
    from data_plane.engine.step_inputs import SeqStep

    steps, ids = [], []
    for item in batch:
        seq = item.seq
        start = seq.num_computed + item.num_cached
        steps.append(SeqStep(runner.rows.hold(seq), start, item.num_new, seq.slot, True))
        ids += seq.token_slice(start, start + item.num_new)
    return steps, ids


class _Graph:
    """Stands for a captured CUDA graph: counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_a_step_without_adapters_builds_no_lora_metadata_and_replays_the_graph_without_lora(runners, monkeypatch):
    model, blocks, _, padded = runners
    runner: GraphRunner = padded.step_runner
    built = []
    real_build = LoraMetaBuilder.build
    monkeypatch.setattr(LoraMetaBuilder, "build", lambda self, slots: built.append(slots) or real_build(self, slots))
    base = [_prompt(blocks, "b0", 5, -1), _prompt(blocks, "b1", 3, -1)]
    adapter = _prompt(blocks, "a0", 4, 1)
    shape = GraphShape(*runner.padding(2, 8), False)
    graphs = {lora: (_Graph(), torch.full((8, model.config.hidden_size), float(lora))) for lora in (False, True)}
    try:
        step = padded.prepare([ScheduledSeq(seq, seq.num_tokens) for seq in base])
        assert step.inputs.lora is None and built == []
        monkeypatch.setattr(runner, "_graphs", {(shape, lora): g for lora, g in graphs.items()})
        assert runner.forward(step.inputs) is graphs[False][1]
        assert (graphs[False][0].replays, graphs[True][0].replays) == (1, 0)

        step = padded.prepare([ScheduledSeq(base[0], 5), ScheduledSeq(adapter, 3)])
        assert step.inputs.lora is not None and step.inputs.lora.has_lora and len(built) == 1
        assert runner.forward(step.inputs) is graphs[True][1]
        assert (graphs[False][0].replays, graphs[True][0].replays) == (1, 1)
    finally:
        for seq in [*base, adapter]:
            blocks.free(seq)


def test_a_model_without_lora_builds_no_lora_metadata_and_captures_no_lora_graphs(monkeypatch):
    model = tiny_model()
    blocks = BlockManager(64, 4, MAX_SEQS, 32)
    runner = ModelRunner(model, None, model.new_kv_cache(64, 4), blocks, MAX_SEQS, MAX_TOKENS, graphs=True)
    assert runner.inputs.lora is None and runner.lora is None
    captured = []
    monkeypatch.setattr(GraphRunner, "capture_graphs", lambda self, lora_slot: captured.append(lora_slot))
    runner.capture_graphs()
    assert captured == [None]  # the graphs without LoRA only


def test_under_a_mixed_load_every_step_takes_a_captured_shape_and_no_step_is_eager(tiny_pod_files, monkeypatch):
    """A pod on the graph path (here on CPU, its padded steps run eagerly): requests arriving while others
    decode make steps of decodes beside prompt chunks; each takes a captured shape, and the pod's eager-step
    counter (lorafleet_engine_eager_steps) stays 0."""
    import asyncio

    from data_plane.config import DataPlaneConfig
    from data_plane.engine import engine as engine_module
    from data_plane.engine.sequence import SamplingParams as Params
    from data_plane.metrics import PodMetrics
    from data_plane.pod import build_engine

    graph_runner = engine_module.ModelRunner
    monkeypatch.setattr(engine_module, "ModelRunner", lambda *args, graphs=False, **kwargs: graph_runner(
        *args, graphs=True, **kwargs))
    model_dir, root, _ = tiny_pod_files
    config = DataPlaneConfig(model=model_dir, dtype="float32", adapter_roots=(root,), max_loras=2, max_cpu_loras=2,
                             max_lora_rank=32, num_kv_blocks=96, max_num_seqs=6, max_num_batched_tokens=48,
                             max_queue_delay=0)
    metrics = PodMetrics()
    engine = build_engine(config, metrics)
    runner: GraphRunner = engine.runner.step_runner
    assert isinstance(runner, GraphRunner)
    shapes = []
    forward = runner.forward

    def recorded(inputs):
        shapes.append(GraphShape(inputs.attn.seq_lens.shape[0], inputs.input_ids.shape[0], inputs.decode_only))
        return forward(inputs)

    monkeypatch.setattr(runner, "forward", recorded)
    metrics.watch(engine.snapshot)

    async def one(i: int) -> int:
        await asyncio.sleep(0.05 * i)  # arrive while earlier requests decode
        prompt = [3 + (7 * i + j) % 200 for j in range(5 + 9 * i)]
        params = Params(max_tokens=6, ignore_eos=True)
        tokens = 0
        async for step in engine.generate(prompt, params, [None, "fresh-r4"][i % 2]):
            tokens += len(step.tokens)
        return tokens

    async def run():
        engine.start()
        try:
            return await asyncio.gather(*(one(i) for i in range(6)))
        finally:
            await engine.stop()

    assert asyncio.run(run()) == [6] * 6
    assert shapes and all(shape in runner.shapes for shape in shapes)
    assert any(not shape.decode_only for shape in shapes) and any(shape.decode_only for shape in shapes)
    assert engine.snapshot().eager_steps == 0 == runner.eager_steps
    assert metrics.registry.get_sample_value("lorafleet_engine_eager_steps_total") == 0

"""The padded static-buffer decode runner (what a CUDA graph replays) computes what the unpadded eager
step computes: padding rows change nothing for the real ones, with and without adapters."""

from __future__ import annotations

import pytest
import torch

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.model_runner import ModelRunner
from data_plane.engine.scheduler import ScheduledSeq
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.engine.step_runner import EagerRunner, GraphRunner, decode_buckets
from tests.data_plane.tiny_model import tiny_lora, tiny_model
from tests.tolerances import logits_atol, longest_sum

MAX_SEQS = 8


@pytest.fixture(scope="module")
def runners():
    model = tiny_model()
    lora = tiny_lora(model)
    blocks = BlockManager(64, 4, MAX_SEQS, 32)
    cache = model.new_kv_cache(64, 4)
    eager = ModelRunner(model, lora, cache, blocks, MAX_SEQS, 64)
    padded = ModelRunner(model, lora, cache, blocks, MAX_SEQS, 64, graphs=True)
    assert isinstance(eager.step_runner, EagerRunner) and isinstance(padded.step_runner, GraphRunner)
    return model, blocks, eager, padded


def _prefilled(model, blocks, runner, slots: list[int]) -> list[Sequence]:
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


def _logits(model, runner, batch):
    step = runner.prepare(batch)
    with torch.inference_mode():
        hidden = runner.step_runner.forward(step.inputs)
        return model.logits(hidden.index_select(0, step.inputs.sample_rows)), step


def test_decode_buckets_cover_every_batch_size():
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(256)[-3:] == [192, 224, 256]
    assert decode_buckets(100)[-2:] == [96, 100]


@pytest.mark.parametrize("slots", [[-1, -1, -1], [0, -1, 2, 1, 0]], ids=["base-3-seqs", "adapters-5-seqs"])
def test_a_padded_decode_step_computes_what_the_unpadded_step_computes(runners, slots):
    model, blocks, eager, padded = runners
    seqs = _prefilled(model, blocks, eager, slots)
    batch = [ScheduledSeq(seq, 1) for seq in seqs]
    try:
        want, _ = _logits(model, eager, batch)
        got, step = _logits(model, padded, batch)
        assert step.inputs.attn.seq_lens.shape[0] == next(b for b in (1, 2, 4, 8) if b >= len(seqs))
        assert step.inputs.attn.seq_lens.tolist()[len(seqs):] == [0] * (step.inputs.attn.seq_lens.shape[0] - len(seqs))
        scale = float(want.abs().max())
        atol = logits_atol(longest_sum(model.config, rank=4), scale)
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
        assert [t.id for t in padded.run(batch)] == [t.id for t in eager.run(batch)]
    finally:
        for seq in seqs:
            blocks.free(seq)


def test_a_prefill_step_is_not_padded(runners):
    model, blocks, _, padded = runners
    seq = Sequence("p", None, [1, 2, 3], SamplingParams(), 64)
    blocks.allocate(seq, 3)
    try:
        step = padded.prepare([ScheduledSeq(seq, 3)])
        assert step.inputs.attn.seq_lens.tolist() == [3]
    finally:
        blocks.free(seq)

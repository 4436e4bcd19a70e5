"""A persistent batch: each running sequence's fixed state and last sampled token kept at its block-table row
between steps. Its rows give what rebuilding from every sequence gives, bit for bit: the sampling inputs (and so
the tokens), and every input of a step (ids, positions, attention and LoRA metadata, sampled rows) through
prefills, chunks, decodes, adapters, padding, reordered batches, a row handed to a new sequence, a device copy
of the buffers, and decodes of tokens still on the device (asynchronous scheduling); a row is written once
while its sequence stays, and again for a new owner or a new adapter slot."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.model_runner import ModelRunner
from data_plane.engine.persistent_batch import PersistentBatch
from data_plane.engine.progress import Progress, ScheduledSeq
from data_plane.engine.sampler import SamplingBatch, sample
from data_plane.engine.sequence import PENDING, SamplingParams, Sequence, SequenceStatus
from data_plane.engine.step_inputs import SeqStep, StepInputBuilder, StepInputs
from kernels.lora_meta import LoraMetaBuilder
from tests.data_plane.tiny_model import tiny_lora, tiny_model

MIXED = [
    dict(),  # greedy
    dict(temperature=0.8, top_p=0.9, seed=7),
    dict(temperature=1.3, top_k=5, seed=2**64 - 3, logprobs=3),
    dict(temperature=0.5, top_p=1.0, top_k=0, logit_bias=((3, 2.5), (9, -100.0))),
    dict(logprobs=2, logit_bias=((1, 1.0),)),
    dict(temperature=2.0, top_p=0.3, top_k=40),
]


def _running(blocks: BlockManager, params: list[dict], prompt: int = 5) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(f"r{i}", None, list(range(1, prompt + 1 + i)), SamplingParams(**p), 1000)
        blocks.allocate(seq, seq.num_tokens)
        seqs.append(seq)
    return seqs


def _assert_same(got: SamplingBatch, want: SamplingBatch) -> None:
    for field in dataclasses.fields(SamplingBatch):
        if field.name == "draw_index":  # gather's host copy of draw_rows, for recounted: build makes none
            continue
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), field.name
        else:
            assert a == b, field.name


def test_sampling_inputs_gathered_from_persistent_rows_equal_those_rebuilt_from_each_sequence():
    blocks = BlockManager(64, 4, max_seqs=16, max_blocks_per_seq=8)
    blocks.allocate(Sequence("other", None, [1] * 9, SamplingParams(), 100), 9)  # rows are not the batch order
    seqs = _running(blocks, MIXED * 2)
    rows = PersistentBatch(16)
    for order in (list(range(len(seqs))), list(reversed(range(len(seqs)))), [4, 1, 9], [0]):
        chosen = [seqs[k] for k in order]
        got = rows.sampling([rows.hold(seq) for seq in chosen], [seq.num_tokens for seq in chosen], "cpu")
        _assert_same(got, SamplingBatch.build(chosen, "cpu"))
    for seq in seqs:  # one token further: the same rows again sample with the last batch, only recounted
        seq.output_ids.append(3)
    got = rows.sampling([rows.hold(seq) for seq in seqs], [seq.num_tokens for seq in seqs], "cpu")
    _assert_same(got, SamplingBatch.build(seqs, "cpu"))
    logits = torch.randn(len(seqs), 50, generator=torch.Generator().manual_seed(0))
    gathered = rows.sampling([rows.hold(seq) for seq in seqs], [seq.num_tokens for seq in seqs], "cpu")
    assert sample(logits, gathered).to_host() == sample(logits, SamplingBatch.build(seqs, "cpu")).to_host()


def test_a_row_is_written_once_while_its_sequence_stays_and_again_for_a_new_owner_or_slot():
    blocks = BlockManager(64, 4, max_seqs=4, max_blocks_per_seq=8)
    a, b = _running(blocks, [dict(), dict(temperature=0.7, seed=1)])
    rows = PersistentBatch(4)
    for _ in range(3):  # steps over the same sequences
        rows.hold(a), rows.hold(b)
    assert rows.writes == 2
    row = b.kv_row
    blocks.free(b)
    (c,) = _running(blocks, [dict(temperature=1.5, top_k=3, seed=9, logprobs=1)])
    assert c.kv_row == row  # the freed row goes to the next sequence: its fields are written anew
    got = rows.sampling([rows.hold(c), rows.hold(a)], [c.num_tokens, a.num_tokens], "cpu")
    _assert_same(got, SamplingBatch.build([c, a], "cpu"))
    a.slot = 2  # preempted and admitted again on another adapter slot
    rows.hold(a)
    assert rows.writes == 4


def _rebuilt(builder: StepInputBuilder, batch: list[ScheduledSeq], padding) -> tuple[StepInputs, SamplingBatch]:
    """A step's inputs rebuilt from each sequence, in the runner's (adapter-sorted) order: a SeqStep and
    the token ids read from every sequence, and the sampling batch read from every sampling one."""
    batch = sorted(batch, key=lambda item: item.seq.slot)
    steps, ids, sampling = [], [], []
    for item in batch:
        seq = item.seq
        start = seq.num_computed + item.num_cached
        end = start + item.num_new
        steps.append(SeqStep(seq.kv_row, start, item.num_new, seq.slot, end == seq.num_tokens))
        ids += seq.token_slice(start, end)
        if end == seq.num_tokens:
            sampling.append(seq)
    return builder.build(steps, ids, *padding(len(steps), len(ids))).clone(), SamplingBatch.build(sampling, "cpu")


def _walked(batch: list[ScheduledSeq], block_size: int) -> dict[str, list[int]]:
    """The real (unpadded) part of a step's inputs, walked token by token from each sequence (adapter-sorted)."""
    out = {name: [] for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start", "sample_rows",
                                 "sample_kv_rows")}
    out["query_start"].append(0)
    for item in sorted(batch, key=lambda item: item.seq.slot):
        seq = item.seq
        start = seq.num_computed + item.num_cached
        for p in range(start, start + item.num_new):
            out["input_ids"].append(seq.all_ids[p])
            out["positions"].append(p)
            out["slot_mapping"].append(seq.block_table[p // block_size] * block_size + p % block_size)
        out["seq_lens"].append(start + item.num_new)
        out["query_start"].append(len(out["input_ids"]))
        if start + item.num_new == seq.num_tokens:
            out["sample_rows"].append(len(out["input_ids"]) - 1)
            out["sample_kv_rows"].append(seq.kv_row)
    return out


def _assert_walked(got: StepInputs, walked: dict[str, list[int]]) -> None:
    n, t = got.num_seqs, got.num_tokens
    for name, real in (("input_ids", t), ("positions", t), ("sample_rows", None), ("sample_kv_rows", None)):
        assert getattr(got, name)[:real].tolist() == walked[name], name
    for name, real in (("slot_mapping", t), ("seq_lens", n), ("query_start", n + 1)):
        assert getattr(got.attn, name)[:real].tolist() == walked[name], name
    assert got.attn.max_seq_len == max(walked["seq_lens"])


def _assert_same_inputs(got: StepInputs, want: StepInputs) -> None:
    def same(a, b, name):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name

    for name in ("input_ids", "positions", "sample_rows", "sample_kv_rows"):
        same(getattr(got, name), getattr(want, name), name)
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start"):
        same(getattr(got.attn, name), getattr(want.attn, name), name)
    for name in ("max_query_len", "max_seq_len", "block_size"):
        assert getattr(got.attn, name) == getattr(want.attn, name), name
    assert (got.num_seqs, got.num_tokens) == (want.num_seqs, want.num_tokens)
    assert (got.lora is None) == (want.lora is None)
    if got.lora is not None:
        for name in ("token_slots", "sorted_tokens", "seg_slots", "seg_starts"):
            same(getattr(got.lora, name), getattr(want.lora, name), name)
        assert got.lora.host_segments == want.lora.host_segments


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])
@pytest.mark.parametrize("separate", [False, True], ids=["shared-buffer", "device-copy"])
@pytest.mark.parametrize("pending", [False, True], ids=["synchronous", "asynchronous"])
def test_a_steps_inputs_from_persistent_rows_equal_those_rebuilt_from_each_sequence(graphs, separate, pending):
    """Steps driven as the engine drives them (progress recorded by ``Progress``; with ``pending``, each
    step's tokens recorded PENDING at launch and settled only after the next step is prepared, which then
    decodes them from the device): at every step, the inputs and sampling batch ``prepare`` gives equal, bit
    for bit, those rebuilt from every sequence with the tokens the host holds once settled."""
    model = tiny_model()
    lora = tiny_lora(model)
    blocks = BlockManager(96, 4, 8, 24)
    runner = ModelRunner(model, lora, model.new_kv_cache(96, 4), blocks, 8, 48, graphs=graphs)
    if separate:  # the device's own copy of the buffers and of the block table (as on a GPU), on the CPU
        runner.inputs = StepInputBuilder(blocks, runner.kv_cache, runner.inputs.max_seqs, 48, "cpu", LoraMetaBuilder,
                                         max_loras=3, max_rank=4, separate=True)
        runner.step_runner.builder = runner.inputs
    rebuild = StepInputBuilder(blocks, runner.kv_cache, runner.inputs.max_seqs, 48, "cpu", LoraMetaBuilder,
                               max_loras=3, max_rank=4)
    progress = Progress(blocks)
    slots = [-1, 0, -1, 1, 2, -1, 0]
    seqs = [Sequence(f"r{i}", None, [(11 * i + 3 * j) % 97 for j in range(3 + 4 * i)], SamplingParams(**params),
                     64, slot=slots[i]) for i, params in enumerate((MIXED * 2)[:7])]
    late = seqs.pop()  # takes a finished sequence's row
    in_flight = None  # (batch, the step's tokens) launched, not yet settled (pending)

    def settle():
        nonlocal in_flight
        if in_flight is not None:
            batch, tokens = in_flight
            for item, tok in zip(batch, tokens, strict=True):
                progress.settle(item.seq, None if tok is None else tok.id)
            in_flight = None

    def step(plan: list[tuple[Sequence, int]]) -> None:
        nonlocal in_flight
        batch = []
        for seq, num_new in plan:
            blocks.allocate(seq, num_new)
            batch.append(ScheduledSeq(seq, num_new))
        prepared = runner.prepare(batch)
        assert prepared.fed == (sum(item.seq.pending for item in batch) if pending else 0)
        got = prepared.inputs.clone()
        tokens = runner.execute(prepared).tokens()
        settle()  # the step before's tokens read: the rebuilt step knows the ids the device fed
        want, want_sampling = _rebuilt(rebuild, batch, runner.step_runner.padding)
        _assert_same_inputs(got, want)
        _assert_walked(got, _walked(batch, blocks.block_size))
        if prepared.sampling is not None:
            _assert_same(prepared.sampling, want_sampling)
        if pending:
            progress.record(batch, [tok and PENDING for tok in tokens], ran=False)
            in_flight = (batch, tokens)
        else:
            progress.record(batch, [tok and tok.id for tok in tokens])

    a, b, c, d, e, f = seqs
    step([(a, a.num_tokens), (b, 4), (c, c.num_tokens)])  # prompts, one chunked
    step([(a, 1), (c, 1), (b, b.num_tokens - 4), (d, d.num_tokens)])  # decodes beside prompts
    for _ in range(3):
        step([(x, 1) for x in (a, b, c, d)])  # decodes: the same rows, tokens from the step before
    step([(d, 1), (c, 1), (b, 1), (a, 1), (e, 2)])  # reordered, beside a chunk that samples nothing
    step([(x, 1) for x in (a, b, c, d)] + [(e, e.num_tokens - 2), (f, f.num_tokens)])
    settle()
    c.status = SequenceStatus.FINISHED  # c ends; its row goes to the late sequence
    blocks.free(c)
    step([(x, 1) for x in (a, b, d, e, f)] + [(late, late.num_tokens)])
    assert late.kv_row >= 0
    for _ in range(3):
        step([(x, 1) for x in (f, e, d, b, a, late)])
    settle()

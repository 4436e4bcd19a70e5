"""A persistent batch: each running sequence's fixed state kept at its block-table row between steps.
Its rows give what rebuilding from every sequence gives (sampling inputs, and so the tokens), a row is
written once while its sequence stays, and again for a new owner or a new adapter slot."""

from __future__ import annotations

import dataclasses

import torch

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.persistent_batch import PersistentBatch
from data_plane.engine.sampler import SamplingBatch, sample
from data_plane.engine.sequence import SamplingParams, Sequence

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

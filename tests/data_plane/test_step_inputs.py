"""A step's inputs, built by tensor ops from a few integers per sequence, say what a per-token walk of
each sequence's block table says; padding, the device's copy of the block table and the single
upload behave as documented."""

from __future__ import annotations

import pytest
import torch

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.engine.step_inputs import SeqStep, StepInputBuilder
from data_plane.model.attention import KVCache
from kernels.lora_meta import LoraMetaBuilder

BS = 4


def _setup(separate: bool, max_seqs: int = 4, max_tokens: int = 32, num_blocks: int = 24):
    blocks = BlockManager(num_blocks, BS, max_seqs, 8)
    cache = KVCache(1, num_blocks, BS, 1, 2, torch.float32, "cpu")
    builder = StepInputBuilder(blocks, cache, max_seqs, max_tokens, "cpu", LoraMetaBuilder, max_loras=3, max_rank=4,
                               separate=separate)
    return blocks, cache, builder


def _seq(blocks: BlockManager, prompt: int, computed: int, new: int, slot: int, name: str) -> Sequence:
    seq = Sequence(name, None, list(range(100, 100 + prompt)), SamplingParams(), 64, slot=slot)
    blocks.allocate(seq, computed + new)  # as the scheduler does, chunk by chunk: blocks for all tokens so far
    return seq


def _step(seq: Sequence, computed: int, new: int) -> SeqStep:
    return SeqStep(seq.kv_row, computed, new, seq.slot, computed + new == seq.num_tokens)


def _build(builder: StepInputBuilder, parts: list[tuple[Sequence, int, int]], pad_to: int | None = None):
    ids = [t for seq, computed, new in parts for t in seq.token_slice(computed, computed + new)]
    return builder.build([_step(*part) for part in parts], ids, pad_to)


@pytest.mark.parametrize("separate", [False, True], ids=["shared", "separate-device-copy"])
def test_inputs_follow_each_sequences_block_table(separate):
    blocks, _, builder = _setup(separate)
    blocks.allocate(_seq(blocks, 5, 0, 5, -1, "other"), 5)  # takes the first blocks: tables are not the identity
    a = _seq(blocks, 6, 0, 6, 1, "a")  # whole prompt
    b = _seq(blocks, 9, 8, 1, -1, "b")  # decode at position 8
    c = _seq(blocks, 10, 4, 3, 0, "c")  # a middle chunk: samples nothing
    inputs = _build(builder, [(a, 0, 6), (b, 8, 1), (c, 4, 3)])

    ids, pos, slots, lora = [], [], [], []
    for seq, (computed, new) in zip((a, b, c), ((0, 6), (8, 1), (4, 3)), strict=True):
        for p in range(computed, computed + new):
            ids.append(seq.prompt_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // BS] * BS + p % BS)
            lora.append(seq.slot)
    assert inputs.input_ids.tolist() == ids
    assert inputs.positions.tolist() == pos
    assert inputs.attn.slot_mapping.tolist() == slots
    assert inputs.attn.seq_lens.tolist() == [6, 9, 7]
    assert inputs.attn.query_start.tolist() == [0, 6, 7, 10]
    assert (inputs.attn.max_query_len, inputs.attn.max_seq_len) == (6, 9)
    for row, seq in enumerate((a, b, c)):
        assert inputs.attn.block_tables[row, : len(seq.block_table)].tolist() == seq.block_table
    assert inputs.sample_rows.tolist() == [5, 6]  # a's last token and b's; c's chunk samples nothing
    assert inputs.lora.token_slots.tolist() == lora
    assert inputs.lora.host_segments == ((0, 0, 3, 7), (1, 3, 9, 0))  # (slot, start, end, first token)
    assert inputs.lora.sorted_tokens.tolist()[:9] == [7, 8, 9, 0, 1, 2, 3, 4, 5]


def test_padding_sequences_have_no_context_no_adapter_and_write_to_the_pad_slot():
    blocks, cache, builder = _setup(separate=False)
    a = _seq(blocks, 3, 2, 1, 2, "a")
    inputs = _build(builder, [(a, 2, 1)], pad_to=4)
    assert inputs.attn.seq_lens.tolist() == [3, 0, 0, 0]
    assert inputs.attn.query_start.tolist() == [0, 1, 2, 3, 4]
    assert inputs.attn.slot_mapping.tolist()[1:] == [cache.pad_slot] * 3
    assert inputs.lora.token_slots.tolist() == [2, -1, -1, -1]
    assert inputs.sample_rows.tolist() == [0]
    assert (inputs.num_seqs, inputs.num_tokens, inputs.decode_only) == (1, 1, True)


def test_a_step_without_adapter_tokens_builds_no_lora_metadata(monkeypatch):
    # Base-model sequences on a pod with LoRA: no metadata is built, so the step runs (and, on a GPU,
    # replays) without LoRA; a step with one adapter token builds it.
    blocks, _, builder = _setup(separate=False)
    built = []
    monkeypatch.setattr(builder.lora, "build", lambda slots, build=builder.lora.build: built.append(1) or build(slots))
    a, b = _seq(blocks, 3, 2, 1, -1, "a"), _seq(blocks, 4, 3, 1, -1, "b")
    assert _build(builder, [(a, 2, 1), (b, 3, 1)], pad_to=4).lora is None
    assert not built
    c = _seq(blocks, 5, 4, 1, 1, "c")
    assert _build(builder, [(a, 2, 1), (c, 4, 1)]).lora.host_segments == ((1, 0, 1, 1),)
    assert built == [1]


def test_the_device_table_follows_appends_frees_and_reused_rows():
    blocks, _, builder = _setup(separate=True)
    a, b = _seq(blocks, 9, 0, 9, -1, "a"), _seq(blocks, 2, 0, 2, -1, "b")
    _build(builder, [(a, 0, 9), (b, 0, 2)])
    row_of_a = a.kv_row
    blocks.free(a)
    c = _seq(blocks, 13, 0, 13, 1, "c")  # a's row and blocks, and more
    assert c.kv_row == row_of_a
    b.output_ids += [7, 8, 9]  # three tokens generated since
    blocks.allocate(b, 5)  # b grows into a second block
    assert len(b.block_table) == 2
    inputs = _build(builder, [(c, 0, 13), (b, 2, 3)])
    assert builder.device_table is not blocks.table
    for row, seq in enumerate((c, b)):
        assert inputs.attn.block_tables[row, : len(seq.block_table)].tolist() == seq.block_table
    used = [seq.kv_row for seq in (b, c)]
    assert torch.equal(builder.device_table[used], blocks.table[used])


def test_more_appends_than_their_section_holds_send_the_whole_table():
    blocks, _, builder = _setup(separate=True, max_seqs=1, max_tokens=4)
    seq = _seq(blocks, 24, 20, 4, -1, "long")  # 6 blocks appended at once, the section holds 2 + 1
    assert len(seq.block_table) > builder.max_appends
    inputs = _build(builder, [(seq, 20, 4)])
    assert inputs.attn.block_tables[0, :6].tolist() == seq.block_table


def test_token_ids_that_do_not_match_the_sequences_are_refused():
    blocks, _, builder = _setup(separate=False)
    seq = _seq(blocks, 4, 0, 4, -1, "a")
    with pytest.raises(ValueError, match="4 new tokens but 3 token ids"):
        builder.build([_step(seq, 0, 4)], [1, 2, 3])


def test_a_step_larger_than_the_buffers_is_refused_with_its_size():
    blocks, _, builder = _setup(separate=False, max_seqs=2, max_tokens=4)
    seq = _seq(blocks, 8, 0, 8, -1, "big")
    with pytest.raises(ValueError, match="8 tokens; the buffers hold 4"):
        _build(builder, [(seq, 0, 8)])
    with pytest.raises(ValueError, match="3 sequences"):
        _build(builder, [(seq, 0, 1)], pad_to=3)

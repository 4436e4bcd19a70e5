"""KV-cache blocks: how many a sequence holds, the order they are handed out, and what free gives back."""

from __future__ import annotations

import pytest

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.sequence import SamplingParams, Sequence


def sequence(num_prompt: int, name: str = "r") -> Sequence:
    return Sequence(name, None, [1] * num_prompt, SamplingParams(), num_prompt + 16)


def test_a_sequence_gets_one_block_per_block_size_tokens_rounded_up():
    blocks = BlockManager(num_blocks=8, block_size=4)
    seq = sequence(9)
    assert blocks.blocks_needed(seq, 9) == 3
    blocks.allocate(seq, 9)
    assert seq.block_table == [0, 1, 2]


def test_a_block_is_added_only_when_the_tokens_outgrow_the_last_one():
    blocks = BlockManager(num_blocks=8, block_size=4)
    seq = sequence(5)
    blocks.allocate(seq, 5)
    seq.num_computed = 5  # as the engine records after the step
    assert blocks.blocks_needed(seq, 3) == 0  # 8 tokens still fit in 2 blocks
    blocks.allocate(seq, 3)
    assert seq.block_table == [0, 1]
    seq.num_computed = 8
    assert blocks.blocks_needed(seq, 1) == 1
    blocks.allocate(seq, 1)
    assert seq.block_table == [0, 1, 2]


def test_room_is_what_the_sequence_s_own_blocks_and_the_available_ones_still_hold():
    blocks = BlockManager(num_blocks=8, block_size=4)
    seq = sequence(5)
    assert blocks.room(seq) == 8 * 4
    blocks.allocate(seq, 5)
    seq.num_computed = 5
    assert blocks.room(seq) == 8 * 4 - 5  # 3 more in its second block, 6 blocks available
    assert blocks.can_allocate(seq, blocks.room(seq)) and not blocks.can_allocate(seq, blocks.room(seq) + 1)


def test_free_returns_every_block_and_row_and_leaves_the_progress_to_the_step_s_postprocess():
    blocks = BlockManager(num_blocks=4, block_size=4)
    seq = sequence(10)
    blocks.allocate(seq, 10)
    seq.num_computed = 10
    assert blocks.usage == 0.75
    blocks.free(seq)
    assert (seq.block_table, seq.kv_row, seq.num_computed, blocks.usage) == ([], -1, 10, 0.0)
    assert blocks.can_allocate(sequence(16), 16)


def test_freed_blocks_are_reused_before_untouched_ones():
    blocks = BlockManager(num_blocks=8, block_size=4)
    first, second, third = sequence(8, "first"), sequence(4, "second"), sequence(8, "third")
    blocks.allocate(first, 8)
    blocks.allocate(second, 4)
    blocks.free(first)
    blocks.allocate(third, 8)
    assert (second.block_table, third.block_table) == ([2], [0, 1])


def test_usage_is_the_fraction_of_blocks_held():
    blocks = BlockManager(num_blocks=8, block_size=4)
    assert blocks.usage == 0.0
    blocks.allocate(sequence(4), 4)
    assert blocks.usage == 0.125
    blocks.allocate(sequence(28), 28)
    assert blocks.usage == 1.0


def test_a_sequence_that_needs_more_blocks_than_are_free_cannot_allocate_and_gets_none():
    blocks = BlockManager(num_blocks=4, block_size=4)
    holder = sequence(12, "holder")
    blocks.allocate(holder, 12)
    seq = sequence(5)
    assert blocks.can_allocate(seq, 4) and not blocks.can_allocate(seq, 5)
    with pytest.raises(RuntimeError, match="without can_allocate"):
        blocks.allocate(seq, 5)
    assert seq.block_table == [] and blocks.usage == 0.75

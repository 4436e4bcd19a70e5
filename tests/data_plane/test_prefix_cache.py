"""Prefix caching in the block manager: full blocks are found again by their tokens after the same
prefix, under the same salt (adapter content and precision) only; shared blocks are counted, and
evicted least recently released first once nobody holds them."""

from __future__ import annotations

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.sequence import SamplingParams, Sequence

BS = 4


def _seq(prompt: list[int], name: str = "s") -> Sequence:
    return Sequence(name, None, list(prompt), SamplingParams(), 64)


def _computed(blocks: BlockManager, seq: Sequence, salt: str = "f32/") -> Sequence:
    """``seq`` prefilled: cached blocks matched, the rest allocated and computed, full blocks recorded."""
    hit = blocks.match_prefix(seq, salt)
    blocks.allocate(seq, seq.num_tokens)
    seq.num_computed = seq.num_tokens  # what the step's postprocess does
    blocks.cache_full_blocks(seq)
    return seq, hit


def test_a_later_prompt_reuses_the_full_blocks_of_an_earlier_one():
    blocks = BlockManager(16, BS, prefix_caching=True)
    first, hit = _computed(blocks, _seq(range(10)))
    assert hit == 0 and blocks.prefix.num_cached == 2  # two full blocks; the third holds 2 tokens
    second = _seq([*range(8), 50, 51, 52])
    assert blocks.match_prefix(second, "f32/") == 8
    assert second.block_table == first.block_table[:2]


def test_the_last_token_is_always_computed():
    blocks = BlockManager(16, BS, prefix_caching=True)
    _computed(blocks, _seq(range(8)))
    same = _seq(range(8))
    assert blocks.match_prefix(same, "f32/") == 4  # 8 tokens cached, but the 8th token's logits are needed


def test_blocks_are_never_shared_across_salts_or_after_another_prefix():
    blocks = BlockManager(16, BS, prefix_caching=True)
    _computed(blocks, _seq(range(12)), salt="f32/sha-a")
    assert blocks.match_prefix(_seq(range(12)), "f32/sha-b") == 0  # another adapter content
    assert blocks.match_prefix(_seq(range(12)), "bf16/sha-a") == 0  # another precision
    other_start = _seq([99, 1, 2, 3, *range(4, 12)])
    assert blocks.match_prefix(other_start, "f32/sha-a") == 0  # block 2's tokens alike, its prefix not


def test_a_shared_block_stays_until_every_holder_frees_it_then_is_evicted_lru():
    blocks = BlockManager(6, BS, prefix_caching=True)
    a, _ = _computed(blocks, _seq(range(8), "a"))
    b = _seq([*range(8), 7], "b")
    assert blocks.match_prefix(b, "f32/") == 8
    blocks.free(a)
    assert blocks.num_available == 4  # a's blocks are b's too
    blocks.free(b)
    assert blocks.num_available == 6 and blocks.prefix.num_evictable == 2 and blocks.usage == 0.0
    c, _ = _computed(blocks, _seq(range(100, 120), "c"))  # 5 blocks: the 4 free ones and the LRU cached one
    assert blocks.prefix.stats.evictions == 1
    # A sequence releases its blocks last first, so a prefix loses its tail first and its start stays findable.
    assert blocks.match_prefix(_seq(range(9), "d"), "f32/") == 4
    blocks.free(c)


def test_a_preempted_sequence_finds_its_own_blocks_again():
    blocks = BlockManager(16, BS, prefix_caching=True)
    seq, _ = _computed(blocks, _seq(range(9)))
    seq.output_ids += [40, 41, 42, 43]
    blocks.allocate(seq, 4)
    seq.num_computed += 3
    blocks.cache_full_blocks(seq)
    table = list(seq.block_table)
    blocks.free(seq)  # preempted: recomputed later from prompt + output
    assert blocks.match_prefix(seq, "f32/") == 12
    assert seq.block_table == table[:3]


def test_without_prefix_caching_nothing_is_kept():
    blocks = BlockManager(16, BS)
    seq, _ = _computed(blocks, _seq(range(9)))
    blocks.free(seq)
    assert blocks.match_prefix(_seq(range(9)), "f32/") == 0 and blocks.num_available == 16

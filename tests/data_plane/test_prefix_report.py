"""The routing prefixes a pod reports: a prompt's chain hashes once its blocks are cached, each for as long
as every block holding its tokens stays cached, and never more than the report's capacity."""

from __future__ import annotations

import pytest

from conventions.prefix_chain import CHUNK_BYTES, RoutingPrefix
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.prefix_report import PrefixReport
from data_plane.engine.sequence import SamplingParams, Sequence

BS = 4


def _prefilled(blocks: BlockManager, prompt: list[int], name: str) -> tuple[Sequence, list[int]]:
    """A sequence whose prompt is computed and its full blocks cached, and those blocks' content ids."""
    seq = Sequence(name, None, list(prompt), SamplingParams(), 64)
    blocks.match_prefix(seq, "f32/")
    blocks.allocate(seq, seq.num_tokens - seq.num_computed)
    seq.num_computed = seq.num_tokens
    blocks.cache_full_blocks(seq)
    return seq, [content for content, _ in blocks.prefix.match("f32/", seq.prompt_ids, seq.num_tokens)]


def _chain(*hashes: int) -> RoutingPrefix:
    # one prompt token per 16 input bytes: chunk i covers 16 * (i + 1) tokens, 4 blocks of BS each
    return RoutingPrefix(hashes, len(hashes) * CHUNK_BYTES)


def test_a_prompts_hashes_are_reported_once_its_blocks_are_cached():
    blocks = BlockManager(64, BS, prefix_caching=True)
    report = PrefixReport(blocks.prefix, 16)
    seq, contents = _prefilled(blocks, list(range(48)), "a")
    assert len(contents) == 12
    report.record(_chain(11, 12, 13), 48, contents)
    assert report.held() == [11, 12, 13]


def test_a_hash_leaves_the_report_when_a_block_it_needs_is_evicted():
    blocks = BlockManager(12, BS, prefix_caching=True)
    report = PrefixReport(blocks.prefix, 16)
    seq, contents = _prefilled(blocks, list(range(48)), "a")  # 12 blocks: the whole pool
    report.record(_chain(11, 12, 13), 48, contents)
    blocks.free(seq)  # cached, unreferenced: released last block first, so the tail is evicted first
    assert report.held() == [11, 12, 13]
    other, _ = _prefilled(blocks, list(range(100, 120)), "b")  # 5 blocks evicted: blocks 7..11 of the first
    assert blocks.prefix.stats.evictions == 5
    assert report.held() == [11]  # chunk 1 needs blocks 0..7, chunk 2 blocks 0..11; chunk 0 only 0..3
    assert len(report) == 1  # the evicted ones are forgotten, not only left out
    blocks.free(other)
    _prefilled(blocks, list(range(200, 248)), "c")  # every block taken
    assert report.held() == []


def test_an_evicted_first_block_takes_every_hash_of_its_prompt():
    blocks = BlockManager(8, BS, prefix_caching=True)
    report = PrefixReport(blocks.prefix, 16)
    a, contents = _prefilled(blocks, list(range(32)), "a")
    report.record(_chain(21, 22), 32, contents)
    # b shares nothing; freeing a's blocks in an order that releases its first block first makes it the LRU one
    a.block_table.reverse()
    blocks.free(a)
    _prefilled(blocks, list(range(100, 104)), "b")
    assert not blocks.prefix.holds(contents[0]) and blocks.prefix.holds(contents[-1])
    assert report.held() == []


def test_the_report_keeps_the_most_recently_recorded_hashes_up_to_its_capacity():
    blocks = BlockManager(256, BS, prefix_caching=True)
    report = PrefixReport(blocks.prefix, 5)
    for p in range(4):
        _, contents = _prefilled(blocks, list(range(1000 * p, 1000 * p + 48)), f"p{p}")
        report.record(_chain(10 * p + 1, 10 * p + 2, 10 * p + 3), 48, contents)
    assert len(report) == 5
    assert report.held() == [22, 23, 31, 32, 33]


def test_a_chunk_that_ends_inside_the_first_block_is_not_recorded():
    blocks = BlockManager(16, BS, prefix_caching=True)
    report = PrefixReport(blocks.prefix, 16)
    _, contents = _prefilled(blocks, list(range(10)), "a")
    # 10 tokens over 3 chunks' bytes: chunk 0 covers 3 tokens (no full block), chunk 1 six (one), chunk 2 all
    report.record(RoutingPrefix((1, 2, 3), 3 * CHUNK_BYTES), 10, contents)
    assert report.held() == [2, 3]


def test_a_report_holds_at_least_one_hash():
    with pytest.raises(ValueError, match="at least one"):
        PrefixReport(BlockManager(4, BS, prefix_caching=True).prefix, 0)

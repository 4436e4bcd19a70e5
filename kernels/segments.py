"""The walk from a program id to its block of rows of one segment, shared by the LoRA kernels
(segments = runs of tokens on one adapter slot) and the attention kernel's prefill items (segments = the
queries of one sequence).

Segment ``i`` holds rows ``starts[i]:starts[i + 1]`` and is cut into ``cdiv(len_i, BLOCK)``
blocks. One grid axis enumerates the blocks of every segment in turn, so its size depends only on
the number of rows and of segments (a CUDA graph can replay it for any split of the rows into
segments), and a program that lands past the last block learns so and exits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def segment_walk(
    seg_starts_ptr,  # [num_segments + 1] int32, non-decreasing
    num_segments,
    pid,  # this program's index along the segment-block axis
    SEG_BLOCK: tl.constexpr,  # a power of two >= num_segments
    BLOCK: tl.constexpr,  # rows per block (any positive int)
):
    """(segment, first, end): the program's rows are ``first:end`` (at most ``BLOCK``), all of
    segment ``segment``; ``segment`` is -1 when the program has no rows."""
    offs_s = tl.arange(0, SEG_BLOCK)
    s_mask = offs_s < num_segments
    seg_lo = tl.load(seg_starts_ptr + offs_s, mask=s_mask, other=0)  # [SEG_BLOCK]
    seg_hi = tl.load(seg_starts_ptr + offs_s + 1, mask=s_mask, other=0)  # [SEG_BLOCK]
    seg_blocks = (seg_hi - seg_lo + BLOCK - 1) // BLOCK  # [SEG_BLOCK], 0 past the last segment
    # The segment is the number of segments that end (in blocks) at or before pid; a pid past
    # the last block counts them all.
    segment = tl.sum((tl.cumsum(seg_blocks, axis=0) <= pid).to(tl.int32), axis=0)
    block = pid - tl.sum(tl.where(offs_s < segment, seg_blocks, 0), axis=0)
    # The segment's bounds are picked from the vectors already loaded, not loaded again: one round trip
    # to memory fewer before the program's real loads (a decode launch is bound by that chain). Past
    # the last segment both are 0: no rows.
    picked = offs_s == segment
    first = tl.sum(tl.where(picked, seg_lo, 0), axis=0) + block * BLOCK
    end = tl.minimum(tl.sum(tl.where(picked, seg_hi, 0), axis=0), first + BLOCK)
    return tl.where(segment < num_segments, segment, -1), first, end


def segment_block_count(num_rows: int, num_segments: int, block: int) -> int:
    """Size of the segment-block grid axis: enough for any grouping of ``num_rows`` rows into
    ``num_segments`` segments (each segment adds at most one partial block)."""
    return triton.cdiv(num_rows, block) + min(num_segments, num_rows)

"""What the LoRA shrink and expand launchers share: the walk from a program id to its block of
tokens of one adapter slot, the size of that walk's grid axis, tile sizes, and argument checks.

The walk reads the segments of ``kernels.lora_meta``: segment ``i`` holds the tokens
``sorted_tokens[seg_starts[i]:seg_starts[i + 1]]``, all on adapter slot ``seg_slots[i]``, and is
cut into ``cdiv(len_i, BLOCK_M)`` blocks. One grid axis enumerates the blocks of every segment
in turn, so its size depends only on the token count and the number of segments (a CUDA graph
can replay it for any mix of adapters), and a program that lands past the last block exits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora_meta import LoraMeta

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def segment_block(
    seg_slots_ptr,  # [num_segments] int32
    seg_starts_ptr,  # [num_segments + 1] int32
    num_segments,
    pid,  # this program's index along the segment-block axis
    SEG_BLOCK: tl.constexpr,  # a power of two >= num_segments
    BLOCK_M: tl.constexpr,
):
    """(slot, first, end): the program's tokens are ``sorted_tokens[first:end]`` (at most
    ``BLOCK_M``), all on adapter ``slot``; ``slot`` is -1 when the program has no tokens."""
    offs_s = tl.arange(0, SEG_BLOCK)
    s_mask = offs_s < num_segments
    seg_lo = tl.load(seg_starts_ptr + offs_s, mask=s_mask, other=0)  # [SEG_BLOCK]
    seg_hi = tl.load(seg_starts_ptr + offs_s + 1, mask=s_mask, other=0)  # [SEG_BLOCK]
    seg_blocks = (seg_hi - seg_lo + BLOCK_M - 1) // BLOCK_M  # [SEG_BLOCK], 0 past the last segment
    # The segment is the number of segments that end (in blocks) at or before pid; a pid past
    # the last block counts them all.
    segment = tl.sum((tl.cumsum(seg_blocks, axis=0) <= pid).to(tl.int32), axis=0)
    block = pid - tl.sum(tl.where(offs_s < segment, seg_blocks, 0), axis=0)
    in_range = segment < num_segments
    segment = tl.minimum(segment, num_segments - 1)  # keeps the loads below in bounds
    slot = tl.load(seg_slots_ptr + segment)
    first = tl.load(seg_starts_ptr + segment) + block * BLOCK_M
    end = tl.minimum(tl.load(seg_starts_ptr + segment + 1), first + BLOCK_M)
    slot = tl.where(in_range, slot, -1)
    return slot, first, end


def segment_block_count(num_tokens: int, num_segments: int, block_m: int) -> int:
    """Size of the segment-block grid axis: enough for any grouping of ``num_tokens`` tokens into
    ``num_segments`` segments (each segment adds at most one partial block)."""
    return triton.cdiv(num_tokens, block_m) + min(num_segments, num_tokens)


def check_meta(meta: LoraMeta, num_tokens: int, device: torch.device) -> None:
    """Raises ValueError unless ``meta`` describes ``num_tokens`` tokens in int32 buffers on ``device``."""
    if meta.num_tokens != num_tokens:
        raise ValueError(f"meta was built for {meta.num_tokens} tokens but the inputs have {num_tokens}")
    num_segments = meta.seg_slots.shape[0]
    if meta.seg_starts.shape != (num_segments + 1,):
        raise ValueError(f"meta.seg_starts must be [{num_segments + 1}], got {tuple(meta.seg_starts.shape)}")
    for name in ("sorted_tokens", "seg_slots", "seg_starts"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or t.device != device or not t.is_contiguous():
            raise ValueError(f"meta.{name} must be a contiguous int32 tensor on {device}, got {t.dtype} on {t.device}")


def check_ranks(ranks: torch.Tensor, num_slices: int, num_slots: int, device: torch.device) -> None:
    if ranks.shape != (num_slices, num_slots) or ranks.dtype != torch.int32 or ranks.device != device:
        raise ValueError(
            f"ranks must be int32 [{num_slices}, {num_slots}] on {device}, "
            f"got {ranks.dtype} {tuple(ranks.shape)} on {ranks.device}"
        )
    if not ranks.is_contiguous():
        raise ValueError("ranks must be contiguous")


def check_buf(buf: torch.Tensor, num_slices: int, num_tokens: int, max_rank: int, device: torch.device) -> None:
    """``buf`` may be a view (the layers slice a larger scratch buffer); its rank axis must be dense."""
    if buf.shape != (num_slices, num_tokens, max_rank) or buf.dtype != torch.float32 or buf.device != device:
        raise ValueError(
            f"buf must be float32 [{num_slices}, {num_tokens}, {max_rank}] on {device}, "
            f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
        )
    if max_rank > 1 and buf.stride(2) != 1:
        raise ValueError(f"buf's rank axis must have stride 1, got strides {buf.stride()}")


def check_rows(name: str, t: torch.Tensor) -> None:
    """A [num_tokens, features] operand may skip between rows but must be dense along a row."""
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} must be one of {DTYPES}, got {t.dtype}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have stride 1 along its features, got strides {t.stride()}")


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one launch: each program computes a ``[m, n]`` output tile (shrink: tokens x
    rank columns; expand: tokens x output columns), looping over its reduction in steps of ``k``."""

    m: int
    n: int
    k: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("m", "n", "k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Tiles.{name}={value}: tile sizes must be powers of two and at least 16 (tl.dot)")

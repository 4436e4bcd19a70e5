"""Triton LoRA shrink: project every token onto its own adapter's A, at that adapter's rank.

One launch serves a whole batch of mixed adapters, prefill and decode alike. Program
``(tile, p)`` takes ``BLOCK_R`` rank columns of one output slice (``tile``) for the ``p``-th
block of up to ``BLOCK_M`` tokens of one adapter slot (see ``kernels.lora_launch``). Programs
past the last block, and programs whose rank columns lie past the slot's real rank, return at
once; rows of A past the real rank are never loaded. So a rank-8 adapter costs a rank-8 read of
A even in a layer padded to rank 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import lora_launch, segments
from kernels.lora_launch import Tiles, segment_block
from kernels.lora_meta import LoraMeta


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, in_features], rows stride_xm apart
    lora_a_ptr,  # [S, num_slots, MAX_RANK, in_features] contiguous
    ranks_ptr,  # [S, num_slots] int32
    sorted_tokens_ptr,  # [num_tokens] int32
    seg_slots_ptr,  # [num_segments] int32
    seg_starts_ptr,  # [num_segments + 1] int32
    buf_ptr,  # [S, num_tokens, MAX_RANK] float32, strides (stride_bs, stride_bm, 1)
    stride_xm,
    stride_bs,
    stride_bm,
    in_features,
    num_slots,
    num_segments,
    SEG_BLOCK: tl.constexpr,  # a power of two >= num_segments
    MAX_RANK: tl.constexpr,
    RANK_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in float32 (the interpreter misreads bf16 operands)
):
    slice_id = tl.program_id(0) // RANK_TILES
    r0 = (tl.program_id(0) % RANK_TILES) * BLOCK_R
    slot, first, end = segment_block(seg_slots_ptr, seg_starts_ptr, num_segments, tl.program_id(1), SEG_BLOCK, BLOCK_M)
    if slot < 0:
        return
    # Clamped so that a rank larger than the buffers (a caller bug) cannot read out of bounds.
    rank = tl.minimum(tl.load(ranks_ptr + slice_id * num_slots + slot), MAX_RANK)
    if r0 >= rank:
        return

    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tokens = tl.load(sorted_tokens_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BLOCK_M]
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank  # rows of A past the real rank are never loaded
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_xm  # [BLOCK_M, 1]
    a_base = (slice_id * num_slots + slot).to(tl.int64) * MAX_RANK
    a_rows = lora_a_ptr + (a_base + offs_r[None, :]) * in_features  # [1, BLOCK_R]

    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_features
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_rows + k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        if UPCAST or x_ptr.dtype.element_ty == tl.float32:
            acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)  # tensor cores in the input dtype, float32 accumulator

    out = buf_ptr + slice_id * stride_bs + tokens[:, None] * stride_bm + offs_r[None, :]  # [BLOCK_M, BLOCK_R]
    tl.store(out, acc, mask=m_mask[:, None] & r_mask[None, :])


def default_tiles(num_tokens: int, max_rank: int, dtype: torch.dtype) -> Tiles:
    """Tiles (tokens x rank columns, in_features step) for a GPU; chosen by reasoning, not yet
    tuned on hardware."""
    if num_tokens < 512:
        # Decode: few tokens per adapter, so the work is reading A. Narrow rank tiles skip the
        # padding of low-rank slots and, with long K tiles, spread that read over more programs.
        # float32 operands (no tensor cores: both tiles live in registers) take half the K tile,
        # which at 256 spills on sm_80.
        return Tiles(m=16, n=16, k=128 if dtype == torch.float32 else 256)
    # Prefill: one rank tile per slice (up to rank 64) reads each token block of x once per slice.
    return Tiles(m=64, n=min(64, max(16, triton.next_power_of_2(max_rank))), k=64)


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [S, max_loras, max_rank, in_features]
    ranks: torch.Tensor,  # [S, max_loras] int32
    meta: LoraMeta,
    buf: torch.Tensor,  # [S, num_tokens, max_rank] float32, written
    *,
    tiles: Tiles | None = None,
) -> None:
    """Multi-adapter LoRA shrink, in PyTorch terms::

        for t in range(num_tokens):
            slot = meta.token_slots[t]
            if slot >= 0:
                for s in range(S):
                    r = ranks[s, slot]
                    buf[s, t, :r] = x[t].float() @ lora_a[s, slot, :r].float().T

    Products are accumulated in float32 (for fp16/bf16 inputs, on tensor cores in the input
    dtype). Only ``buf[s, t, :r]`` of LoRA tokens is written; tokens with slot -1 and rank
    columns past ``r`` are neither read nor written. ``x`` and ``lora_a`` share one dtype
    (fp16, bf16 or fp32); ``x`` and ``buf`` may be strided views, dense along their last axis.
    Nothing is allocated and nothing waits on the device, so the call can be captured in a CUDA
    graph; the grid depends only on tensor shapes. ``tiles`` overrides ``default_tiles`` (``n`` is
    the rank tile), e.g. to launch fewer programs under the interpreter.
    """
    # Check.
    if lora_a.dim() != 4 or not lora_a.is_contiguous():
        raise ValueError(f"lora_a must be contiguous [S, max_loras, max_rank, in_features], got {tuple(lora_a.shape)}")
    num_slices, num_slots, max_rank, in_features = lora_a.shape
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [num_tokens, {in_features}] to match lora_a, got {tuple(x.shape)}")
    lora_launch.check_rows("x", x)
    if lora_a.dtype != x.dtype or lora_a.device != x.device:
        raise ValueError(f"x and lora_a must share one dtype and device, got {x.dtype} and {lora_a.dtype}")
    num_tokens = x.shape[0]
    lora_launch.check_ranks(ranks, num_slices, num_slots, x.device)
    lora_launch.check_buf(buf, num_slices, num_tokens, max_rank, x.device)
    lora_launch.check_meta(meta, num_tokens, x.device)
    tiles = tiles or default_tiles(num_tokens, max_rank, x.dtype)
    num_segments = meta.seg_slots.shape[0]
    if num_tokens == 0 or max_rank == 0 or num_segments == 0:
        return

    # Grid: (slice x rank tile, token block of some segment). Slices vary fastest so that
    # programs reading the same token block of x run side by side and share it through L2.
    rank_tiles = triton.cdiv(max_rank, tiles.n)
    grid = (num_slices * rank_tiles, segments.segment_block_count(num_tokens, num_segments, tiles.m))

    # Launch. The interpreter's tl.dot misreads bf16, so off-GPU every dot runs in float32.
    _lora_shrink_kernel[grid](
        x, lora_a, ranks, meta.sorted_tokens, meta.seg_slots, meta.seg_starts, buf,
        x.stride(0), buf.stride(0), buf.stride(1), in_features, num_slots, num_segments,
        SEG_BLOCK=triton.next_power_of_2(num_segments), MAX_RANK=max_rank, RANK_TILES=rank_tiles,
        BLOCK_M=tiles.m, BLOCK_R=tiles.n, BLOCK_K=tiles.k,
        UPCAST=not x.is_cuda,
        num_warps=tiles.num_warps,
    )  # fmt: skip

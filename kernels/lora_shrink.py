"""Triton LoRA shrink: project every token onto its own adapter's A, at that adapter's rank.

One launch serves a whole batch of mixed adapters, prefill and decode alike. Program
``(tile, p)`` takes ``BLOCK_R`` rank columns of one output slice (``tile``) for the ``p``-th
block of up to ``BLOCK_M`` tokens of one adapter slot (see ``kernels.lora_launch``), and, in a
split launch, one chunk of in_features (see ``lora_shrink``). Programs
past the last block, and programs whose rank columns lie past the slot's real rank, return at
once; rows of A past the real rank are never loaded. So a rank-8 adapter costs a rank-8 read of
A even in a layer padded to rank 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import lora_launch, lora_tuning, segments
from kernels.lora_launch import Tiles, dot_features, segment_block
from kernels.lora_meta import SPLIT_TOKENS, LoraMeta


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, in_features], rows stride_xm apart
    lora_a_ptr,  # [S, num_slots, MAX_RANK, in_features] contiguous
    ranks_ptr,  # [S, num_slots] int32
    sorted_tokens_ptr,  # [num_tokens] int32
    seg_slots_ptr,  # [num_segments] int32
    seg_starts_ptr,  # [num_segments + 1] int32
    buf_ptr,  # [S, num_tokens, MAX_RANK] float32, strides (stride_bs, stride_bm, 1)
    part_ptr,  # SPLIT: [S, num_chunks, num_tokens, MAX_RANK] float32 contiguous, one partial sum per chunk
    counters_ptr,  # SPLIT: int32, one per (slice x rank tile, token block), zero between launches
    stride_xm,
    stride_bs,
    stride_bm,
    stride_pc,  # num_tokens * MAX_RANK: from one chunk's partials to the next
    in_features,
    num_slots,
    num_segments,
    num_chunks,  # cdiv(in_features, CHUNK)
    num_blocks,  # size of the grid's token-block axis
    SEG_BLOCK: tl.constexpr,  # a power of two >= num_segments
    MAX_RANK: tl.constexpr,
    RANK_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr,  # a multiple of BLOCK_K: in_features is summed chunk by chunk
    SPLIT: tl.constexpr,  # one program per chunk (else one program walks every chunk)
    UPCAST: tl.constexpr,  # dot in float32 (the interpreter misreads bf16 operands)
):
    tile = tl.program_id(0) // num_chunks if SPLIT else tl.program_id(0)
    slice_id = tile // RANK_TILES
    r0 = (tile % RANK_TILES) * BLOCK_R
    slot, first, end = segment_block(seg_slots_ptr, seg_starts_ptr, num_segments, tl.program_id(1), SEG_BLOCK, BLOCK_M)
    if slot < 0:
        return
    # Clamped so that a rank larger than the buffers (a caller bug) cannot read out of bounds.
    rank = tl.minimum(tl.load(ranks_ptr + slice_id * num_slots + slot), MAX_RANK)
    if r0 >= rank:
        return  # every chunk of this tile returns here alike: its counter is never touched

    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tokens = tl.load(sorted_tokens_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BLOCK_M]
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank  # rows of A past the real rank are never loaded
    x_rows = x_ptr + tokens[:, None] * stride_xm  # [BLOCK_M, 1]
    a_base = (slice_id * num_slots + slot).to(tl.int64) * MAX_RANK
    a_rows = lora_a_ptr + (a_base + offs_r[None, :]) * in_features  # [1, BLOCK_R]
    rows_mask = m_mask[:, None] & r_mask[None, :]

    # A row's sum is the same in both modes: each chunk's partial starts from zero and runs the same
    # K steps, and the partials are added in chunk order; only who adds them differs.
    first_chunk = tl.program_id(0) % num_chunks if SPLIT else 0
    last_chunk = first_chunk + 1 if SPLIT else num_chunks
    total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for c in range(first_chunk, last_chunk):
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc = dot_features(acc, x_rows, a_rows, m_mask, r_mask, c * CHUNK, tl.minimum(c * CHUNK + CHUNK, in_features),
                           in_features, BLOCK_K, UPCAST)
        total += acc

    if SPLIT:
        # Each chunk's program stores its partial; the last of them to arrive adds all in chunk order.
        part_rows = part_ptr + (slice_id * num_chunks).to(tl.int64) * stride_pc + tokens[:, None] * MAX_RANK
        part = part_rows + first_chunk * stride_pc + offs_r[None, :]  # [BLOCK_M, BLOCK_R]
        tl.store(part, total, mask=rows_mask)
        tl.debug_barrier()  # every thread's store before the release below
        counter = counters_ptr + tile * num_blocks + tl.program_id(1)
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived != num_chunks - 1:
            return
        total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for c in range(0, num_chunks):
            p = part_rows + c * stride_pc + offs_r[None, :]
            total += tl.load(p, mask=rows_mask, other=0.0, cache_modifier=".cg")  # from L2, past a stale L1
        tl.atomic_xchg(counter, 0)  # zero for the next launch (a CUDA graph replays this one)

    out = buf_ptr + slice_id * stride_bs + tokens[:, None] * stride_bm + offs_r[None, :]  # [BLOCK_M, BLOCK_R]
    tl.store(out, total, mask=rows_mask)


def default_tiles(dtype: torch.dtype) -> Tiles:
    """Tiles (tokens x rank columns, in_features step and chunk) for a GPU without a tuned table
    (``kernels.lora_tuning``), the same for every step: a decode step's few rows read A with a program
    per chunk, a prefill step's rows in blocks of 16, in the same instructions and order."""
    # float32 operands (no tensor cores: both tiles live in registers) take half the K tile.
    return Tiles(m=16, n=16, k=64 if dtype == torch.float32 else 128, chunk=256)


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
    graph; the grid depends only on tensor shapes. ``tiles`` overrides the tuned or default tiles
    (``kernels.lora_tuning``; ``n`` is the rank tile), e.g. to launch fewer programs under the
    interpreter.

    Each row sums ``in_features`` in ``tiles.chunk``s, each from zero, then adds the chunks' sums in
    order. A step of up to ``SPLIT_TOKENS`` tokens whose metadata holds the split scratch
    (``meta.partials``) runs one program per chunk (split-K: a decode step's few rows read A with
    many programs); the last program of a tile to finish adds the partials, in chunk order, whoever
    finishes first. Otherwise one program walks every chunk. The arithmetic is the same either way,
    so a row's bits do not depend on the mode, hence not on what else shares its step: the tuned and
    default tiles are per shape, the same in every step (``kernels.lora_tuning``).
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
    tiles = (tiles or lora_tuning.on_device("shrink", num_slices, in_features, max_rank, x.dtype, x.device)
             or default_tiles(x.dtype))
    num_segments = meta.seg_slots.shape[0]
    if num_tokens == 0 or max_rank == 0 or num_segments == 0:
        return

    # Grid: (slice x rank tile [x chunk], token block of some segment).
    grid, split = launch_grid(num_tokens, num_slices, in_features, max_rank, num_segments, tiles, meta)
    chunk = tiles.chunk or in_features
    num_chunks = triton.cdiv(in_features, chunk)
    # Without the split, partials and counters are never touched: buf stands in for them.
    partials = meta.partials if split else buf
    counters = meta.counters if split else meta.seg_starts

    # Launch. The interpreter's tl.dot misreads bf16, so off-GPU every dot runs in float32.
    _lora_shrink_kernel[grid](
        x, lora_a, ranks, meta.sorted_tokens, meta.seg_slots, meta.seg_starts, buf, partials, counters,
        x.stride(0), buf.stride(0), buf.stride(1), num_tokens * max_rank, in_features, num_slots, num_segments,
        num_chunks, grid[1],
        SEG_BLOCK=triton.next_power_of_2(num_segments), MAX_RANK=max_rank, RANK_TILES=grid_rank_tiles(max_rank, tiles),
        BLOCK_M=tiles.m, BLOCK_R=tiles.n, BLOCK_K=tiles.k, CHUNK=chunk, SPLIT=split,
        UPCAST=not x.is_cuda,
        **tiles.launch_options(),
    )  # fmt: skip


def grid_rank_tiles(max_rank: int, tiles: Tiles) -> int:
    return triton.cdiv(max_rank, tiles.n)


def launch_grid(num_tokens: int, num_slices: int, in_features: int, max_rank: int, num_segments: int, tiles: Tiles,
                meta: LoraMeta | None) -> tuple[tuple[int, int], bool]:
    """(grid, split): the shrink's grid for these shapes, and whether it runs a program per chunk (a
    step of up to SPLIT_TOKENS tokens whose metadata holds enough split scratch). The grid's first axis
    is slice x rank tile x chunk (chunks fastest, then rank tiles: programs reading the same token
    block of x run side by side and share it through L2); its second, the token blocks."""
    rank_tiles = grid_rank_tiles(max_rank, tiles)
    num_chunks = triton.cdiv(in_features, tiles.chunk or in_features)
    blocks = segments.segment_block_count(num_tokens, num_segments, tiles.m)
    split = (num_chunks > 1 and num_tokens <= SPLIT_TOKENS and meta is not None and meta.partials is not None
             and num_slices * num_chunks * num_tokens * max_rank <= meta.partials.numel()
             and num_slices * rank_tiles * blocks <= meta.counters.numel())
    return (num_slices * rank_tiles * (num_chunks if split else 1), blocks), split

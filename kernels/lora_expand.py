"""Triton LoRA expand: add every token's ``buf @ B.T`` to its output row, at its adapter's rank.

One launch serves a whole batch of mixed adapters, prefill and decode alike, and all output
slices of a packed layer (q/k/v of unequal widths, gate/up). Program ``(tile, p)`` owns
``COL_TILES`` tiles of ``BLOCK_N`` output columns (``tile``), one after another, of the ``p``-th
block of up to ``BLOCK_M`` tokens of one adapter slot (see ``kernels.lora_launch``); its tokens
and slot are read once for all its tiles. For every slice overlapping a tile's columns it loops
over the slot's real rank of that slice in ``BLOCK_K`` steps (slices of rank 0 are skipped),
then reads, adds and writes its ``y`` tile once, masked to the columns some slice touched: rows
of base-model tokens and columns of rank-0 slices are never read or written.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import lora_launch, lora_tuning
from kernels.lora_launch import Tiles, add_to_rows, block_tokens
from kernels.lora_meta import LoraMeta


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [num_tokens, out_features], rows stride_ym apart
    buf_ptr,  # [NUM_SLICES, num_tokens, MAX_RANK] float32, strides (stride_bs, stride_bm, 1)
    lora_b_ptr,  # [num_slots, out_features, MAX_RANK] contiguous
    ranks_ptr,  # [NUM_SLICES, num_slots] int32
    slice_offsets_ptr,  # [NUM_SLICES + 1] int32
    sorted_tokens_ptr,  # [num_tokens] int32
    seg_slots_ptr,  # [num_segments] int32
    seg_starts_ptr,  # [num_segments + 1] int32
    stride_ym,
    stride_bs,
    stride_bm,
    out_features,
    num_slots,
    num_segments,
    SEG_BLOCK: tl.constexpr,  # a power of two >= num_segments
    NUM_SLICES: tl.constexpr,
    MAX_RANK: tl.constexpr,
    RANK_ALIGN: tl.constexpr,  # a power of two <= 8 dividing MAX_RANK
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COL_TILES: tl.constexpr,  # column tiles of BLOCK_N a program walks
    UPCAST: tl.constexpr,  # dot in float32 (the interpreter misreads bf16 operands)
):
    slot, tokens, m_mask = block_tokens(sorted_tokens_ptr, seg_slots_ptr, seg_starts_ptr, num_segments,
                                        tl.program_id(1), SEG_BLOCK, BLOCK_M)
    if slot < 0:
        return

    # A program walks COL_TILES column tiles: its token block and slot are read once for all of them.
    for c in tl.static_range(COL_TILES):
        n0 = (tl.program_id(0) * COL_TILES + c) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        b_rows = lora_b_ptr + (slot.to(tl.int64) * out_features + offs_n[None, :]) * MAX_RANK  # [1, BLOCK_N]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        touched = offs_n < 0  # [BLOCK_N] columns of a slice with rank > 0; none yet
        for s in tl.static_range(NUM_SLICES):
            lo = tl.load(slice_offsets_ptr + s)
            hi = tl.load(slice_offsets_ptr + s + 1)
            # Clamped so that a rank larger than the buffers (a caller bug) cannot read out of bounds.
            rank = tl.minimum(tl.load(ranks_ptr + s * num_slots + slot), MAX_RANK)
            if (rank > 0) & (lo < n0 + BLOCK_N) & (hi > n0):
                n_mask = (offs_n >= lo) & (offs_n < hi) & (offs_n < out_features)
                touched = touched | n_mask
                # buf and B rows are dense along the rank: loading whole RANK_ALIGN groups (still
                # inside the padded row) lets loads vectorise, and tl.where drops the columns past
                # the rank, whatever they hold (NaN included).
                rank_loaded = tl.multiple_of((rank + RANK_ALIGN - 1) // RANK_ALIGN * RANK_ALIGN, RANK_ALIGN)
                buf_rows = buf_ptr + s * stride_bs + tokens[:, None] * stride_bm  # [BLOCK_M, 1]
                for k0 in range(0, rank, BLOCK_K):
                    k = k0 + offs_k
                    k_mask = k < rank
                    k_load = k < rank_loaded
                    h = tl.load(buf_rows + k[None, :], mask=m_mask[:, None] & k_load[None, :], other=0.0)
                    b = tl.load(b_rows + k[:, None], mask=k_load[:, None] & n_mask[None, :], other=0.0)
                    h = tl.where(k_mask[None, :], h, 0.0)  # [BLOCK_M, BLOCK_K]
                    b = tl.where(k_mask[:, None], b, 0.0)  # [BLOCK_K, BLOCK_N]
                    if lora_b_ptr.dtype.element_ty == tl.float32:
                        acc = tl.dot(h, b, acc, input_precision="ieee")
                    else:
                        # fp32 buf as hi + lo in B's dtype: two tensor-core products keep ~16 of its
                        # mantissa bits, where rounding it to bf16 once would keep 8.
                        h_hi = h.to(lora_b_ptr.dtype.element_ty)
                        h_lo = (h - h_hi.to(tl.float32)).to(lora_b_ptr.dtype.element_ty)
                        if UPCAST:
                            b = b.to(tl.float32)
                            acc = tl.dot(h_hi.to(tl.float32), b, acc, input_precision="ieee")
                            acc = tl.dot(h_lo.to(tl.float32), b, acc, input_precision="ieee")
                        else:
                            acc = tl.dot(h_hi, b, acc)
                            acc = tl.dot(h_lo, b, acc)

        y_tile = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        add_to_rows(y_tile, acc, m_mask, touched, tl.sum(touched.to(tl.int32), axis=0) == BLOCK_N)


def default_tiles(max_rank: int) -> Tiles:
    """Tiles (tokens x output columns, rank step) for a GPU without a tuned table, the same for every
    step (``kernels.lora_tuning``): narrow column tiles spread a decode step's read of B over many
    programs; blocks of 16 rows keep one kind of tensor-core instruction whatever the step."""
    return Tiles(m=16, n=64, k=min(64, max(16, triton.next_power_of_2(max_rank))))


def lora_expand(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    buf: torch.Tensor,  # [S, num_tokens, max_rank] float32
    lora_b: torch.Tensor,  # [max_loras, out_features, max_rank]
    ranks: torch.Tensor,  # [S, max_loras] int32
    slice_offsets: torch.Tensor,  # [S + 1] int32, slice s owns rows offsets[s]:offsets[s+1] of B
    meta: LoraMeta,
    *,
    tiles: Tiles | None = None,
) -> None:
    """Multi-adapter LoRA expand, in PyTorch terms::

        for t in range(num_tokens):
            slot = meta.token_slots[t]
            if slot >= 0:
                for s in range(S):
                    r, lo, hi = ranks[s, slot], slice_offsets[s], slice_offsets[s + 1]
                    if r > 0:
                        delta = buf[s, t, :r] @ lora_b[slot, lo:hi, :r].float().T
                        y[t, lo:hi] = (y[t, lo:hi].float() + delta).to(y.dtype)

    Products are accumulated in float32; for fp16/bf16 ``lora_b``, ``buf`` is split into a high
    and a low part in that dtype so the products run on tensor cores without rounding ``buf`` to
    8 (bf16) or 11 (fp16) bits. Rows of tokens with slot -1 and columns of slices with rank 0
    are neither read nor written, and rank columns past ``r`` of ``buf`` and ``lora_b`` do not
    contribute (they may hold anything, NaN included). ``slice_offsets`` must start at 0, be
    non-decreasing and end at ``out_features`` (it lives on the device and is not checked).
    ``y`` and ``lora_b`` may each be fp16, bf16 or fp32; ``y`` and ``buf`` may be strided views,
    dense along their last axis. Nothing is allocated and nothing waits on the device, so the
    call can be captured in a CUDA graph; the grid depends only on tensor shapes. ``tiles``
    overrides the tuned or default tiles (``kernels.lora_tuning``), e.g. to launch fewer programs
    under the interpreter.
    """
    # Check.
    lora_launch.check_lora_b(lora_b, y.device)
    num_slots, out_features, max_rank = lora_b.shape
    if buf.dim() != 3:
        raise ValueError(f"buf must be [S, num_tokens, {max_rank}], got {tuple(buf.shape)}")
    num_slices, num_tokens = buf.shape[0], buf.shape[1]
    if y.shape != (num_tokens, out_features):
        raise ValueError(f"y must be [{num_tokens}, {out_features}] to match buf and lora_b, got {tuple(y.shape)}")
    lora_launch.check_rows("y", y)
    lora_launch.check_buf(buf, num_slices, num_tokens, max_rank, y.device)
    lora_launch.check_ranks(ranks, num_slices, num_slots, y.device)
    lora_launch.check_slice_offsets(slice_offsets, num_slices, y.device)
    lora_launch.check_meta(meta, num_tokens, y.device)
    tiles = (tiles or lora_tuning.on_device("expand", num_slices, out_features, max_rank, lora_b.dtype, y.device)
             or default_tiles(max_rank))
    num_segments = meta.seg_slots.shape[0]
    if num_tokens == 0 or out_features == 0 or max_rank == 0 or num_segments == 0:
        return

    # Grid: (column tile over all slices, token block of some segment).
    grid = lora_launch.column_grid(num_tokens, out_features, num_segments, tiles)

    # Launch. The interpreter's tl.dot misreads bf16, so off-GPU every dot runs in float32.
    _lora_expand_kernel[grid](
        y, buf, lora_b, ranks, slice_offsets, meta.sorted_tokens, meta.seg_slots, meta.seg_starts,
        y.stride(0), buf.stride(0), buf.stride(1), out_features, num_slots, num_segments,
        SEG_BLOCK=triton.next_power_of_2(num_segments),
        NUM_SLICES=num_slices, MAX_RANK=max_rank, RANK_ALIGN=math.gcd(max_rank, 8),
        BLOCK_M=tiles.m, BLOCK_N=tiles.n, BLOCK_K=tiles.k, COL_TILES=tiles.col_tiles,
        UPCAST=not y.is_cuda,
        **tiles.launch_options(),
    )  # fmt: skip

"""Triton LoRA shrink and expand in one launch: a token's rank-r intermediate stays in registers.

Program ``(group, p)`` owns ``COL_TILES`` tiles of ``BLOCK_N`` output columns (a column group of the
packed output, q/k/v or gate/up alike) for the ``p``-th block of up to ``BLOCK_M`` tokens of one adapter
slot (see ``kernels.lora_launch``). For each slice whose columns meet the group and whose rank is not 0,
it computes ``h = x @ A[slice, slot, :rank].T`` over all of in_features, in ``BLOCK_K`` steps from the
first feature to the last, into a float32 ``[BLOCK_M, BLOCK_R]`` tile (``BLOCK_R``, the max rank rounded
up to a power of two, at most ``MAX_FUSED_RANK``), then for each of its column tiles in that slice adds
``h @ B[slot, cols, :rank].T`` to ``y`` in one read-add-write. A column belongs to one slice, so every
element of ``y`` is read, added to and written once, with its whole delta.

What it costs against the split pair (``kernels.lora_shrink`` + ``kernels.lora_expand``): one launch
instead of two, no float32 ``buf`` (and no split-K partials and arrival counters) written and read
back, and no dependent chain from the shrink's last chunk to the expand. In exchange each column group
recomputes ``h`` for the slices it meets: with ``G_s`` groups meeting slice ``s`` (``width_s / (BLOCK_N
* COL_TILES)``, one more where a group straddles a slice edge), a block of ``M`` tokens costs
``sum_s G_s * 2 * M * in_features * r`` shrink FLOPs instead of ``S * 2 * M * in_features * r``, and
reads its ``x`` rows and ``A[s, slot]`` (``r * in_features`` elements) ``G_s`` times instead of once
per rank tile. The rereads come from L2: the bytes from memory stay the adapters' once. Example,
Llama-3-8B's q/k/v (4096 -> 4096 | 1024 | 1024) at rank 16 in groups of 512 columns: G = 8 + 2 + 2 =
12 programs per token block, 4x the split shrink's FLOPs (12 against 3 slice products) and 12 reads of
a 128 KiB ``A`` slice from L2 against 3; the expand's work is the same. In groups of 4,096 columns: 2
programs (q; k and v), h computed once per slice, no rework at all, but a decode step of one row then
has 2 programs each reading 1-2 slices of A alone. gate/up (2 x 14,336) in groups of 4,096: 7 programs,
4x; the o and down projections (4,096 columns): 1 program, 1x. A wider group bounds the rework (the
column tiles of a group are a loop, not unrolled, so a group may be wide); a narrower one gives a few
rows more programs. ``candidates`` spans 512 to 4,096 columns and ``benchmarks/lora_sweep.py`` times
them against the split pair.

Which kernel runs (``fused_tiles``) is a property of the projection's shape alone, never of the step:
the fused kernel where the GPU's tuned table (``kernels.lora_tuning``) holds a ``fused`` entry for the
shape (the sweep writes one only where it measured the fused kernel faster than the split pair over
decode and prefill token counts together) and the max rank is at most ``MAX_FUSED_RANK``; the split
pair everywhere else, a GPU without a table included. So a row runs the same kernel, with the same
tiles, alone or beside any others, in a decode step or a prefill step: its bits do not depend on what
else is in the step. The fused kernel's own sum order is fixed by the shape too: ``in_features`` in
``BLOCK_K`` steps from the first, the rank in one ``BLOCK_R``-wide product, blocks of 16 rows.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import lora_launch, lora_tuning
from kernels.lora_launch import Tiles, add_to_rows, block_tokens, dot_features
from kernels.lora_meta import LoraMeta

# h is a [BLOCK_M, BLOCK_R] float32 tile in registers; past rank 64 it would take more registers than
# a program keeps without spilling, and a launch of that rank is bytes-bound anyway.
MAX_FUSED_RANK = 64


@triton.jit
def _lora_fused_kernel(
    y_ptr,  # [num_tokens, out_features], rows stride_ym apart
    x_ptr,  # [num_tokens, in_features], rows stride_xm apart
    lora_a_ptr,  # [NUM_SLICES, num_slots, MAX_RANK, in_features] contiguous
    lora_b_ptr,  # [num_slots, out_features, MAX_RANK] contiguous
    ranks_ptr,  # [NUM_SLICES, num_slots] int32
    slice_offsets_ptr,  # [NUM_SLICES + 1] int32
    sorted_tokens_ptr,  # [num_tokens] int32
    seg_slots_ptr,  # [num_segments] int32
    seg_starts_ptr,  # [num_segments + 1] int32
    stride_ym,
    stride_xm,
    in_features,
    out_features,
    num_slots,
    num_segments,
    SEG_BLOCK: tl.constexpr,  # a power of two >= num_segments
    NUM_SLICES: tl.constexpr,
    MAX_RANK: tl.constexpr,
    RANK_ALIGN: tl.constexpr,  # a power of two <= 8 dividing MAX_RANK
    BLOCK_R: tl.constexpr,  # a power of two >= MAX_RANK, at least 16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COL_TILES: tl.constexpr,  # column tiles of BLOCK_N in a program's column group
    UPCAST: tl.constexpr,  # dot in float32 (the interpreter misreads bf16 operands)
):
    slot, tokens, m_mask = block_tokens(sorted_tokens_ptr, seg_slots_ptr, seg_starts_ptr, num_segments,
                                        tl.program_id(1), SEG_BLOCK, BLOCK_M)
    if slot < 0:
        return

    x_rows = x_ptr + tokens[:, None] * stride_xm  # [BLOCK_M, 1]
    y_rows = y_ptr + tokens[:, None] * stride_ym  # [BLOCK_M, 1]
    offs_r = tl.arange(0, BLOCK_R)
    g0 = tl.program_id(0) * (COL_TILES * BLOCK_N)
    g1 = g0 + COL_TILES * BLOCK_N
    for s in tl.static_range(NUM_SLICES):
        lo = tl.load(slice_offsets_ptr + s)
        hi = tl.load(slice_offsets_ptr + s + 1)
        # Clamped so that a rank larger than the buffers (a caller bug) cannot read out of bounds.
        rank = tl.minimum(tl.load(ranks_ptr + s * num_slots + slot), MAX_RANK)
        if (rank > 0) & (lo < g1) & (hi > g0):
            # Shrink: rows of A past the rank are never loaded, so h is exactly 0 there.
            r_mask = offs_r < rank
            a_rows = lora_a_ptr + ((s * num_slots + slot).to(tl.int64) * MAX_RANK + offs_r[None, :]) * in_features
            h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            h = dot_features(h, x_rows, a_rows, m_mask, r_mask, 0, in_features, in_features, BLOCK_K, UPCAST)

            # Expand, as kernels.lora_expand: for fp16/bf16 B, h as hi + lo halves in B's dtype (~16 of
            # its mantissa bits, where rounding it once would keep 8 for bf16).
            if lora_b_ptr.dtype.element_ty != tl.float32:
                h_hi = h.to(lora_b_ptr.dtype.element_ty)
                h_lo = (h - h_hi.to(tl.float32)).to(lora_b_ptr.dtype.element_ty)
            # B rows are dense along the rank: loading whole RANK_ALIGN groups (inside the padded row)
            # lets loads vectorise, and tl.where drops the columns past the rank, NaN included.
            rank_loaded = tl.multiple_of((rank + RANK_ALIGN - 1) // RANK_ALIGN * RANK_ALIGN, RANK_ALIGN)
            r_load = offs_r < rank_loaded
            for c in range(0, COL_TILES):  # a loop, not unrolled: a group may span many tiles
                n0 = g0 + c * BLOCK_N
                if (lo < n0 + BLOCK_N) & (hi > n0):
                    offs_n = n0 + tl.arange(0, BLOCK_N)
                    n_mask = (offs_n >= lo) & (offs_n < hi)  # hi <= out_features
                    b_rows = lora_b_ptr + (slot.to(tl.int64) * out_features + offs_n[None, :]) * MAX_RANK
                    b = tl.load(b_rows + offs_r[:, None], mask=r_load[:, None] & n_mask[None, :], other=0.0)
                    b = tl.where(r_mask[:, None], b, 0.0)  # [BLOCK_R, BLOCK_N]
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    if lora_b_ptr.dtype.element_ty == tl.float32:
                        acc = tl.dot(h, b, acc, input_precision="ieee")
                    elif UPCAST:
                        b = b.to(tl.float32)
                        acc = tl.dot(h_hi.to(tl.float32), b, acc, input_precision="ieee")
                        acc = tl.dot(h_lo.to(tl.float32), b, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(h_hi, b, acc)
                        acc = tl.dot(h_lo, b, acc)
                    add_to_rows(y_rows + offs_n[None, :], acc, m_mask, n_mask, (lo <= n0) & (n0 + BLOCK_N <= hi))


def candidates(max_rank: int, dtype: torch.dtype) -> list[Tiles]:
    """The tiles a tuned table may name for the fused kernel (``benchmarks/lora_sweep.py`` times these,
    tests/kernels/test_gpu_compile.py compiles them without spills at rank 64): blocks of 16 rows, column
    groups of 512 to 4,096 (h recomputed at most out_features / 512 times per token block: see the
    module docstring), in_features steps of 64-128 (tiles of 128 x 128 with 8 warps). float32 operands
    (no tensor cores: the dots run on FMAs from registers) take column tiles of 32 (64 with 8 warps)
    and steps of 32: wider, a rank-64 program spilled on sm_80 and sm_90."""
    if max_rank > MAX_FUSED_RANK:
        return []
    if dtype == torch.float32:
        out = [Tiles(m=16, n=32, k=32, col_tiles=c) for c in (16, 32, 64, 128)]
        return out + [Tiles(m=16, n=64, k=32, col_tiles=16, num_warps=8)]
    # 128 x 128 A and B tiles need 8 warps: with 4, a rank-64 program spilled on sm_90.
    out = [Tiles(m=16, n=128, k=64, col_tiles=c) for c in (4, 8, 16, 32)]
    return out + [Tiles(m=16, n=64, k=128, col_tiles=16), Tiles(m=16, n=128, k=128, col_tiles=8, num_warps=8)]


def fused_tiles(lora_a: torch.Tensor, lora_b: torch.Tensor) -> Tiles | None:
    """The rule that picks the kernel of a layer's LoRA: the fused kernel's tiles where the tuned table of
    this GPU holds a ``fused`` entry for the shape (slices, in_features, out_features, max rank, dtype) and
    the max rank is at most ``MAX_FUSED_RANK``, else None: the split shrink and expand. A function of the
    shape and device alone, the same for every step (see the module docstring)."""
    num_slices, _, max_rank, in_features = lora_a.shape
    if max_rank > MAX_FUSED_RANK:
        return None
    return lora_tuning.on_device("fused", num_slices, in_features, max_rank, lora_a.dtype, lora_a.device,
                                 out_features=lora_b.shape[1])


def lora_fused(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [S, max_loras, max_rank, in_features]
    lora_b: torch.Tensor,  # [max_loras, out_features, max_rank]
    ranks: torch.Tensor,  # [S, max_loras] int32
    slice_offsets: torch.Tensor,  # [S + 1] int32, slice s owns rows offsets[s]:offsets[s+1] of B
    meta: LoraMeta,
    tiles: Tiles,
) -> None:
    """Multi-adapter LoRA in one launch, in PyTorch terms::

        for t in range(num_tokens):
            slot = meta.token_slots[t]
            if slot >= 0:
                for s in range(S):
                    r, lo, hi = ranks[s, slot], slice_offsets[s], slice_offsets[s + 1]
                    if r > 0:
                        h = x[t].float() @ lora_a[s, slot, :r].float().T  # [r], never leaves the chip
                        y[t, lo:hi] = (y[t, lo:hi].float() + h @ lora_b[slot, lo:hi, :r].float().T).to(y.dtype)

    ``kernels.lora_shrink`` then ``kernels.lora_expand`` compute the same (``kernels.reference``), in
    another order: products accumulate in float32 (fp16/bf16 ``x`` and ``A`` on tensor cores in their
    dtype; ``h`` carried into the expand as a high and a low half in ``B``'s dtype), ``y`` is rounded
    once. Rows of slot -1, columns of rank-0 slices and rank columns past ``r`` of ``A`` and ``B`` are
    neither read nor written (they may hold anything, NaN included). Shapes, dtypes and views as the two
    launchers take them; the max rank at most ``MAX_FUSED_RANK``. Nothing is allocated and nothing waits
    on the device (a CUDA graph can capture it); the grid depends only on tensor shapes.

    ``tiles``: the tuned table's (``fused_tiles``, the rule that picks this kernel over the split pair:
    per shape, never per step), or a caller's (tests, the sweep). ``n`` x ``col_tiles`` columns a
    program, ``k`` the in_features step.
    """
    # Check.
    if lora_a.dim() != 4 or not lora_a.is_contiguous():
        raise ValueError(f"lora_a must be contiguous [S, max_loras, max_rank, in_features], got {tuple(lora_a.shape)}")
    num_slices, num_slots, max_rank, in_features = lora_a.shape
    lora_launch.check_lora_b(lora_b, x.device)
    if lora_b.shape[0] != num_slots or lora_b.shape[2] != max_rank:
        raise ValueError(f"lora_b must be [{num_slots}, out_features, {max_rank}] to match lora_a, got "
                         f"{tuple(lora_b.shape)}")
    if max_rank > MAX_FUSED_RANK:
        raise ValueError(f"max rank {max_rank}: the fused kernel holds ranks up to {MAX_FUSED_RANK}")
    out_features = lora_b.shape[1]
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [num_tokens, {in_features}] to match lora_a, got {tuple(x.shape)}")
    num_tokens = x.shape[0]
    if y.shape != (num_tokens, out_features):
        raise ValueError(f"y must be [{num_tokens}, {out_features}] to match x and lora_b, got {tuple(y.shape)}")
    lora_launch.check_rows("x", x)
    lora_launch.check_rows("y", y)
    if lora_a.dtype != x.dtype or lora_a.device != x.device:
        raise ValueError(f"x and lora_a must share one dtype and device, got {x.dtype} and {lora_a.dtype}")
    if y.device != x.device:
        raise ValueError(f"x and y must be on one device, got {x.device} and {y.device}")
    lora_launch.check_ranks(ranks, num_slices, num_slots, x.device)
    lora_launch.check_slice_offsets(slice_offsets, num_slices, x.device)
    lora_launch.check_meta(meta, num_tokens, x.device)
    num_segments = meta.seg_slots.shape[0]
    if num_tokens == 0 or out_features == 0 or max_rank == 0 or num_segments == 0:
        return

    # Grid: (column group of the packed output, token block of some segment).
    grid = lora_launch.column_grid(num_tokens, out_features, num_segments, tiles)

    # Launch. The interpreter's tl.dot misreads bf16, so off-GPU every dot runs in float32.
    _lora_fused_kernel[grid](
        y, x, lora_a, lora_b, ranks, slice_offsets, meta.sorted_tokens, meta.seg_slots, meta.seg_starts,
        y.stride(0), x.stride(0), in_features, out_features, num_slots, num_segments,
        SEG_BLOCK=triton.next_power_of_2(num_segments), NUM_SLICES=num_slices, MAX_RANK=max_rank,
        RANK_ALIGN=math.gcd(max_rank, 8), BLOCK_R=rank_block(max_rank),
        BLOCK_M=tiles.m, BLOCK_N=tiles.n, BLOCK_K=tiles.k, COL_TILES=tiles.col_tiles,
        UPCAST=not x.is_cuda,
        **tiles.launch_options(),
    )  # fmt: skip


def rank_block(max_rank: int) -> int:
    """The width of ``h``: the max rank rounded up to a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(max_rank))



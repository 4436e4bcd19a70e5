"""The CPU LoRA path: per adapter segment, one batched matmul pair over fixed row tiles.

Every slot with a rank on the layer gets, once when it changes, its A of every slice stacked and
its B of every slice as one block-diagonal matrix, in float32 and in the orientation the slots hold
them (so a repack copies rows, never transposes them),

    a[slot]: [R_slot, in_features]    b[slot]: [out_features, R_slot], zero off each slice's block

and a step adds ``(x[rows] @ a[slot].T) @ b[slot].T`` to each segment's rows (the model runner sorts
a step's sequences by slot, so a segment is usually one run of rows). The products take the
transposed operands as they are (a BLAS call reads a matrix in either order); on a 2-core EPYC the
8B-shape gate/up pack was 3.6x faster to build this way than transposed into [in, R] and [R, out],
and the products no slower.

Batch invariance. A row's LoRA delta must be the same bits whatever else shares its step. Matmul
libraries choose their kernel by the call's shape and threads (measured with MKL on a 2-core Xeon:
a [rows, 1536] @ [1536, 16] shrink sums a row differently at 2, 3 and 5 rows than at 16, on two
threads), and the four CPU paths this module once chose between per step (dense, gathered,
segmented, the reference's loop) each summed a row in another order: 0 of 25 adapter rows of a mixed
step agreed bitwise between any two. So there is one path, and each segment's rows run in tiles of
exactly ``ROW_TILE`` rows (the last one padded with zero rows) as one batched matmul of tiles, on one
thread: every call for a slot multiplies [ROW_TILE, in] by that slot's own matrices, and a row's
result depends on its input and its adapter alone, not on the other rows, the other adapters, or
how many rows the segment has. LoRA's products are small (rank ≤ 64), so one thread costs little
and spares the threads' hand-over on every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.lora_meta import LoraMeta

ROW_TILE = 16


@dataclass
class SegmentPack:
    """A layer's slots as the segment path reads them; slots without a rank on the layer are absent.
    Kept up to date one changed slot at a time (``update_slot``)."""

    a: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> [R_slot, in_features] float32
    b: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> [out_features, R_slot] float32


def update_slot(pack: SegmentPack, lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
                slice_offsets: list[int], slot: int) -> None:
    """Copies ``slot`` into ``pack`` (or drops it when it has no rank on the layer). ``lora_a``: [S,
    max_loras, max_rank, in]; ``lora_b``: [max_loras, out, max_rank]; ``host_ranks``: [S][max_loras]
    real ranks; ``slice_offsets``: S + 1 row offsets. Only real ranks are copied: slot padding is
    never read."""
    ranks = [host_ranks[s][slot] for s in range(lora_a.shape[0])]
    pack.a.pop(slot, None)
    pack.b.pop(slot, None)
    if not any(ranks):
        return
    a = torch.empty(sum(ranks), lora_a.shape[3], dtype=torch.float32, device=lora_a.device)
    b = torch.zeros(lora_b.shape[1], sum(ranks), dtype=torch.float32, device=lora_b.device)
    c = 0
    for s, r in enumerate(ranks):
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        a[c : c + r] = lora_a[s, slot, :r]
        b[lo:hi, c : c + r] = lora_b[slot, lo:hi, :r]
        c += r
    pack.a[slot], pack.b[slot] = a, b


def pack_segments(lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
                  slice_offsets: list[int]) -> SegmentPack:
    """Every slot of the layer packed (arguments as for ``update_slot``)."""
    pack = SegmentPack()
    for slot in range(lora_a.shape[1]):
        update_slot(pack, lora_a, lora_b, host_ranks, slice_offsets, slot)
    return pack


def lora_segmented(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    pack: SegmentPack,
    meta: LoraMeta,
) -> None:
    """``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` over each slice, with the semantics of
    ``kernels.reference`` (products summed in float32, the delta added to ``y`` in float32 and rounded
    once to its dtype), in ``ROW_TILE``-row tiles. Rows of slot -1 are not touched. Slices the slot
    does not adapt get zeros added (a -0.0 there becomes +0.0), where the reference leaves them; where a
    row's own product overflows, its other slices get NaN (inf times the zero blocks): that row's output
    is lost either way. Call it on one torch thread (the tiles' kernel depends on the threads)."""
    for slot, start, end, run in meta.host_segments:
        a = pack.a.get(slot)
        if a is None:
            continue
        rows = meta.segment_rows(start, end, run)
        xs = x[rows].float()  # [n, in_features]
        n = xs.shape[0]
        if n % ROW_TILE:
            xs = torch.cat([xs, xs.new_zeros(ROW_TILE - n % ROW_TILE, xs.shape[1])])
        tiles = xs.view(-1, ROW_TILE, xs.shape[1])  # [tiles, ROW_TILE, in_features]
        a, b = a.T, pack.b[slot].T  # [in_features, R_slot], [R_slot, out_features]
        shrunk = torch.bmm(tiles, a.expand(tiles.shape[0], *a.shape))  # [tiles, ROW_TILE, R_slot]
        delta = torch.bmm(shrunk, b.expand(tiles.shape[0], *b.shape)).view(-1, b.shape[1])[:n]
        if isinstance(rows, slice) and y.dtype == torch.float32:  # y[rows] is a view: add in place
            y[rows].add_(delta)
        else:
            y[rows] = (y[rows].float() + delta).to(y.dtype)

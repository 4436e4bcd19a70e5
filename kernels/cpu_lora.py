"""The CPU LoRA path in torch: per adapter segment, a batched matmul over fixed row tiles for the shrink and
one per adapted slice for the expand. A pod runs it where the native kernel (``kernels.native_lora``, one
call per layer, reading this module's packed slots) does not build or does not keep a row's bits.

Every slot with a rank on the layer gets, once when it changes, its A of every adapted slice stacked
and each adapted slice's B on its own, in float32 and in the orientation the slots hold them (so a
repack copies rows, never transposes them),

    a: [R_slot, in_features]    b of slice s: [out_s, r_s]    (R_slot: the slices' r_s summed, >= SHRINK_COLUMNS)

and a step adds ``(x[rows] @ a.T)[:, cols_s] @ b_s.T`` to each segment's rows, slice by slice (the
model runner sorts a step's sequences by slot, so a segment is usually one run of rows). The products
take the transposed operands as they are (a BLAS call reads a matrix in either order); on a 2-core
EPYC the 8B-shape gate/up pack was 3.6x faster to build this way than transposed into [in, R] and
[R, out], and the products no slower. Each slice's expand multiplies its own B only: a block-diagonal
B of all slices (one expand per segment) would spend the other slices' share of its products on
zeros (two thirds of a q/k/v expand, half of a gate/up one).

Batch invariance. A row's LoRA delta must be the same bits whatever else shares its step. Matmul
libraries choose their kernel by the call's shape and threads (measured with MKL on a 2-core Xeon:
a [rows, 1536] @ [1536, 16] shrink sums a row differently at 2, 3 and 5 rows than at 16, on two
threads), and the four CPU paths this module once chose between per step (dense, gathered,
segmented, the reference's loop) each summed a row in another order: 0 of 25 adapter rows of a mixed
step agreed bitwise between any two. So there is one path, and each segment's rows run in tiles of
exactly ``row_tile`` rows as one batched matmul of tiles, on one thread: every call for a slot
multiplies [row_tile, in] by that slot's own matrices, and a row's result depends on its input and
its adapter alone, not on the other rows, the other adapters, or how many rows the segment has.
That needs a row's result to depend neither on the other rows of its tile nor on its place in the
tile (a lone decode row starts its tile in a short step and may sit anywhere in it in a long one), both
tested at every place; it is also what lets a run of rows be read in place, with its neighbours in the
step as the rest of its last tile where the step has them (else zero rows pad a copy). A tile read in
place starts on a 64-byte boundary, as a copy does (BLAS may sum an unaligned operand's head apart).
LoRA's products are small (rank ≤ 64), so one thread costs little and spares the threads' hand-over on
every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.lora_meta import LoraMeta

# Rows per tile, the cheapest first. A segment pays its last tile whole, and most segments are an adapter's
# few decode rows: on a 2-core EPYC (demo model, whole steps) 8-row tiles cost decode steps over 4 adapters
# less LoRA time than 16-row tiles, and a long prompt a little more (benchmarks/RESULTS.md, "Attention and
# LoRA per step"). Which of them keeps a row's bits depends on the CPU: on a 2-core Xeon with AMX an
# 8-row tile summed a rank-2 shrink ([8, 64] @ [64, 2]) differently at each place of the tile, 16 rows did
# not. A pod takes the first that holds on its CPU (``data_plane.model.row_rule``).
ROW_TILES = (8, 16, 32)
ROW_TILE = ROW_TILES[0]
# Columns the shrink computes at least. On a 2-core Xeon with AMX a shrink to 1-3 columns in 8-row tiles
# summed a row differently at each place of its tile, and to 1 column in any tile differently in a call of
# several tiles than of one; 4 columns and more kept every row's bits. Zero rows of A cost next to nothing.
SHRINK_COLUMNS = 8
_ALIGN = 64  # bytes: where a tile read in place may start (torch's CPU allocations start on it too)


@dataclass(frozen=True)
class PackedSlice:
    """One slice a slot adapts: its output rows, its columns of the shrunk product, and its B."""

    lo: int  # output rows lo:hi of the layer
    hi: int
    first: int  # columns first:last of the slot's shrunk product (rows of its stacked A)
    last: int
    b: torch.Tensor  # [hi - lo, last - first] float32
    # b.T repeated (as a view) for a segment of that many tiles, the operand of its batched matmul
    _batched: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def batched(self, tiles: int) -> torch.Tensor:
        """[tiles, r, hi - lo]: ``b.T`` for each tile, a view."""
        return _batched(self._batched, self.b, tiles)


@dataclass(frozen=True)
class PackedSlot:
    """A slot as the segment path reads it: the stacked A of the slices it adapts, and those slices."""

    a: torch.Tensor  # [R_slot, in_features] float32 (zero rows past the ranks, up to SHRINK_COLUMNS)
    slices: tuple[PackedSlice, ...]
    _batched: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def batched(self, tiles: int) -> torch.Tensor:
        """[tiles, in_features, R_slot]: ``a.T`` for each tile, a view."""
        return _batched(self._batched, self.a, tiles)


def _batched(views: dict[int, torch.Tensor], weight: torch.Tensor, tiles: int) -> torch.Tensor:
    """``weight.T`` repeated ``tiles`` times along a new first dimension, as a view kept in ``views`` (a
    step's segments mostly have one tile: the view is made once, not per call)."""
    view = views.get(tiles)
    if view is None:
        view = views[tiles] = weight.T.expand(tiles, *weight.T.shape)
    return view


@dataclass
class SegmentPack:
    """A layer's slots as the segment path reads them; slots without a rank on the layer are absent.
    Kept up to date one changed slot at a time (``update_slot``)."""

    slots: dict[int, PackedSlot] = field(default_factory=dict)
    row_tile: int = ROW_TILE  # rows of every tile (one of ROW_TILES)


def update_slot(pack: SegmentPack, lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
                slice_offsets: list[int], slot: int) -> None:
    """Copies ``slot`` into ``pack`` (or drops it when it has no rank on the layer). ``lora_a``: [S,
    max_loras, max_rank, in]; ``lora_b``: [max_loras, out, max_rank]; ``host_ranks``: [S][max_loras]
    real ranks; ``slice_offsets``: S + 1 row offsets. Only real ranks are copied: slot padding is
    never read."""
    ranks = [host_ranks[s][slot] for s in range(lora_a.shape[0])]
    pack.slots.pop(slot, None)
    if not any(ranks):
        return
    pack.slots[slot] = packed_slot([lora_a[s, slot, :r] for s, r in enumerate(ranks)],
                                   [lora_b[slot, slice_offsets[s] : slice_offsets[s + 1], :r]
                                    for s, r in enumerate(ranks)], slice_offsets)


def packed_slot(a: list[torch.Tensor], b: list[torch.Tensor], slice_offsets: list[int]) -> PackedSlot:
    """A slot from each slice's A [r_s, in] and B [out_s, r_s] (r_s = 0: not adapted) and the S + 1 row
    offsets of the slices, copied in float32. Its stacked A has at least ``SHRINK_COLUMNS`` rows (zero
    rows past the ranks): the shrink never computes fewer columns than that."""
    total = sum(t.shape[0] for t in a)
    stacked = torch.zeros(max(total, SHRINK_COLUMNS), a[0].shape[1], dtype=torch.float32, device=a[0].device)
    slices = []
    c = 0
    for s, (a_s, b_s) in enumerate(zip(a, b, strict=True)):
        r = a_s.shape[0]
        if not r:
            continue
        stacked[c : c + r] = a_s
        b_s = b_s.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        slices.append(PackedSlice(slice_offsets[s], slice_offsets[s + 1], c, c + r, b_s))
        c += r
    return PackedSlot(stacked, tuple(slices))


def pack_segments(lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
                  slice_offsets: list[int], row_tile: int = ROW_TILE) -> SegmentPack:
    """Every slot of the layer packed, for tiles of ``row_tile`` rows (other arguments as for ``update_slot``)."""
    pack = SegmentPack(row_tile=row_tile)
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
    once to its dtype), in tiles of ``pack.row_tile`` rows. Rows of slot -1, and the slices a row's slot does
    not adapt, are not touched. Call it on one torch thread (the tiles' kernel depends on the threads)."""
    for slot, start, end, run in meta.host_segments:
        packed = pack.slots.get(slot)
        if packed is None:
            continue
        tiles, offset, rows = _tiles(x, meta, start, end, run, pack.row_tile)
        n = end - start
        for s, delta in zip(packed.slices, tile_products(tiles, packed), strict=True):
            delta = delta.view(-1, s.hi - s.lo)[offset : offset + n]  # [n, out_s]
            if isinstance(rows, slice) and y.dtype == torch.float32:  # y[rows] is a view: add in place
                y[rows, s.lo : s.hi].add_(delta)
            else:
                y[rows, s.lo : s.hi] = (y[rows, s.lo : s.hi].float() + delta).to(y.dtype)


def tile_products(tiles: torch.Tensor, packed: PackedSlot) -> list[torch.Tensor]:
    """``(tiles @ a.T)[..., cols_s] @ b_s.T`` for each slice ``s`` of ``packed``: tiles [tiles, rows, in]
    float32 -> one [tiles, rows, out_s] per slice. The products every tile of a slot runs, in the shapes it
    runs them (what ``data_plane.model.row_rule`` probes)."""
    k = tiles.shape[0]
    shrunk = torch.bmm(tiles, packed.batched(k))  # [tiles, rows, R_slot] (R_slot >= SHRINK_COLUMNS)
    return [torch.bmm(shrunk if s.last - s.first == shrunk.shape[2] else shrunk.narrow(2, s.first, s.last - s.first),
                      s.batched(k)) for s in packed.slices]


def _tiles(x: torch.Tensor, meta: LoraMeta, start: int, end: int, run: int,
           row_tile: int) -> tuple[torch.Tensor, int, slice | torch.Tensor]:
    """A segment's rows of ``x`` as float32 tiles [tiles, row_tile, in_features], where in the tiles its
    first row is, and its rows of the step. A run is read in place where the step has rows enough
    around it to fill its tiles (those rows' results are computed and dropped); scattered rows, or a
    run in a step shorter than its tiles or off a 64-byte boundary, are copied and padded with zero rows."""
    n = end - start
    padded = -(-n // row_tile) * row_tile
    rows = meta.segment_rows(start, end, run)
    window = min(run, x.shape[0] - padded) if isinstance(rows, slice) else -1
    if window >= 0 and (x.stride(1) != 1 or (x.data_ptr() + window * x.stride(0) * x.element_size()) % _ALIGN):
        window = -1  # not a run of whole rows on a 64-byte boundary: copied
    if window >= 0:
        xs, offset = x[window : window + padded], run - window
    else:  # a new tensor, so on the boundary, even with no rows to pad
        xs, offset = torch.cat([x[rows], x.new_zeros(padded - n, x.shape[1])]), 0
    return xs.float().reshape(-1, row_tile, x.shape[1]), offset, rows

"""Where a LoRA layer's adapter product runs: one backend per layer, chosen by device when the
layer is built, called once per forward.

- ``TritonBackend`` (CUDA): the shrink and expand Triton kernels, one launch each per layer, or both in
  one launch (``kernels.lora_fused``) where the GPU's tuned table chose it for the layer's shape.
- ``CpuBackend`` (everywhere else, where Triton's interpreter is slower than torch by orders of
  magnitude): one C++ call per layer where the pod's start-up probe chose it (``kernels.native_lora``),
  else batched matmuls per adapter segment over fixed row tiles (one shrink, one expand per adapted
  slice, ``kernels.cpu_lora``); both on a packed copy of the slots, so that a row's delta does not
  depend on what shares its step.

Both have the semantics documented in ``kernels.reference``, so one layer code runs on either.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import cpu_lora, native_lora
from kernels.lora_meta import LoraMeta


@dataclass(frozen=True)
class LoraSlots:
    """A layer's adapter slots, in the layouts of ``kernels.reference``. The layer owns them and
    writes them in place (then tells its backend ``slot_changed``); backends only read them."""

    lora_a: torch.Tensor  # [S, max_loras, max_rank, in_features]
    lora_b: torch.Tensor  # [max_loras, out_features, max_rank]
    ranks: torch.Tensor  # [S, max_loras] int32, real rank of each slot per slice, 0 = empty
    slice_offsets: torch.Tensor  # [S + 1] int32, slice s owns output rows offsets[s]:offsets[s + 1]
    host_ranks: list[list[int]]  # [S][max_loras], the host copy of ranks
    host_offsets: list[int]  # [S + 1], the host copy of slice_offsets


class LoraBackend(Protocol):
    def apply(self, y: torch.Tensor, x: torch.Tensor, meta: LoraMeta) -> None:
        """``y[t, lo:hi] += (x[t] @ lora_a[s, slot[t], :r].T) @ lora_b[slot[t], lo:hi, :r].T`` with
        ``r = ranks[s, slot[t]]`` and ``lo:hi`` the rows of slice ``s``, for every slice and every
        token whose slot (``meta.token_slots``) is >= 0: accumulated in float32 and rounded once to
        ``y``'s dtype; rows of slot -1 stay as they are. ``y``: [num_tokens, out_features],
        updated in place; ``x``: [num_tokens, in_features]."""

    def slot_changed(self, slot: int) -> None:
        """The layer rewrote ``slot``: the next ``apply`` reads its new weights."""

    def use_row_tile(self, row_tile: int, native: bool = False) -> None:
        """A CPU path's rows go ``row_tile`` at a time from the next ``apply`` on, or by the native kernel
        where ``native`` (the rule a pod probes at start-up, ``data_plane.model.row_rule``); paths that do
        not tile rows ignore it."""


def lora_backend(slots: LoraSlots) -> LoraBackend:
    """The backend for the device the slots live on."""
    return TritonBackend(slots) if slots.lora_a.is_cuda else CpuBackend(slots)


class TritonBackend:
    """The Triton kernels, which read the slots directly: nothing to rebuild when a slot changes.

    The kernel is chosen once, for the layer's shape, when the backend is built
    (``kernels.lora_fused.fused_tiles``): the fused launch where the GPU's tuned table measured it faster,
    else the split shrink and expand. Every step then runs the same kernel, so a row's bits do not depend
    on what shares its step. ``fused`` may be set to other tiles (or None) before the first step."""

    def __init__(self, slots: LoraSlots) -> None:
        # Imported here: Triton is an optional dependency (the `cuda` extra) that CPU installs lack.
        from kernels.lora_fused import fused_tiles

        self.slots = slots
        self.fused = fused_tiles(slots.lora_a, slots.lora_b)

    def apply(self, y: torch.Tensor, x: torch.Tensor, meta: LoraMeta) -> None:
        from kernels.lora_expand import lora_expand
        from kernels.lora_fused import lora_fused
        from kernels.lora_shrink import lora_shrink

        sl = self.slots
        if self.fused is not None:
            lora_fused(y, x, sl.lora_a, sl.lora_b, sl.ranks, sl.slice_offsets, meta, self.fused)
            return
        buf = meta.buffer[: sl.lora_a.shape[0], : x.shape[0]]  # [S, num_tokens, max_rank] float32 scratch
        lora_shrink(x, sl.lora_a, sl.ranks, meta, buf)
        lora_expand(y, buf, sl.lora_b, sl.ranks, sl.slice_offsets, meta)

    def slot_changed(self, slot: int) -> None:
        pass

    def use_row_tile(self, row_tile: int, native: bool = False) -> None:
        pass  # each kernel program reads its own rows: nothing is tiled


class CpuBackend:
    """The CPU path over a copy of the slots packed for it that follows each changed slot before the next
    step reads it: the native kernel (``kernels.native_lora``) on the calling thread's torch threads where
    ``use_row_tile`` says so, else the torch path's tiles (``kernels.cpu_lora``) on one thread."""

    def __init__(self, slots: LoraSlots, row_tile: int = cpu_lora.ROW_TILE) -> None:
        self.slots = slots
        self.row_tile = row_tile  # rows of every tile of the torch path (``cpu_lora.ROW_TILES``)
        self.native: ctypes.CDLL | None = None  # the native kernel, where it runs the layer
        self._pack: cpu_lora.SegmentPack | None = None  # the torch path's copy of the slots; None: not built yet
        self._table: native_lora.SlotTable | None = None  # the native kernel's; None: not built yet
        # slots changed since the pack, and since the table, were last brought up to date
        self._stale_pack: set[int] = set()
        self._stale_table: set[int] = set()

    def slot_changed(self, slot: int) -> None:
        self._stale_pack.add(slot)
        self._stale_table.add(slot)

    def use_row_tile(self, row_tile: int, native: bool = False) -> None:
        """Tiles of ``row_tile`` rows from the next ``apply`` on (the pack is rebuilt for other tiles), or the
        native kernel where ``native``: raises RuntimeError where it does not build here. A copy of the
        slots that one path made is kept while the other runs (a pod picks one at start-up)."""
        lib = native_lora.kernel() if native else None
        if native and lib is None:
            raise RuntimeError(native_lora.unusable(self.slots.lora_a.dtype))
        if row_tile != self.row_tile:
            self._pack = None
        self.row_tile, self.native = row_tile, lib

    def apply(self, y: torch.Tensor, x: torch.Tensor, meta: LoraMeta) -> None:
        if self.native is not None:
            native_lora.lora_native(self.native, y, x, self.table(), meta, torch.get_num_threads())
            return
        with intra_op_threads(1):
            cpu_lora.lora_segmented(y, x, self.pack(), meta)

    def pack(self) -> cpu_lora.SegmentPack:
        """The torch path's packed copy of the slots as they are now."""
        sl = self.slots
        if self._pack is None:
            self._pack = cpu_lora.pack_segments(sl.lora_a, sl.lora_b, sl.host_ranks, sl.host_offsets, self.row_tile)
        else:
            for slot in sorted(self._stale_pack):
                cpu_lora.update_slot(self._pack, sl.lora_a, sl.lora_b, sl.host_ranks, sl.host_offsets, slot)
        self._stale_pack.clear()
        return self._pack

    def table(self) -> native_lora.SlotTable:
        """The native kernel's copy of the slots as they are now."""
        sl = self.slots
        stale: Iterable[int] = sorted(self._stale_table)
        if self._table is None:
            self._table = native_lora.SlotTable.empty(sl.lora_a.shape[1], sl.lora_a.shape[0])
            stale = range(sl.lora_a.shape[1])
        for slot in stale:
            self._table.update(sl.lora_a, sl.lora_b, sl.host_ranks, sl.host_offsets, slot)
        self._stale_table.clear()
        return self._table


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block. With OpenMP this is the calling thread's
    count (and the default a thread that starts parallel work meanwhile takes): call it from the thread
    that runs the model."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

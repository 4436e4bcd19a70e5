"""The CPU LoRA path in C++ (``kernels/native/lora.cpp``): one call per LoRA layer applies every adapter
segment of a step, each row's shrink over all the slices of its slot at once and its expand into each
adapted slice, rows grouped by slot so that a slot's A and B are read once per block of rows.

The torch path (``kernels.cpu_lora``) runs a batched matmul per segment and slice, ~20 µs of overhead a
call, ~120 calls per adapter per step on the demo model; here a layer is one call. Each row's sums run in an
order fixed by the row alone (the source says how), so a row's delta is the same bits whatever shares its
step, at any place of its segment and in a segment of any length, on any CPU: nothing depends on a matmul
library's choice of kernel by shape, which is what ``data_plane.model.row_rule`` probes the tiles for. Used
where the kernel builds (``unusable``) and the start-up probe finds it keeps a row's bits; elsewhere the
pod keeps the torch path's tiles.

A layer's slots are read from a table the kernel takes as it is (``SlotTable``), built from the torch
path's packed slots (``cpu_lora.PackedSlot``) one changed slot at a time:

    a: [R_slot, in] float32 (the slices' A stacked)    bt of slice s: [r_s, out_s] float32 (B transposed)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from kernels import native_build
from kernels.cpu_lora import PackedSlot, SegmentPack, update_slot
from kernels.lora_meta import LoraMeta

LIBRARY = "lora"
TYPES = {torch.float32: 0, torch.bfloat16: 1}
SLOT_FIELDS, SLICE_FIELDS = 3, 5  # as the source's slot table: (a, columns, slices), (lo, width, first, rank, bt)

_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_int64


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it does not build here (``native_build.why_not(LIBRARY)``)."""
    lib = native_build.library(LIBRARY)
    if lib is not None and lib.lora_apply.argtypes is None:
        lib.lora_apply.argtypes = [_P, _I, _I, _L, _P, _I, _L, _P, _P, _P, _I, _P, _I, _I, _I]
        lib.lora_apply.restype = _I
    return lib


def unusable(dtype: torch.dtype) -> str:
    """Why the kernel cannot serve LoRA layers whose activations are ``dtype`` here ("" where it can)."""
    if kernel() is None:
        return f"the native LoRA kernel did not build: {native_build.why_not(LIBRARY)}"
    if dtype not in TYPES:
        return f"the native LoRA kernel takes no {dtype} activations"
    return ""


@dataclass
class SlotTable:
    """A layer's slots as the kernel reads them: ``table`` [max_loras, SLOT_FIELDS + SLICE_FIELDS *
    max_slices] int64 (a slot's pointers, sizes and slices; a zero A pointer: the slot adapts nothing here),
    and the tensors it points into, kept alive by slot."""

    table: torch.Tensor
    tensors: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    @classmethod
    def empty(cls, max_loras: int, max_slices: int) -> SlotTable:
        return cls(torch.zeros(max_loras, SLOT_FIELDS + SLICE_FIELDS * max_slices, dtype=torch.int64))

    def update(self, lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
               slice_offsets: list[int], slot: int) -> None:
        """Copies ``slot`` of a layer's slot buffers in (arguments as for ``cpu_lora.update_slot``); the torch
        path's packed B is dropped once transposed, so the table holds one copy of the slot."""
        pack = SegmentPack()
        update_slot(pack, lora_a, lora_b, host_ranks, slice_offsets, slot)
        self.set_slot(slot, pack.slots.get(slot))

    def set_slot(self, slot: int, packed: PackedSlot | None) -> None:
        """Points ``slot``'s entry at ``packed`` (None: the slot adapts nothing on this layer)."""
        self.table[slot].zero_()
        self.tensors.pop(slot, None)
        if packed is None:
            return
        bts = [s.b.T.contiguous() for s in packed.slices]  # [r_s, out_s]
        entry = [packed.a.data_ptr(), max(s.last for s in packed.slices), len(packed.slices)]
        for s, bt in zip(packed.slices, bts, strict=True):
            entry += [s.lo, s.hi - s.lo, s.first, s.last - s.first, bt.data_ptr()]
        self.table[slot, : len(entry)] = torch.tensor(entry, dtype=torch.int64)
        self.tensors[slot] = (packed.a, *bts)


def lora_native(
    lib: ctypes.CDLL,
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    slots: SlotTable,
    meta: LoraMeta,
    threads: int,
) -> None:
    """``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` over each slice the slot adapts, with the semantics
    of ``kernels.reference`` (products summed in float32, the delta added to ``y`` in float32 and rounded
    once to its dtype), on up to ``threads`` threads (large steps only). Rows of slot -1, and the slices a
    row's slot does not adapt, are not touched."""
    if x.dtype not in TYPES or y.dtype not in TYPES or x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError(f"the native LoRA kernel takes rows of float32 or bfloat16 elements side by side, not "
                         f"x {x.dtype} {tuple(x.stride())}, y {y.dtype} {tuple(y.stride())}")
    table = slots.table
    failed = lib.lora_apply(
        x.data_ptr(), TYPES[x.dtype], x.shape[1], x.stride(0), y.data_ptr(), TYPES[y.dtype], y.stride(0),
        meta.sorted_tokens.data_ptr(), meta.seg_slots.data_ptr(), meta.seg_starts.data_ptr(),
        len(meta.host_segments), table.data_ptr(), table.shape[0], (table.shape[1] - SLOT_FIELDS) // SLICE_FIELDS,
        threads)
    if failed:
        raise ValueError(f"the native LoRA kernel does not take x {x.dtype}, y {y.dtype}")

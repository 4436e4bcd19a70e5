"""A validated adapter in host memory: one staging buffer, viewed as groups that each go into a slot
with one copy.

A group is one output slice of one projection kind (``q`` of ``self_attn.qkv_proj``) at one rank,
over every layer the adapter adapts with it: its A of all those layers as one ``[layers, r, in]``
tensor and its B (scale folded in) as one ``[layers, rows, r]`` tensor. The slot pool
(``slot_pool``) keeps the slots of one projection kind of every layer in one buffer, so writing an
adapter into a slot costs a copy or two per group, not two per layer and slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SliceDelta:
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [slice_out, r], scale folded in


@dataclass(frozen=True)
class SliceGroup:
    kind: str  # the projection below "layers.N.", e.g. "self_attn.qkv_proj"
    slice: str  # the output slice of that projection, e.g. "q"
    module: str  # the PEFT module the weights came from, e.g. "q_proj" or "qkv_proj"
    layers: tuple[int, ...]  # ascending
    a: torch.Tensor  # [len(layers), r, in_features]
    b: torch.Tensor  # [len(layers), slice_out, r], scale folded in

    @property
    def rank(self) -> int:
        return self.a.shape[1]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    sha256: str
    rank: int  # the largest rank over its modules
    groups: tuple[SliceGroup, ...]
    nbytes: int
    buffer: torch.Tensor | None = field(default=None, repr=False)  # [numel] the host memory every group views

    @property
    def deltas(self) -> dict[str, dict[str, SliceDelta]]:
        """Per layer: projection path -> slice name -> delta ("layers.3.self_attn.qkv_proj" -> {"q": ...})."""
        deltas: dict[str, dict[str, SliceDelta]] = {}
        for g in self.groups:
            for j, layer in enumerate(g.layers):
                deltas.setdefault(f"layers.{layer}.{g.kind}", {})[g.slice] = SliceDelta(g.a[j], g.b[j])
        return deltas

    def pin_memory(self) -> LoraAdapter:
        """The same adapter in page-locked host memory (one allocation and one copy), for asynchronous
        copies into device slots. An adapter staged in pinned memory is returned as it is."""
        if self.buffer is None or self.buffer.is_pinned():
            return self
        pinned = torch.empty_like(self.buffer, pin_memory=True)
        pinned.copy_(self.buffer)

        def moved(t: torch.Tensor) -> torch.Tensor:
            return pinned.as_strided(t.shape, t.stride(), t.storage_offset() - self.buffer.storage_offset())

        groups = tuple(SliceGroup(g.kind, g.slice, g.module, g.layers, moved(g.a), moved(g.b)) for g in self.groups)
        return LoraAdapter(self.name, self.sha256, self.rank, groups, self.nbytes, pinned)

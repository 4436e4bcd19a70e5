"""A validated adapter in host memory: the weights file's tensors, as read, grouped for the slots.

A group is one output slice of one projection kind (``q`` of ``self_attn.qkv_proj``) at one rank,
over every layer the adapter adapts with it: the A and B of those layers, views of the buffer the
file was read into (in the file's dtype), and B's scale. Layers whose tensors lie evenly spaced in
the file form a run, one strided view per role (a file sorts its names, so layers 0-1, 10-19, 2,
20-29, ... each form one). The slot pool (``slot_pool``) writes a run into a slot with a call or
two, converting to the serving dtype and folding the scale into B on the way (``write_a``,
``write_b``): the bytes go from the read buffer into the slot in one pass, with no staging copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SliceDelta:
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [slice_out, r], scale folded in


@dataclass(frozen=True)
class LayerRun:
    """Consecutive layers of one slice group whose A (and B) lie evenly spaced in the read buffer,
    with one scale: a strided view each, so a slot write copies the whole run in one call."""

    first: int  # the first layer
    a: torch.Tensor  # [n, r, in_features], a view of the read buffer, the file's dtype
    b: torch.Tensor  # [n, slice_out, r], a view of the read buffer, the file's dtype, scale not applied
    scale: float  # B's scale (alpha / r, or alpha / sqrt(r) with rsLoRA)

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.a.shape[0])


@dataclass(frozen=True)
class SliceGroup:
    kind: str  # the projection below "layers.N.", e.g. "self_attn.qkv_proj"
    slice: str  # the output slice of that projection, e.g. "q"
    module: str  # the PEFT module the weights came from, e.g. "q_proj" or "qkv_proj"
    runs: tuple[LayerRun, ...]  # ascending layers

    @property
    def rank(self) -> int:
        return self.runs[0].a.shape[1]

    def layers(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, float]]:
        """(layer, A [r, in_features], B [slice_out, r], scale) of every layer, ascending."""
        for run in self.runs:
            yield from zip(run.layers, run.a, run.b, [run.scale] * len(run.layers), strict=True)


def write_a(out: torch.Tensor, a: torch.Tensor) -> None:
    """``out`` = ``a`` in ``out``'s dtype (and device; asynchronous from pinned memory)."""
    out.copy_(a, non_blocking=True)


def write_b(out: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """``out = (b.float() * scale).to(out.dtype)``: the product in float32, rounded once to ``out``'s
    dtype, in one pass (``mul`` computes a float32, bfloat16 or float16 tensor times a Python float
    in float32 and rounds once to ``out``; a tensor of another dtype than ``out`` and float32 is made
    float32 first, as the formula says, which also spares the slow converting write into a slot's
    narrow rank columns)."""
    if scale == 1.0:
        out.copy_(b, non_blocking=True)
        return
    b = b.to(out.device, non_blocking=True)
    torch.mul(b if b.dtype in (out.dtype, torch.float32) else b.float(), scale, out=out)


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    sha256: str
    rank: int  # the largest rank over its modules
    groups: tuple[SliceGroup, ...]
    nbytes: int  # host memory it holds
    dtype: torch.dtype = torch.float32  # the serving dtype, which ``deltas`` converts to
    buffer: torch.Tensor | None = field(default=None, repr=False)  # [nbytes] uint8, the memory every group views

    @property
    def deltas(self) -> dict[str, dict[str, SliceDelta]]:
        """Per layer: projection path -> slice name -> delta, in the serving dtype and with the scale
        folded into B, as a slot holds it ("layers.3.self_attn.qkv_proj" -> {"q": ...})."""
        deltas: dict[str, dict[str, SliceDelta]] = {}
        for g in self.groups:
            for layer, a, b, scale in g.layers():
                delta = SliceDelta(torch.empty(a.shape, dtype=self.dtype), torch.empty(b.shape, dtype=self.dtype))
                write_a(delta.a, a)
                write_b(delta.b, b, scale)
                deltas.setdefault(f"layers.{layer}.{g.kind}", {})[g.slice] = delta
        return deltas

    def pin_memory(self) -> LoraAdapter:
        """The same adapter in page-locked host memory (one allocation and one copy), for asynchronous
        copies into device slots. An adapter read into pinned memory is returned as it is."""
        if self.buffer is None or self.buffer.is_pinned():
            return self
        return self.with_buffer(torch.empty_like(self.buffer, pin_memory=True))

    def on(self, device: torch.device) -> LoraAdapter:
        """The adapter with its buffer on ``device`` (itself when it is there): for slots on a GPU, one
        transfer of the whole buffer, after which the slot writes' strided copies, conversions and
        scaling run on the device rather than as one host-side gather and transfer per run."""
        if self.buffer is None or self.buffer.device == device:
            return self
        return self.with_buffer(torch.empty_like(self.buffer, device=device))

    def with_buffer(self, buffer: torch.Tensor) -> LoraAdapter:
        """The same adapter over ``buffer`` ([nbytes] uint8), into which its buffer is copied."""
        buffer.copy_(self.buffer)
        base = self.buffer.data_ptr()

        def moved(t: torch.Tensor) -> torch.Tensor:
            start = t.data_ptr() - base  # bytes; every tensor is a view of the buffer
            extent = 1 + sum((n - 1) * step for n, step in zip(t.shape, t.stride(), strict=True))  # elements
            return buffer[start : start + extent * t.element_size()].view(t.dtype).as_strided(t.shape, t.stride())

        groups = tuple(
            SliceGroup(g.kind, g.slice, g.module,
                       tuple(LayerRun(run.first, moved(run.a), moved(run.b), run.scale) for run in g.runs))
            for g in self.groups
        )
        return LoraAdapter(self.name, self.sha256, self.rank, groups, self.nbytes, self.dtype, buffer)

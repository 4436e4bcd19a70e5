"""LoRA by composition: a wrapper around one base projection that owns its adapter slots."""

from __future__ import annotations

import torch
from torch import nn

from data_plane.lora.lora_adapter import SliceDelta
from data_plane.lora.slot_pool import SlotPool
from data_plane.model.llama import ForwardBatch, LlamaForCausalLM, Projection
from kernels.lora_backend import LoraSlots, lora_backend


class LoRAProjection(nn.Module):
    """``y = base(x) + scale·(x @ A[slot]ᵀ) @ B[slot]ᵀ`` per token, with each token's slot read from
    the step's LoRA metadata (-1 = base only).

    Slot buffers are allocated once, sized ``max_loras × max_rank``: here, or as views of a
    ``SlotPool`` shared by this projection in every layer (``pool``, the layer's index in it);
    activating an adapter copies into a slot and never allocates. The product itself runs in
    ``self.backend`` (``kernels.lora_backend``), chosen by the device the layer lives on.
    """

    def __init__(self, base: Projection, max_loras: int, max_rank: int,
                 pool: tuple[SlotPool, int] | None = None) -> None:
        super().__init__()
        self.base = base
        self.slice_names = tuple(base.slices)
        offsets = [0]
        for width in base.slices.values():
            offsets.append(offsets[-1] + width)
        self.host_offsets = offsets
        w = base.weight
        num_slices = len(self.slice_names)
        self.host_ranks = [[0] * max_loras for _ in range(num_slices)]
        if pool is None:
            pool = SlotPool("", 1, base.slices, base.in_features, max_loras, max_rank, base.dtype, w.device), 0
        self.pool = pool[0]
        lora_a, lora_b, ranks = self.pool.layer_buffers(pool[1], self)
        self.register_buffer("lora_a", lora_a)  # [S, max_loras, max_rank, in_features]
        self.register_buffer("lora_b", lora_b)  # [max_loras, out_features, max_rank]
        self.register_buffer("ranks", ranks)  # [S, max_loras] real rank of each slot per slice, 0 = empty
        self.register_buffer("slice_offsets", torch.tensor(offsets, dtype=torch.int32, device=w.device))
        # The backend reads these buffers in place and is chosen by their device: a layer is built
        # on its device and not moved.
        self.backend = lora_backend(LoraSlots(self.lora_a, self.lora_b, self.ranks, self.slice_offsets,
                                              self.host_ranks, self.host_offsets))

    def set_slot(self, slot: int, deltas: dict[str, SliceDelta]) -> None:
        """Writes an adapter's deltas for this projection into ``slot`` (slices it lacks are zero)."""
        self.clear_slot(slot)
        for s, name in enumerate(self.slice_names):
            delta = deltas.get(name)
            if delta is None:
                continue
            r = delta.a.shape[0]
            lo, hi = self.host_offsets[s], self.host_offsets[s + 1]
            self.lora_a[s, slot, :r].copy_(delta.a, non_blocking=True)
            self.lora_b[slot, lo:hi, :r].copy_(delta.b, non_blocking=True)
            self.ranks[s, slot] = r
            self.host_ranks[s][slot] = r
        self.backend.slot_changed(slot)

    def clear_slot(self, slot: int) -> None:
        """Empties ``slot``: rank 0 for every slice, so its bytes are never read again."""
        self.ranks[:, slot] = 0
        self.slot_written(slot, [0] * len(self.slice_names))

    def slot_written(self, slot: int, ranks: list[int]) -> None:
        """``slot`` now holds ``ranks`` (one per slice), written into the buffers by the caller."""
        for s, r in enumerate(ranks):
            self.host_ranks[s][slot] = r
        self.backend.slot_changed(slot)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        y = self.base(x)
        meta = batch.lora if batch is not None else None
        if meta is not None and meta.has_lora:
            self.backend.apply(y, x, meta)
        return y


def wrap_with_lora(model: LlamaForCausalLM, max_loras: int, max_rank: int) -> dict[str, LoRAProjection]:
    """Replaces every projection of ``model`` by a LoRA wrapper whose slots are views of one
    ``SlotPool`` per projection kind; returns the wrappers by module path (``layers.3.self_attn.qkv_proj``)."""
    projections = [(path, m) for path, m in model.named_modules() if isinstance(m, Projection)]
    by_kind: dict[str, list[tuple[int, str, Projection]]] = {}
    for path, module in projections:
        _, layer, kind = path.split(".", 2)  # "layers", "3", "self_attn.qkv_proj"
        by_kind.setdefault(kind, []).append((int(layer), path, module))
    wrapped: dict[str, LoRAProjection] = {}
    for kind, members in by_kind.items():
        first = members[0][2]
        w = first.weight
        # in the activations' dtype: an FP8 base's adapters compute as on its unquantized base
        pool = SlotPool(kind, len(members), first.slices, first.in_features, max_loras, max_rank, first.dtype,
                        w.device)
        for layer, path, module in members:
            parent_path, _, attr = path.rpartition(".")
            lora = LoRAProjection(module, max_loras, max_rank, (pool, layer))
            setattr(model.get_submodule(parent_path), attr, lora)
            wrapped[path] = lora
    return wrapped


def slot_pools(layers: dict[str, LoRAProjection]) -> dict[str, SlotPool]:
    """The pools that hold ``layers``' slots, by projection kind."""
    return {layer.pool.kind: layer.pool for layer in layers.values()}


def projection_shapes(wrapped: dict[str, LoRAProjection]) -> dict[str, dict[str, tuple[int, int]]]:
    """Projection path -> slice name -> (in_features, out_features), what adapters are checked against."""
    return {path: {name: (w.base.in_features, width) for name, width in w.base.slices.items()}
            for path, w in wrapped.items()}

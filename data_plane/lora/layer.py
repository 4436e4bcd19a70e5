"""LoRA by composition: a wrapper around one base projection that owns its adapter slots."""

from __future__ import annotations

import torch
from torch import nn

from data_plane.lora.peft_adapter import SliceDelta
from data_plane.model.llama import ForwardBatch, LlamaForCausalLM, Projection
from kernels import cpu_lora
from kernels.lora_meta import LoraMeta
from kernels.lora_ops import lora_expand, lora_shrink, runs_triton


class LoRAProjection(nn.Module):
    """``y = base(x) + scale·(x @ A[slot]ᵀ) @ B[slot]ᵀ`` per token, with each token's slot read from
    the step's LoRA metadata (-1 = base only).

    Slot buffers are allocated once here, sized ``max_loras × max_rank``; activating an adapter
    copies into a slot and never allocates. On CPU, steps take the dense or the gathered path of
    ``kernels.cpu_lora`` where its cost estimate says they pay, over a packed copy of the resident
    slots that the first step after a slot change taking that path rebuilds (dense) or patches
    (gathered).
    """

    def __init__(self, base: Projection, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.slice_names = tuple(base.slices)
        offsets = [0]
        for width in base.slices.values():
            offsets.append(offsets[-1] + width)
        self.host_offsets = offsets
        w = base.weight
        num_slices = len(self.slice_names)
        self.register_buffer(  # [S, max_loras, max_rank, in_features]
            "lora_a", torch.zeros(num_slices, max_loras, max_rank, base.in_features, dtype=w.dtype, device=w.device)
        )
        self.register_buffer(  # [max_loras, out_features, max_rank]
            "lora_b", torch.zeros(max_loras, base.out_features, max_rank, dtype=w.dtype, device=w.device)
        )
        self.register_buffer(  # [S, max_loras] real rank of each slot per slice, 0 = empty
            "ranks", torch.zeros(num_slices, max_loras, dtype=torch.int32, device=w.device)
        )
        self.register_buffer("slice_offsets", torch.tensor(offsets, dtype=torch.int32, device=w.device))
        self.host_ranks = [[0] * max_loras for _ in range(num_slices)]
        self._plan: cpu_lora.CpuPlan | None = None  # None: slots changed since the last plan or pack
        self._dense: cpu_lora.DensePack | None = None
        self._gathered: cpu_lora.GatherPack | None = None
        self._stale_slots: set[int] = set()  # slots changed since the gathered pack was last brought up to date

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
        self._slot_changed(slot)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[:, slot].zero_()
        self.lora_b[slot].zero_()
        self.ranks[:, slot] = 0
        for ranks in self.host_ranks:
            ranks[slot] = 0
        self._slot_changed(slot)

    def _slot_changed(self, slot: int) -> None:
        """The plan and the dense pack are rebuilt when next needed; the gathered pack is patched."""
        self._plan = self._dense = None
        self._stale_slots.add(slot)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        y = self.base(x)
        meta = batch.lora if batch is not None else None
        if meta is None or not meta.has_lora:
            return y
        if not runs_triton(y):
            path = self._cpu_path(meta)
            if path is None:  # no resident adapter adapts this projection
                return y
            if path == cpu_lora.DENSE:
                if self._dense is None:
                    self._dense = cpu_lora.pack(self.lora_a, self.lora_b, self.host_ranks, self.host_offsets)
                cpu_lora.lora_dense(y, x, self._dense, meta.token_slots, meta.step_values)
                return y
            if path == cpu_lora.GATHERED:
                cpu_lora.lora_gathered(y, x, self._gathered_pack(), meta.token_slots, meta.step_values)
                return y
        buf = meta.buffer[: len(self.slice_names), : x.shape[0]]  # [S, num_tokens, max_rank] float32 scratch
        lora_shrink(x, self.lora_a, self.ranks, meta, buf, self.host_ranks)
        lora_expand(y, buf, self.lora_b, self.ranks, self.slice_offsets, self.host_offsets, meta, self.host_ranks)
        return y

    def _gathered_pack(self) -> cpu_lora.GatherPack:
        args = (self.lora_a, self.lora_b, self.host_ranks, self.host_offsets)
        packed = self._gathered
        if packed is not None and not all(cpu_lora.update_gathered(packed, *args, slot)
                                          for slot in sorted(self._stale_slots)):
            packed = None  # a slot outgrew the pack's rank
        if packed is None:
            packed = self._gathered = cpu_lora.pack_gathered(*args)
        self._stale_slots.clear()
        return packed

    def _cpu_path(self, meta: LoraMeta) -> str | None:
        """The CPU path for this step (``kernels.cpu_lora.choose_path``), None when no resident
        adapter has a rank on this projection."""
        cpu_plan = self._plan
        if cpu_plan is None:
            cpu_plan = self._plan = cpu_lora.plan(self.host_ranks, self.base.in_features, self.base.out_features)
        if cpu_plan.rank == 0:
            return None
        # Layers with equal plans (same shape, same resident ranks) choose alike: once per step.
        key = ("path", cpu_plan)
        path = meta.step_values.get(key)
        if path is None:
            path = meta.step_values[key] = cpu_lora.choose_path(cpu_plan, meta.num_tokens, meta.host_segments)
        return path


def wrap_with_lora(model: LlamaForCausalLM, max_loras: int, max_rank: int) -> dict[str, LoRAProjection]:
    """Replaces every projection of ``model`` by a LoRA wrapper; returns them by module path
    (``layers.3.self_attn.qkv_proj``)."""
    wrapped: dict[str, LoRAProjection] = {}
    for path, module in list(model.named_modules()):
        if isinstance(module, Projection):
            parent_path, _, attr = path.rpartition(".")
            lora = LoRAProjection(module, max_loras, max_rank)
            setattr(model.get_submodule(parent_path), attr, lora)
            wrapped[path] = lora
    return wrapped


def projection_shapes(wrapped: dict[str, LoRAProjection]) -> dict[str, dict[str, tuple[int, int]]]:
    """Projection path -> slice name -> (in_features, out_features), what adapters are checked against."""
    return {path: {name: (w.base.in_features, width) for name, width in w.base.slices.items()}
            for path, w in wrapped.items()}

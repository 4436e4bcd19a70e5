"""Where a LoRA layer's adapter product runs: one backend per layer, chosen by device when the
layer is built, called once per forward.

- ``TritonBackend`` (CUDA): the shrink and expand Triton kernels, one launch each per layer.
- ``CpuBackend`` (everywhere else, where Triton's interpreter is slower than torch by orders of
  magnitude): per step, the path of ``CpuLoraPath`` that ``kernels.cpu_tuner.choose_path``
  measured fastest on this machine for steps like it: dense, gathered or segmented
  (``kernels.cpu_lora``) over a packed copy of the slots, or the segment loop of ``kernels.reference``.

Every path has the semantics documented in ``kernels.reference``, so one layer code runs on any. One
exception, in a row whose own adapter product overflows: the segmented path also turns the row's other
slices to NaN (``kernels.cpu_lora.lora_segmented``); that row's output is lost on every path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import cpu_lora, cpu_tuner, reference
from kernels.cpu_tuner import CpuLoraPath, CpuLoraRun, intra_op_threads
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


def lora_backend(slots: LoraSlots) -> LoraBackend:
    """The backend for the device the slots live on."""
    return TritonBackend(slots) if slots.lora_a.is_cuda else CpuBackend(slots)


class TritonBackend:
    """The Triton kernels, which read the slots directly: nothing to rebuild when a slot changes."""

    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots

    def apply(self, y: torch.Tensor, x: torch.Tensor, meta: LoraMeta) -> None:
        # Imported here: Triton is an optional dependency (the `cuda` extra) that CPU installs lack.
        from kernels.lora_expand import lora_expand
        from kernels.lora_shrink import lora_shrink

        sl = self.slots
        buf = meta.buffer[: sl.lora_a.shape[0], : x.shape[0]]  # [S, num_tokens, max_rank] float32 scratch
        lora_shrink(x, sl.lora_a, sl.ranks, meta, buf)
        lora_expand(y, buf, sl.lora_b, sl.ranks, sl.slice_offsets, meta)

    def slot_changed(self, slot: int) -> None:
        pass


class CpuBackend:
    """The CPU paths. After a slot change, the plan (ranks only) and the dense and segmented packs
    are rebuilt when next needed; the gathered pack is patched, one changed slot at a time, by the
    next step that takes the gathered path."""

    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots
        self._plan: cpu_tuner.CpuPlan | None = None  # None: slots changed since it was made
        self._dense: cpu_lora.DensePack | None = None
        self._segmented: cpu_lora.SegmentPack | None = None
        self._gathered: cpu_lora.GatherPack | None = None
        self._stale_slots: set[int] = set()  # slots changed since the gathered pack was last brought up to date

    def slot_changed(self, slot: int) -> None:
        self._plan = self._dense = self._segmented = None
        self._stale_slots.add(slot)

    def apply(self, y: torch.Tensor, x: torch.Tensor, meta: LoraMeta) -> None:
        path = self.path(y, x, meta)
        if path is not None:  # None: no resident adapter adapts this layer
            self._run(path, y, x, meta)

    def _run(self, choice: CpuLoraRun, y: torch.Tensor, x: torch.Tensor, meta: LoraMeta) -> None:
        with intra_op_threads(choice.threads):
            self._run_path(choice.path, y, x, meta)

    def _run_path(self, path: CpuLoraPath, y: torch.Tensor, x: torch.Tensor, meta: LoraMeta) -> None:
        sl, step = self.slots, meta.step_cache
        if path is CpuLoraPath.DENSE:
            pack = self._dense_pack()
            cpu_lora.lora_dense(y, x, pack, step.mask(pack, meta.token_slots))
        elif path is CpuLoraPath.GATHERED:
            pack = self._gathered_pack()
            cpu_lora.lora_gathered(y, x, pack, step.gather_index(pack, meta.token_slots))
        elif path is CpuLoraPath.SEGMENTED:
            if self._segmented is None:
                self._segmented = cpu_lora.pack_segments(sl.lora_a, sl.lora_b, sl.host_ranks, sl.host_offsets)
            cpu_lora.lora_segmented(y, x, self._segmented, meta)
        else:
            buf = meta.buffer[: sl.lora_a.shape[0], : x.shape[0]]  # [S, num_tokens, max_rank] float32 scratch
            reference.lora_shrink(x, sl.lora_a, sl.ranks, meta, buf, sl.host_ranks)
            reference.lora_expand(y, buf, sl.lora_b, sl.ranks, sl.host_offsets, meta, sl.host_ranks)

    def path(self, y: torch.Tensor, x: torch.Tensor, meta: LoraMeta) -> CpuLoraRun | None:
        """The path, and the threads it runs on, this layer takes in the step of ``meta`` (``y``, ``x``
        as for ``apply``; runs not measured yet for steps like this one are timed on them, into a
        scratch copy of ``y``); None when no resident adapter has a rank on it."""
        plan = self._plan
        if plan is None:
            sl = self.slots
            plan = self._plan = cpu_tuner.plan(sl.host_ranks, sl.lora_a.shape[3], sl.lora_b.shape[1])
        if plan.rank == 0:
            return None
        # Layers with equal plans (same shape, same resident ranks) choose alike: once per step.
        paths = meta.step_cache.paths
        path = paths.get(plan)
        if path is None:
            scratch = y.clone()
            path = paths[plan] = cpu_tuner.choose_path(plan, meta.num_tokens, meta.host_segments,
                                                      lambda p: self._run(p, scratch, x, meta))
        return path

    def _dense_pack(self) -> cpu_lora.DensePack:
        if self._dense is None:
            sl = self.slots
            self._dense = cpu_lora.pack(sl.lora_a, sl.lora_b, sl.host_ranks, sl.host_offsets)
        return self._dense

    def _gathered_pack(self) -> cpu_lora.GatherPack:
        sl = self.slots
        args = (sl.lora_a, sl.lora_b, sl.host_ranks, sl.host_offsets)
        packed = self._gathered
        if packed is not None and not all(cpu_lora.update_gathered(packed, *args, slot)
                                          for slot in sorted(self._stale_slots)):
            packed = None  # a slot outgrew the pack's rank
        if packed is None:
            packed = self._gathered = cpu_lora.pack_gathered(*args)
        self._stale_slots.clear()
        return packed

"""The CPU LoRA paths for steps that mix adapters: dense, gathered and segmented, beside the segment loop.

The reference path (``kernels.reference``) runs one shrink and up to S expands per adapter
segment. On a CPU each of those small matmuls costs microseconds of dispatch whatever its size,
so a decode step with several adapters can pay more for the calls than for the arithmetic. Three
paths replace the loop where they pay; all work on copies of the resident slots packed once, when
the slots change. Two cost a fixed number of ops per layer:

- dense, for a few adapters: the ranks of every resident adapter side by side,

      packed_a:  [in_features, R]   A of every (slice, slot) with a nonzero rank, transposed
      b (per slice): [R_s, width_s]  B of that slice's columns, on that slice's output rows only
      col_slots: [R]                slot that owns each packed column

  and a step is ``s = x @ packed_a``, zeroing every column that is not the token's own slot, and
  ``y[:, slice] += s[:, slice's columns] @ b`` per slice (the mask is built once per step for all
  layers of one layout). Each token is multiplied by every adapter's ranks, so the arithmetic
  grows with the number of resident adapters.
- gathered, for many adapters (the batched gather-matvec of multi-adapter serving): every slot's
  A and B zero-padded to the largest rank ``r``,

      a: [max_loras + 1, S * r, in_features]   A of each slot, slices stacked
      b: [max_loras + 1, out_features, r]      B of each slot

  and a step gathers each token's own A and B and runs two batched matrix-vector products. Index
  ``max_loras`` is all zeros: tokens without an adapter add exact zeros. The cost is moving each
  token's adapter once, whatever the number of adapters.

and one costs two ops per adapter segment, against the loop's 1 + S:

- segmented: per slot, its A of every slice side by side and its B of every slice as one
  block-diagonal matrix,

      a[slot]: [in_features, R_slot]    b[slot]: [R_slot, out_features], zero off each slice's block

  and each segment is ``y[rows] += (x[rows] @ a[slot]) @ b[slot]``, on views of its rows where the
  step has them in one run (the model runner sorts a step's sequences by slot). Each token meets only
  its own adapter's ranks, as in the loop; the expand multiplies the zero blocks too, which costs
  S times the expand's few FLOPs and spares S - 1 calls.

Which path a step takes is measured on the machine, not set by constants: ``kernels.cpu_tuner``.
A packed copy is built only for layers that measure or take its path. What every layer of one step
can share (the path for a plan, the dense mask for a layout, the gather index) is kept in that step's
``CpuStepCache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.cpu_tuner import CpuLoraRun, CpuPlan
    from kernels.lora_meta import LoraMeta


@dataclass(frozen=True)
class SliceExpand:
    lo: int  # output rows lo:hi of this slice
    hi: int
    start: int  # its packed columns start:end
    end: int
    b: torch.Tensor  # [end - start, hi - lo] float32


@dataclass(frozen=True)
class DensePack:
    packed_a: torch.Tensor  # [in_features, R] float32, columns grouped by slice, then by slot
    expands: tuple[SliceExpand, ...]  # one per slice with a nonzero rank
    col_slots: torch.Tensor  # [R] int32
    layout: tuple[tuple[int, int], ...]  # (slot, rank) of each packed group: equal layouts share a mask

    @property
    def rank(self) -> int:
        return self.col_slots.numel()


def pack(lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
         slice_offsets: list[int]) -> DensePack:
    """``lora_a``: [S, max_loras, max_rank, in]; ``lora_b``: [max_loras, out, max_rank];
    ``host_ranks``: [S][max_loras] real ranks; ``slice_offsets``: S + 1 row offsets."""
    num_slices, max_loras, _, in_features = lora_a.shape
    columns = [(s, slot, host_ranks[s][slot]) for s in range(num_slices) for slot in range(max_loras)
               if host_ranks[s][slot]]
    total = sum(r for _, _, r in columns)
    packed_a = torch.empty(in_features, total, dtype=torch.float32, device=lora_a.device)
    col_slots = torch.empty(total, dtype=torch.int32, device=lora_a.device)
    expands, c = [], 0
    for s in range(num_slices):
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        start = c
        blocks = []
        for _, slot, r in (col for col in columns if col[0] == s):
            packed_a[:, c : c + r] = lora_a[s, slot, :r].T
            blocks.append(lora_b[slot, lo:hi, :r].T.float())
            col_slots[c : c + r] = slot
            c += r
        if blocks:
            expands.append(SliceExpand(lo, hi, start, c, torch.cat(blocks).contiguous()))
    return DensePack(packed_a, tuple(expands), col_slots, tuple((slot, r) for _, slot, r in columns))


@dataclass
class CpuStepCache:
    """What the CPU LoRA layers of one step share, computed by the first layer that needs it:
    layers with equal plans take one path, layers of one dense layout use one mask, and gathered
    layers one index. Each step has its own (``LoraMeta.step_cache``)."""

    paths: dict[CpuPlan, CpuLoraRun] = field(default_factory=dict)
    masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = field(default_factory=dict)  # by DensePack.layout
    gather_indices: dict[int, torch.Tensor] = field(default_factory=dict)  # by GatherPack.zero_slot

    def mask(self, pack: DensePack, token_slots: torch.Tensor) -> torch.Tensor:
        """[num_tokens, R] bool: the packed columns of each token's own slot (``token_slots``:
        [num_tokens] int32, -1 = base model only, which owns no column)."""
        mask = self.masks.get(pack.layout)
        if mask is None:
            mask = self.masks[pack.layout] = token_slots[:, None] == pack.col_slots[None, :]
        return mask

    def gather_index(self, pack: GatherPack, token_slots: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64: each token's slot in ``pack``, its all-zero slot for tokens of slot -1."""
        index = self.gather_indices.get(pack.zero_slot)
        if index is None:
            index = torch.where(token_slots >= 0, token_slots, pack.zero_slot).long()
            self.gather_indices[pack.zero_slot] = index
        return index


def lora_dense(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    pack: DensePack,
    mask: torch.Tensor,  # [num_tokens, R] bool, the token's own columns (CpuStepCache.mask)
) -> None:
    """``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` over each slice, with the semantics of
    ``kernels.reference``'s shrink then expand: accumulated in float32 and rounded once to ``y``'s
    dtype. Rows of slot -1 get exact zeros added."""
    if pack.rank == 0:
        return
    # where(), not a multiply: another adapter's product may be inf, and inf * 0 is NaN.
    s = torch.where(mask, x.float() @ pack.packed_a, 0.0)  # [num_tokens, R]
    acc = y if y.dtype == torch.float32 else y.float()
    for e in pack.expands:  # per slice: B is zero outside its slice's rows, so skip those
        acc[:, e.lo : e.hi].addmm_(s[:, e.start : e.end], e.b)
    if acc is not y:
        y.copy_(acc)


@dataclass(frozen=True)
class GatherPack:
    a: torch.Tensor  # [max_loras + 1, S * r, in_features] float32, zero past each real rank
    b: torch.Tensor  # [max_loras + 1, out_features, r] float32, zero past each real rank
    row_slice: torch.Tensor | None  # [1, out_features, 1] int64 slice of each output row (None: one slice)
    rank: int  # r

    @property
    def zero_slot(self) -> int:
        """The all-zero slot that tokens without an adapter gather."""
        return self.a.shape[0] - 1


def pack_gathered(lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
                  slice_offsets: list[int]) -> GatherPack:
    """Arguments as for ``pack``. Only real ranks are copied: slot padding is never read."""
    num_slices, max_loras, _, in_features = lora_a.shape
    r = max(max(ranks) for ranks in host_ranks)
    a = torch.zeros(max_loras + 1, num_slices * r, in_features, dtype=torch.float32, device=lora_a.device)
    b = torch.zeros(max_loras + 1, lora_b.shape[1], r, dtype=torch.float32, device=lora_a.device)
    row_slice = None
    if num_slices > 1:
        widths = torch.tensor(slice_offsets).diff()
        row_slice = torch.repeat_interleave(torch.arange(num_slices), widths).view(1, -1, 1).to(lora_a.device)
    packed = GatherPack(a, b, row_slice, r)
    for slot in range(max_loras):
        update_gathered(packed, lora_a, lora_b, host_ranks, slice_offsets, slot)
    return packed


def update_gathered(pack: GatherPack, lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
                    slice_offsets: list[int], slot: int) -> bool:
    """Copies ``slot`` into ``pack`` after the slot changed: 1/max_loras of a repack, which matters
    when adapters come and go. Returns False, copying nothing, when the slot's ranks exceed the
    pack's: the pack then no longer matches the slots and must be rebuilt."""
    num_slices, in_features = lora_a.shape[0], lora_a.shape[3]
    ranks = [host_ranks[s][slot] for s in range(num_slices)]
    if max(ranks) > pack.rank:
        return False
    a = pack.a.view(pack.a.shape[0], num_slices, pack.rank, in_features)
    a[slot].zero_()
    pack.b[slot].zero_()
    for s, rank in enumerate(ranks):
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        a[slot, s, :rank] = lora_a[s, slot, :rank]
        pack.b[slot, lo:hi, :rank] = lora_b[slot, lo:hi, :rank]  # rows of slice s use its rank
    return True


def lora_gathered(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    pack: GatherPack,
    index: torch.Tensor,  # [num_tokens] int64, each token's slot in pack (CpuStepCache.gather_index)
) -> None:
    """``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` over each slice with the semantics of
    ``kernels.reference`` (float32, rounded once to ``y``'s dtype); rows of slot -1 get exact zeros."""
    num_tokens = x.shape[0]
    s = torch.bmm(pack.a.index_select(0, index), x.float().unsqueeze(-1))  # [T, S * r, 1]
    b = pack.b.index_select(0, index)  # [T, out, r]
    if pack.row_slice is None:
        delta = torch.bmm(b, s).squeeze(-1)  # [T, out]
    else:  # every slice's product for every row, then each row's own slice
        per_slice = torch.bmm(b, s.view(num_tokens, -1, pack.rank).transpose(1, 2))  # [T, out, S]
        delta = per_slice.gather(2, pack.row_slice.expand(num_tokens, -1, -1)).squeeze(-1)
    if y.dtype == torch.float32:
        y.add_(delta)
    else:
        y.copy_(y.float() + delta)


@dataclass(frozen=True)
class SegmentPack:
    """The segmented path's copy of a layer's slots: per slot with a rank on the layer, one A and one
    block-diagonal B, so that a segment is one matmul pair."""

    a: dict[int, torch.Tensor]  # slot -> [in_features, R_slot] float32: A of each slice, transposed, side by side
    b: dict[int, torch.Tensor]  # slot -> [R_slot, out_features] float32: B of each slice on its own rows and columns


def pack_segments(lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
                  slice_offsets: list[int]) -> SegmentPack:
    """Arguments as for ``pack``; slots without a rank on the layer are left out. Only real ranks are
    copied: slot padding is never read."""
    num_slices, max_loras = lora_a.shape[:2]
    a, b = {}, {}
    for slot in range(max_loras):
        ranks = [host_ranks[s][slot] for s in range(num_slices)]
        if not any(ranks):
            continue
        a[slot] = torch.cat([lora_a[s, slot, :r] for s, r in enumerate(ranks) if r]).T.float().contiguous()
        b[slot] = torch.zeros(sum(ranks), lora_b.shape[1], dtype=torch.float32, device=lora_b.device)
        c = 0
        for s, r in enumerate(ranks):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            b[slot][c : c + r, lo:hi] = lora_b[slot, lo:hi, :r].T
            c += r
    return SegmentPack(a, b)


def lora_segmented(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    pack: SegmentPack,
    meta: LoraMeta,
) -> None:
    """``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` over each slice, one segment at a time, with the
    semantics of ``kernels.reference`` (float32, rounded once to ``y``'s dtype); rows of slot -1 are
    not touched. Where a token's own product overflows, its other slices' columns get NaN (inf times
    the zero blocks) where the reference leaves them finite: that row's output is lost either way. Slices
    the slot does not adapt get zeros added (a -0.0 there becomes +0.0), where the reference leaves them."""
    for slot, start, end, run in meta.host_segments:
        a = pack.a.get(slot)
        if a is None:
            continue
        rows = meta.segment_rows(start, end, run)
        if isinstance(rows, slice) and y.dtype == torch.float32:  # y[rows] is a view: add in place
            y[rows].addmm_(x[rows].float() @ a, pack.b[slot])
        else:
            y[rows] = y[rows].float().addmm_(x[rows].float() @ a, pack.b[slot]).to(y.dtype)

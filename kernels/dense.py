"""The CPU LoRA path for small steps: every resident adapter in one shrink and one expand.

The reference path (``kernels.reference``) runs one shrink and up to S expands per adapter
segment. On a CPU each of those small matmuls costs tens of microseconds of dispatch whatever
its size, so a decode step with a few adapters pays more for the calls than for the
arithmetic. Here the ranks of every resident adapter are packed side by side once, when the
slots change:

    packed_a:  [in_features, R]   A of every (slice, slot) with a nonzero rank, transposed
    b (per slice): [R_s, width_s]  B of that slice's columns, on that slice's output rows only
    col_slots: [R]                slot that owns each packed column

A step is then ``s = x @ packed_a``, zeroing every column that is not the token's own
slot, and ``y[:, slice] += s[:, slice's columns] @ b`` per slice: 2 + S ops per layer however
many adapters the step mixes (the mask is built once per step for all layers of one layout), at
the price of computing each token's product with the other adapters' ranks as well.
``dense_pays`` weighs that waste against the per-op cost of the segment loop, from a ``DensePlan``
(ranks only); the packed copy is built only for layers that take the dense path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Costs of this machine class (2-core x86 VM, float32), measured with torch 2.13: one small
# matmul or index op costs ~15 µs of dispatch, and small matmuls run at ~50 GFLOP/s.
OP_SECONDS = 15e-6
FLOP_PER_SECOND = 50e9


@dataclass(frozen=True)
class SliceExpand:
    lo: int  # output rows lo:hi of this slice
    hi: int
    start: int  # its packed columns start:end
    end: int
    b: torch.Tensor  # [end - start, hi - lo] float32


@dataclass(frozen=True)
class DensePlan:
    """What the cost estimate needs, without the packed weights (cheap to keep per layer)."""

    rank: int  # R, the total rank of every resident (slot, slice)
    slot_ranks: tuple[int, ...]  # [max_loras] total rank of each slot over the slices
    num_expands: int  # slices with a nonzero rank
    num_slices: int
    width: int  # in_features + out_features


@dataclass(frozen=True)
class DensePack:
    packed_a: torch.Tensor  # [in_features, R] float32, columns grouped by slice, then by slot
    expands: tuple[SliceExpand, ...]  # one per slice with a nonzero rank
    col_slots: torch.Tensor  # [R] int32
    layout: tuple[tuple[int, int], ...]  # (slot, rank) of each packed group: equal layouts share a mask

    @property
    def rank(self) -> int:
        return self.col_slots.numel()


def plan(host_ranks: list[list[int]], in_features: int, out_features: int) -> DensePlan:
    """``host_ranks``: [S][max_loras] real ranks."""
    slot_ranks = tuple(sum(ranks[slot] for ranks in host_ranks) for slot in range(len(host_ranks[0])))
    return DensePlan(sum(slot_ranks), slot_ranks, sum(1 for ranks in host_ranks if any(ranks)), len(host_ranks),
                     in_features + out_features)


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


def dense_pays(plan: DensePlan, num_tokens: int, segments: tuple[tuple[int, int, int, int], ...]) -> bool:
    """Whether the dense path is expected to beat the segment loop for a step of ``num_tokens``
    whose adapter segments are ``segments`` ((slot, start, end, run), as in ``LoraMeta.host_segments``)."""
    dense = (2 + plan.num_expands) * OP_SECONDS + 2 * num_tokens * plan.rank * plan.width / FLOP_PER_SECOND
    loop = 0.0
    for slot, start, end, _ in segments:
        flops = 2 * (end - start) * plan.slot_ranks[slot] * plan.width
        loop += (2 + plan.num_slices) * OP_SECONDS + flops / FLOP_PER_SECOND
    return dense < loop


def lora_dense(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    pack: DensePack,
    token_slots: torch.Tensor,  # [num_tokens] int32, -1 = base model only
    masks: dict | None = None,  # the step's masks by layout, shared by the layers of one step
) -> None:
    """``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` over each slice, with the semantics of
    ``kernels.reference``'s shrink then expand: accumulated in float32 and rounded once to ``y``'s
    dtype. Rows of slot -1 get exact zeros added."""
    if pack.rank == 0:
        return
    mask = masks.get(pack.layout) if masks is not None else None
    if mask is None:
        mask = token_slots[:, None] == pack.col_slots[None, :]  # [num_tokens, R]: the token's own columns
        if masks is not None:
            masks[pack.layout] = mask
    # where(), not a multiply: another adapter's product may be inf, and inf * 0 is NaN.
    s = torch.where(mask, x.float() @ pack.packed_a, 0.0)  # [num_tokens, R]
    acc = y if y.dtype == torch.float32 else y.float()
    for e in pack.expands:  # per slice: B is zero outside its slice's rows, so skip those
        acc[:, e.lo : e.hi].addmm_(s[:, e.start : e.end], e.b)
    if acc is not y:
        y.copy_(acc)

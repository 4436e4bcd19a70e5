"""The CPU LoRA path for small steps: every resident adapter in one shrink and one expand.

The reference path (``kernels.reference``) runs one shrink and up to S expands per adapter
segment. On a CPU each of those small matmuls costs tens of microseconds of dispatch whatever
its size, so a decode step with a few adapters pays more for the calls than for the
arithmetic. Here the ranks of every resident adapter are packed side by side once, when the
slots change:

    packed_a:  [in_features, R]   A of every (slot, slice) with a nonzero rank, transposed
    packed_b:  [R, out_features]  B of the same columns, each on its slice's rows only (zero elsewhere)
    col_slots: [R]                slot that owns each packed column

A step is then ``s = x @ packed_a``, zeroing every column that is not the token's own
slot, and ``y += s @ packed_b``: four ops per layer however many adapters the step mixes, at
the price of computing each token's product with the other adapters' ranks as well.
``dense_pays`` weighs that waste against the per-op cost of the segment loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Costs of this machine class (2-core x86 VM, float32), measured with torch 2.13: one small
# matmul or index op costs ~15 µs of dispatch, and small matmuls run at ~50 GFLOP/s.
OP_SECONDS = 15e-6
FLOP_PER_SECOND = 50e9


@dataclass(frozen=True)
class DensePack:
    packed_a: torch.Tensor  # [in_features, R] float32
    packed_b: torch.Tensor  # [R, out_features] float32
    col_slots: torch.Tensor  # [R] int32

    @property
    def rank(self) -> int:
        return self.col_slots.numel()


def pack(lora_a: torch.Tensor, lora_b: torch.Tensor, host_ranks: list[list[int]],
         slice_offsets: list[int]) -> DensePack:
    """``lora_a``: [S, max_loras, max_rank, in]; ``lora_b``: [max_loras, out, max_rank];
    ``host_ranks``: [S][max_loras] real ranks; ``slice_offsets``: S + 1 row offsets."""
    num_slices, max_loras, _, in_features = lora_a.shape
    out_features = lora_b.shape[1]
    columns = [(slot, s, host_ranks[s][slot]) for slot in range(max_loras) for s in range(num_slices)
               if host_ranks[s][slot]]
    total = sum(r for _, _, r in columns)
    packed_a = torch.empty(in_features, total, dtype=torch.float32, device=lora_a.device)
    packed_b = torch.zeros(total, out_features, dtype=torch.float32, device=lora_b.device)
    col_slots = torch.empty(total, dtype=torch.int32, device=lora_a.device)
    c = 0
    for slot, s, r in columns:
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        packed_a[:, c : c + r] = lora_a[s, slot, :r].T
        packed_b[c : c + r, lo:hi] = lora_b[slot, lo:hi, :r].T
        col_slots[c : c + r] = slot
        c += r
    return DensePack(packed_a, packed_b, col_slots)


def dense_pays(pack: DensePack, num_tokens: int, segments: list[tuple[int, int]], in_features: int,
               out_features: int, num_slices: int) -> bool:
    """Whether the dense path is expected to beat the segment loop for a step whose adapter
    segments are ``segments`` (token count, packed rank of that segment's slot) over ``num_tokens``."""
    width = in_features + out_features
    dense = 4 * OP_SECONDS + 2 * num_tokens * pack.rank * width / FLOP_PER_SECOND
    loop = sum((2 + num_slices) * OP_SECONDS + 2 * n * r * width / FLOP_PER_SECOND for n, r in segments)
    return dense < loop


def lora_dense(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    pack: DensePack,
    token_slots: torch.Tensor,  # [num_tokens] int32, -1 = base model only
) -> None:
    """``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` over each slice, with the semantics of
    ``kernels.reference``'s shrink then expand: accumulated in float32 and rounded once to ``y``'s
    dtype. Rows of slot -1 get exact zeros added."""
    if pack.rank == 0:
        return
    s = x.float() @ pack.packed_a  # [num_tokens, R]
    # where(), not a multiply: another adapter's product may be inf, and inf * 0 is NaN.
    s = torch.where(token_slots[:, None] == pack.col_slots[None, :], s, 0.0)
    if y.dtype == torch.float32:
        y.addmm_(s, pack.packed_b)
    else:
        y.copy_(torch.addmm(y.float(), s, pack.packed_b))

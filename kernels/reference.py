"""Pure-torch multi-adapter LoRA: the CPU path and the oracle the Triton kernels are tested against.

Layouts shared with the kernels (S = packed output slices of the layer, e.g. 3 for qkv):
    lora_a:  [S, max_loras, max_rank, in_features]   A of every slot, per slice
    lora_b:  [max_loras, out_features, max_rank]     B of every slot, slices stacked on rows
    ranks:   [S, max_loras] int32                    real rank of each slot per slice (0 = empty)
    slice_offsets: [S + 1] int32                     slice s owns output rows offsets[s]:offsets[s+1]
    buf:     [S, num_tokens, max_rank] float32       shrink output, expand input

Only the first ``ranks[s, slot]`` rank columns of a slot are read, so padding costs nothing.
Tokens whose slot is -1 are never read or written.
"""

from __future__ import annotations

import torch

from kernels.lora_meta import LoraMeta


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [S, max_loras, max_rank, in_features]
    ranks: torch.Tensor,  # [S, max_loras] int32
    meta: LoraMeta,
    buf: torch.Tensor,  # [S, num_tokens, max_rank] float32, written
    host_ranks: list[list[int]] | None = None,
) -> None:
    """``buf[s, t, :r] = x[t] @ lora_a[s, slot[t], :r].T`` with ``r = ranks[s, slot[t]]``,
    for every token with ``slot[t] >= 0``, accumulated in float32."""
    host_ranks = host_ranks if host_ranks is not None else ranks.tolist()
    num_slices = lora_a.shape[0]
    for slot, start, end, run in meta.host_segments:
        slot_ranks = [host_ranks[s][slot] for s in range(num_slices)]
        if not any(slot_ranks):
            continue
        rows = meta.segment_rows(start, end, run)
        xs = x[rows].float()  # [n, in]
        if len(set(slot_ranks)) == 1:  # one rank for every slice: all slices in one batched matmul
            r = slot_ranks[0]
            buf[:, rows, :r] = torch.matmul(xs, lora_a[:, slot, :r].float().transpose(1, 2))  # [S, n, r]
            continue
        for s, r in enumerate(slot_ranks):
            if r:
                buf[s, rows, :r] = xs @ lora_a[s, slot, :r].float().T


def lora_expand(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    buf: torch.Tensor,  # [S, num_tokens, max_rank] float32
    lora_b: torch.Tensor,  # [max_loras, out_features, max_rank]
    ranks: torch.Tensor,  # [S, max_loras] int32
    slice_offsets: list[int],  # S + 1 row offsets
    meta: LoraMeta,
    host_ranks: list[list[int]] | None = None,
) -> None:
    """``y[t, off_s:off_s+n_s] += buf[s, t, :r] @ lora_b[slot[t], off_s:off_s+n_s, :r].T``,
    accumulated in float32, added to ``y`` in float32 and rounded once to ``y``'s dtype;
    rows with slot -1 untouched."""
    host_ranks = host_ranks if host_ranks is not None else ranks.tolist()
    for slot, start, end, run in meta.host_segments:
        slot_ranks = [host_ranks[s][slot] for s in range(len(slice_offsets) - 1)]
        if not any(slot_ranks):
            continue
        rows = meta.segment_rows(start, end, run)
        in_place = isinstance(rows, slice) and y.dtype == torch.float32  # y[rows] is then a view of y
        acc = y[rows].float()  # [n, out]
        for s, r in enumerate(slot_ranks):
            if r:
                lo, hi = slice_offsets[s], slice_offsets[s + 1]
                acc[:, lo:hi].addmm_(buf[s, rows, :r], lora_b[slot, lo:hi, :r].float().T)
        if not in_place:
            y[rows] = acc.to(y.dtype)

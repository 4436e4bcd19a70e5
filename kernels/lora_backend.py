"""Device dispatch for the multi-adapter LoRA ops: Triton kernels on CUDA, the torch
reference everywhere else. Both have the semantics documented in ``kernels.reference``, and the
LoRA layers call only these two functions, so one layer code runs on either path."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.lora_meta import LoraMeta


def runs_triton(t: torch.Tensor) -> bool:
    """Triton kernels run where the tensors live on a GPU; on CPU the reference is faster than
    Triton's interpreter by orders of magnitude."""
    return t.is_cuda


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, meta: LoraMeta,
                buf: torch.Tensor, host_ranks: list[list[int]]) -> None:
    """``buf[s, t, :r] = x[t] @ lora_a[s, slot[t], :r].T`` for LoRA tokens (see ``kernels.reference``)."""
    if runs_triton(x):
        # Imported here: Triton is an optional dependency (the `cuda` extra) that CPU installs lack.
        from kernels.lora_shrink import lora_shrink as triton_shrink

        triton_shrink(x, lora_a, ranks, meta, buf)
    else:
        reference.lora_shrink(x, lora_a, ranks, meta, buf, host_ranks)


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor,
                slice_offsets: torch.Tensor, host_offsets: list[int], meta: LoraMeta,
                host_ranks: list[list[int]]) -> None:
    """``y[t, lo:hi] += buf[s, t, :r] @ lora_b[slot[t], lo:hi, :r].T`` for LoRA tokens, per slice
    ``s`` (see ``kernels.reference``). ``slice_offsets`` (device) and ``host_offsets`` hold the
    same offsets, for the kernel and the reference respectively."""
    if runs_triton(y):
        from kernels.lora_expand import lora_expand as triton_expand

        triton_expand(y, buf, lora_b, ranks, slice_offsets, meta)
    else:
        reference.lora_expand(y, buf, lora_b, ranks, host_offsets, meta, host_ranks)

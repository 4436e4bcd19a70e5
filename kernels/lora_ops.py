"""Device dispatch for the multi-adapter LoRA ops: Triton kernels on CUDA, the torch
reference everywhere else. Both have the semantics documented in ``kernels.reference``."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.lora_meta import LoraMeta


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, meta: LoraMeta,
                buf: torch.Tensor, host_ranks: list[list[int]]) -> None:
    if x.is_cuda:
        from kernels.lora_shrink import lora_shrink as triton_shrink

        triton_shrink(x, lora_a, ranks, meta, buf)
    else:
        reference.lora_shrink(x, lora_a, ranks, meta, buf, host_ranks)


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor,
                slice_offsets: torch.Tensor, host_offsets: list[int], meta: LoraMeta,
                host_ranks: list[list[int]]) -> None:
    if y.is_cuda:
        from kernels.lora_expand import lora_expand as triton_expand

        triton_expand(y, buf, lora_b, ranks, slice_offsets, meta)
    else:
        reference.lora_expand(y, buf, lora_b, ranks, host_offsets, meta, host_ranks)

"""The CUDA path's layer ops: the fused Triton kernels (``kernels.fused_norm``, ``kernels.fused_rotary``,
``kernels.fused_activation``), one launch each where torch runs several elementwise kernels. Every launch's
grid depends only on tensor shapes and nothing syncs with the host, so a step captures in a CUDA graph.
Under Triton's interpreter the same code runs on CPU tensors (the tests do).

Gemma's sandwich norms (no residual add) run the norm kernel alone; Qwen3's and Gemma 3's per-head q/k norms
stay torch ops on every path."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.fused_activation import act_mul
from kernels.fused_norm import add_rms_norm
from kernels.fused_rotary import rotary

if TYPE_CHECKING:
    from data_plane.model.llama import RMSNorm
    from data_plane.model.rope import RotaryEmbedding


class TritonOps:
    def add_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return add_rms_norm(x, residual, norm.weight, norm.eps, norm.offset), x if residual is None else residual

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, norm.weight, norm.eps, norm.offset)

    def rotary(self, rotary_embedding: RotaryEmbedding, tables: tuple[torch.Tensor, torch.Tensor],
               qk: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return rotary(qk, *tables)

    def act_mul(self, activation: str, gate_up: torch.Tensor) -> torch.Tensor:
        return act_mul(gate_up, activation)

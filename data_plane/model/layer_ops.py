"""The elementwise ops between a layer's projections: the residual add with the RMSNorm after it, rotary on
queries and keys, the gated activation. Chosen once per model by device (``layer_ops``), like the attention
backend: the CPU path's own torch ops (``TorchOps``), the fused Triton kernels on CUDA
(``triton_layer_ops``). The model hands its ops to the layers in the step's ``ForwardBatch``, so no layer
branches on the device.

The residual stream is threaded through the layers as ``(x, residual)``: ``x`` what the last block added,
``residual`` the sum so far (None before the first layer). ``add_norm`` adds the one to the other and
normalises the sum, where a layer used to write ``x = x + block(x)`` and normalise ``x`` in its next block.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from data_plane.model.llama import RMSNorm
    from data_plane.model.rope import RotaryEmbedding

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


class LayerOps(Protocol):
    def add_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``residual = residual + x`` (``x`` itself when ``residual`` is None), then ``(norm(residual),
        residual)``; ``residual`` may be updated in place."""

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)`` (``x``: [rows, hidden])."""

    def rotary(self, rotary: RotaryEmbedding, tables: tuple[torch.Tensor, torch.Tensor], qk: torch.Tensor
               ) -> torch.Tensor:  # fmt: skip
        """``rotary(tables, qk)`` for ``qk`` [tokens, heads, head_dim]; ``qk`` may be rotated in place."""

    def act_mul(self, activation: str, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the packed [tokens, 2 * width] gate/up output."""


class TorchOps:
    """The CPU path: each op as the torch modules compute it (its bits are what the CPU's batch-invariance
    tests pin down)."""

    def add_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        residual = x if residual is None else residual + x
        return norm(residual), residual

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def rotary(self, rotary: RotaryEmbedding, tables: tuple[torch.Tensor, torch.Tensor], qk: torch.Tensor
               ) -> torch.Tensor:  # fmt: skip
        return rotary(tables, qk)

    def act_mul(self, activation: str, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return ACTIVATIONS[activation](gate) * up


def layer_ops(device: torch.device | str) -> LayerOps:
    """The ops for ``device``: the fused Triton kernels on CUDA, torch elsewhere."""
    if torch.device(device).type == "cuda":
        from data_plane.model.triton_layer_ops import TritonOps  # Triton: the `cuda` extra

        return TritonOps()
    return TorchOps()

"""Triton gated activation on the packed gate/up projection's output: ``act(gate) * up`` in one pass, where
torch runs a split, the activation and a multiply, writing the activation in between.

``act`` is SiLU (Llama, Mistral, Qwen, Phi) or the tanh approximation of GELU (Gemma), the activations
``ModelConfig`` supports. The activation is rounded to the output dtype before it meets ``up``, as the
checkpoints' (and the CPU path's) two torch ops round it. Program ``(t, c)`` takes token ``t``'s
columns ``c·BLOCK ..``: no element depends on another row (batch invariance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
BLOCK = 1024


@triton.jit
def _act_mul_kernel(
    gate_up_ptr,  # [tokens, 2 * width]: gate then up, rows stride_g apart
    out_ptr,  # [tokens, width], rows stride_o apart
    stride_g,
    stride_o,
    width,
    ACT: tl.constexpr,  # one of ACTIVATIONS
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    row = gate_up_ptr + t * stride_g
    g = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + width + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == "silu":
        a = g * tl.sigmoid(g)
    else:  # gelu_pytorch_tanh: 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))), tanh(z) = 2·sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g * tl.sigmoid(2.0 * z)  # = 0.5·g·(1 + tanh(z))
    a = a.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def act_mul(
    gate_up: torch.Tensor,  # [tokens, 2 * width]
    activation: str,
    out: torch.Tensor | None = None,  # [tokens, width], written; None: allocated
) -> torch.Tensor:  # out
    """The gated MLP's activation, in PyTorch terms::

        gate, up = gate_up.float().chunk(2, dim=-1)
        act = F.silu if activation == "silu" else partial(F.gelu, approximate="tanh")
        out = (act(gate).to(gate_up.dtype).float() * up).to(gate_up.dtype)

    Float32 math; the activation rounded to the dtype once, the product once. ``gate_up`` (fp16, bf16 or
    fp32) and ``out`` (when given) are dense along their last axis; rows may be strided. The grid depends
    only on the shapes (CUDA-graph capturable)."""
    assert activation in ACTIVATIONS, f"activation {activation!r}; fused: {', '.join(ACTIVATIONS)}"
    tokens, packed = gate_up.shape
    assert packed % 2 == 0 and gate_up.stride(1) == 1, f"gate_up {tuple(gate_up.shape)}: even width, dense rows"
    width = packed // 2
    if out is None:
        out = torch.empty(tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (tokens, width) and out.dtype == gate_up.dtype and out.stride(1) == 1, (
        f"out {tuple(out.shape)} {out.dtype} for {tokens} x {width} {gate_up.dtype}")
    if tokens == 0:
        return out
    grid = (tokens, triton.cdiv(width, BLOCK))
    _act_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), width, ACT=activation, BLOCK=BLOCK,
                          num_warps=4)  # fmt: skip
    return out

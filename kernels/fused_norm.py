"""Triton RMSNorm fused with the residual add before it: ``residual += x; out = rmsnorm(residual)`` in one
pass over each row, where torch runs an add, then five or six elementwise kernels and a reduction.

One program per row, the whole row in one block: the row's sum of squares is one ``tl.sum`` over a
block and warp count set by the hidden size alone, so a row's bits do not depend on how many rows
share the launch (batch invariance). Roundings follow the checkpoints' (and the CPU path's) order:
the sum rounded to the activations' dtype before it is normalised, Llama's normalised row rounded
before it meets ``weight``, Gemma's ``(offset + weight)`` scaling done in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 32768  # a row is one block: 64 KiB of bf16, 128 KiB of float32 in registers across the warps


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [rows, hidden], rows stride_x apart
    residual_ptr,  # HAS_RESIDUAL: [rows, hidden], rows stride_r apart, updated in place
    weight_ptr,  # [hidden]
    out_ptr,  # [rows, hidden], rows stride_o apart
    stride_x,
    stride_r,
    stride_o,
    hidden,
    eps,
    offset,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET_SCALE: tl.constexpr,  # scale by (offset + weight) in float32 and round once (Gemma)
    BLOCK: tl.constexpr,  # a power of two >= hidden
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The sum is rounded to the stream's dtype first: that rounded row is the residual stream.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET_SCALE:
        y = xf * rstd * (w + offset)
    else:
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def num_warps(hidden: int) -> int:
    """Warps a row's program runs on, by its width alone (so alike for every step)."""
    return 16 if hidden >= 8192 else 8 if hidden >= 2048 else 4


def add_rms_norm(
    x: torch.Tensor,  # [rows, hidden]
    residual: torch.Tensor | None,  # [rows, hidden], updated in place; None: no residual add
    weight: torch.Tensor,  # [hidden]
    eps: float,
    offset: float = 0.0,
    out: torch.Tensor | None = None,  # [rows, hidden], written; None: allocated
) -> torch.Tensor:  # out
    """RMSNorm of each row after the residual add, in PyTorch terms::

        if residual is not None:
            residual.copy_(residual + x)  # rounded to residual's dtype
            x = residual
        n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        if offset:  # Gemma
            out = (n * (weight.float() + offset)).to(x.dtype)
        else:  # Llama: normalised row rounded first, as the checkpoints were trained
            out = (n.to(x.dtype).float() * weight.float()).to(x.dtype)

    Float32 math; each row is reduced in one fixed order whatever the other rows. ``x``, ``residual`` and
    the returned tensor share one dtype (fp16, bf16 or fp32; ``weight`` may differ) and are dense along
    their last axis (``out`` too, when given); rows may be strided. The grid depends only on the shapes
    (CUDA-graph capturable).
    """
    rows, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous(), f"weight {tuple(weight.shape)} for hidden {hidden}"
    assert x.stride(1) == 1, "x must be dense along its last axis"
    assert hidden <= MAX_HIDDEN, f"hidden {hidden} > {MAX_HIDDEN}: a row must fit one block"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (
            f"residual {tuple(residual.shape)} {residual.dtype} for x {tuple(x.shape)} {x.dtype}")
        assert residual.stride(1) == 1, "residual must be dense along its last axis"
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(1) == 1, f"out {tuple(out.shape)} {out.dtype}"
    if rows == 0:
        return out
    grid = (rows,)
    _add_rms_norm_kernel[grid](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), hidden, eps, offset,
        HAS_RESIDUAL=residual is not None, OFFSET_SCALE=bool(offset), BLOCK=triton.next_power_of_2(hidden),
        num_warps=num_warps(hidden),
    )  # fmt: skip
    return out

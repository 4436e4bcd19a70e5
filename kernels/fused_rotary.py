"""Triton rotary position embedding, applied in place to the queries and keys of a packed qkv projection.

The half-split layout of Hugging Face checkpoints: element ``i < rotary_dim / 2`` of a head turns with
element ``i + rotary_dim / 2``. Each program loads both halves of its heads once and writes both back,
so the rotation needs no rolled copy of the row (torch's path builds one per layer), and nothing past
``rotary_dim`` (Phi's partial rotary) is read or written. Program ``(t, h)`` takes token ``t``'s heads
``h·BLOCK_H ..``: no element depends on another row, so a token's bits do not depend on its step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    qk_ptr,  # [tokens, heads, head_dim], strides (stride_qt, stride_qh, 1), rotated in place
    cos_ptr,  # [tokens, rotary_dim], rows stride_ct apart
    sin_ptr,  # [tokens, rotary_dim], rows stride_st apart (signed: the first half negated)
    stride_qt,
    stride_qh,
    stride_ct,
    stride_st,
    num_heads,
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_PAD: tl.constexpr,  # a power of two >= HALF
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_PAD)
    d_mask = d < HALF
    cos_row, sin_row = cos_ptr + t * stride_ct, sin_ptr + t * stride_st
    cos_lo = tl.load(cos_row + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]  # [1, HALF_PAD]
    cos_hi = tl.load(cos_row + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(sin_row + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(sin_row + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    mask = (heads < num_heads)[:, None] & d_mask[None, :]
    lo_ptr = qk_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh + d[None, :]  # [BLOCK_H, HALF_PAD]
    lo = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(lo_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(lo_ptr, (lo * cos_lo + hi * sin_lo).to(qk_ptr.dtype.element_ty), mask=mask)
    tl.store(lo_ptr + HALF, (hi * cos_hi + lo * sin_hi).to(qk_ptr.dtype.element_ty), mask=mask)


def block_heads(num_heads: int, rotary_dim: int) -> int:
    """Heads a program rotates, by the head shape alone: the largest power of two that divides ``num_heads``
    (no program masks off heads: 32 + 8 heads run 5 programs of 8, not 32 and 8 of 32), at most 4096
    elements a program."""
    return max(1, min(num_heads & -num_heads, 4096 // triton.next_power_of_2(rotary_dim)))


def rotary(
    qk: torch.Tensor,  # [tokens, heads, head_dim], rotated in place
    cos: torch.Tensor,  # [tokens, 1, rotary_dim] or [tokens, rotary_dim]
    sin: torch.Tensor,  # [tokens, 1, rotary_dim] or [tokens, rotary_dim], the first half negated
) -> torch.Tensor:  # qk
    """RoPE on the first ``rotary_dim`` elements of every head, in place, in PyTorch terms::

        half = rotary_dim // 2
        x = qk[..., :rotary_dim].float()
        qk[..., :rotary_dim] = (x * cos.float() + x.roll(half, dims=-1) * sin.float()).to(qk.dtype)

    (``RotaryEmbedding``'s tables: ``sin`` signed so that ``x.roll(half) * sin == rotate_half(x) * sin``.)
    Float32 math, one rounding; elements past ``rotary_dim`` are neither read nor written. ``qk`` may be a
    strided view (the queries and keys of a packed qkv output), dense along its last axis; the tables are
    dense along theirs. The grid depends only on the shapes (CUDA-graph capturable)."""
    tokens, num_heads, head_dim = qk.shape
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    rotary_dim = cos.shape[1]
    assert cos.shape == sin.shape == (tokens, rotary_dim), (
        f"tables {tuple(cos.shape)} / {tuple(sin.shape)} for {tokens} tokens")
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, f"rotary_dim {rotary_dim} of head_dim {head_dim}"
    assert qk.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1, "dense along the last axis"
    if tokens == 0:
        return qk
    block_h = block_heads(num_heads, rotary_dim)
    grid = (tokens, triton.cdiv(num_heads, block_h))
    _rotary_kernel[grid](
        qk, cos, sin, qk.stride(0), qk.stride(1), cos.stride(0), sin.stride(0), num_heads,
        HALF=rotary_dim // 2, HALF_PAD=triton.next_power_of_2(rotary_dim // 2), BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return qk

"""Tolerances for comparing floating-point results that two implementations round differently
(another summation order or blocking, FMA or not, a fused kernel, another CPU's vector width).

They follow from the dtype, the length K of the sums and the magnitude of what is summed, never
from what one machine happens to produce:

- ``tolerances``: one chain of sums of products (a matmul, LoRA's shrink then expand), a
  worst-case bound that holds for every summation order;
- ``logits_atol``: a whole model's logits, where rounding also passes through norms, softmax and
  many layers; there the typical (random-walk) size of a K-term float32 sum's rounding, with a
  safety factor.
"""

from __future__ import annotations

import math

import torch


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def magnitude(t: torch.Tensor) -> float:
    """The largest |t|, NaN (poison the tests put where nothing may be written) ignored."""
    t = t.float().abs()
    return float(torch.where(t.isnan(), 0.0, t).max())


# Per dtype: rtol for a result that each side rounds once to that dtype (to nearest, or toward zero
# under Triton's interpreter). Each rounding is within one ulp, eps·|y|, of its float32 value, so
# the two results are within 2 ulps of each other. What the float32 sums before that rounding
# differ by is the atol of ``tolerances``.
RTOL = {dtype: 2 * eps(dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32)}


def sum_atol(depth: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """The largest |a - b| between two evaluations, in any order, of the same sums of products
    accumulated in ``dtype``.

    Each is within γ_n·Σ|terms| of the exact value, γ_n = n·u / (1 - n·u), u = eps/2, where n is
    the number of roundings on the longest chain of operations (Higham, Accuracy and Stability of
    Numerical Algorithms, 2nd ed., §3.1 and Lemma 3.3): ``depth`` = K for a K-term dot product,
    K + r + 1 for ``y0 + B @ (A @ x)`` with rank r. ``scale`` is the largest Σ|terms| over the
    elements compared: |x| @ |W|ᵀ for a matmul, |y0| + |B| @ (|A| @ |x|) for a LoRA delta. Note
    the bound is on Σ|terms|, not on |result|: outputs that cancel to near zero (where a fixed
    tight atol fails on some CPUs) get the same absolute bound as the others.
    """
    u = eps(dtype) / 2
    return 2 * depth * u / (1 - depth * u) * scale


def tolerances(dtype: torch.dtype, *, depth: int, scale: float) -> tuple[float, float]:
    """(rtol, atol) for a result in ``dtype`` of sums of products of ``dtype`` operands accumulated in
    float32 (as every LoRA path here accumulates), computed two ways; see ``sum_atol``.

    The atol adds (eps(dtype)/2)²·scale for the Triton expand, which carries its float32 input as a
    high and a low half in ``dtype``, a relative error of at most (eps/2)² (nil for float32).
    """
    return RTOL[dtype], sum_atol(depth, scale) + (eps(dtype) / 2) ** 2 * scale


def rounded_operands_atol(dtype: torch.dtype, *, depth: int, scale: float) -> float:
    """The largest |a - b| between a float32 matmul and the same matmul with both operands rounded
    to ``dtype``, the products summed in float32 and the result rounded to ``dtype``: each rounding is
    within u = eps/2 relatively, so a product is within (1 + u)² - 1 of the exact one and the rounded
    result within (1 + u)³ - 1 = 3u + 3u² + u³, on top of the float32 sums' ``sum_atol``; ``scale`` as
    there."""
    u = eps(dtype) / 2
    return ((1 + u) ** 3 - 1) * scale + sum_atol(depth, scale)


def longest_sum(config, *, rank: int = 0, tokens: int = 0) -> int:
    """K of a decoder (ours or transformers' config): its longest chain of float32 sums, a
    projection's input width plus the rank of a LoRA delta on it, or an attention row over
    ``tokens`` positions."""
    return max(max(config.hidden_size, config.intermediate_size) + rank, tokens)


# σ = eps·sqrt(K)·|logits| is the typical rounding of a K-term float32 sum relative to its size
# (the rounding errors of the partial sums add like a random walk); the largest of the 10⁴–10⁶
# logits a test compares is ~5σ, and a layer chains ~3 sums (qkv -> attention -> o, gate_up ->
# down): 16 ≈ 5 × 3. Layers add their errors like their outputs, into the residual stream, so
# the relative error does not grow with depth. The largest error seen on these tests' models is
# ~3σ (the tiny LoRA model, whose std-0.3 adapters make it the worst conditioned), most are
# under 1σ. Bugs stand far above: scaling one down_proj of the demo model's 30 layers by 1.001
# moves its logits by 3× this bound, a position off by one in a decode step by 2500×.
LOGITS_K = 16


def logits_atol(reduction: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """The largest |a - b| expected between two implementations' logits (or log-probabilities,
    at twice this) of one model in ``dtype``: ``reduction`` is K (``longest_sum``), ``scale`` the
    largest |logit|."""
    return LOGITS_K * eps(dtype) * math.sqrt(reduction) * scale

"""Linear layers on CPU through oneDNN with weights reordered once, for steps of few rows, in the
matmul precision this CPU runs fastest.

A decode step multiplies a few dozen rows by every weight. For such shapes the default CPU
matmul re-lays the weight out on each call; oneDNN can take a weight reordered ahead of time
into its blocked layout ("prepacked"). Measured on a 2-core x86 VM with torch 2.13, float32,
32 rows: the demo model's projections run 1.2–1.5× faster and its 49152-row output projection
2×. Past ~128 rows (prefill) the default path is as fast or faster, so both are kept and the row
count picks one. The reordered copy adds the memory of the weights it covers in float32, half of
it in bfloat16.

The reordered copy may be float32 or bfloat16 (``MatmulPrecision``). On a CPU with native
bfloat16 dot products (AVX512-BF16, AMX) a bfloat16 weight halves the bytes a memory-bound decode
step reads and doubles the products per instruction; elsewhere oneDNN emulates them and they are
slower. Which one a float32 pod uses is measured at start-up (``choose_precision``, called by
``data_plane.pod``), on its model's own weight shapes, not inferred from CPU flags. In bfloat16 the
inputs and weights of these matmuls are rounded to bfloat16 (8 significant bits) and the products
summed in float32, and each output is rounded to bfloat16 once: an output moves from its float32
value by at most about 3·2⁻⁸ of the sum of its products' magnitudes (tests/tolerances.py,
``rounded_operands_atol``). Once chosen, bfloat16 serves the projections at every row count
(prefill too, in chunks), so a token rounds alike in any step. Everything else (norms, attention,
the residual stream, LoRA, and the output head, whose logits and log-probabilities would otherwise
come in steps of 2⁻⁸ of their size) stays float32.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACKED_MAX_ROWS = 128
# oneDNN builds (and keeps) a kernel per input shape, about 0.5 MB each, and the differently sized
# buffers fragment the heap: measured, calling every row count 1..128 on the demo model's five
# weight shapes grew the process by 2 GB. Row counts are therefore padded up to one of these sizes.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class MatmulPrecision(enum.Enum):
    """The precision of a reordered weight copy (and of the rows multiplied by it)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.value)


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's reordered layout serves float32 weights on CPU, where torch was built with it."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def bfloat16_supported() -> bool:
    """Whether this torch's oneDNN runs bfloat16 matmuls on this CPU at all (natively or emulated)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack(weight: torch.Tensor, precision: MatmulPrecision = MatmulPrecision.FLOAT32) -> torch.Tensor:
    """``weight`` [out, in] reordered for oneDNN in ``precision`` (an opaque tensor; ``weight``
    itself is kept for float32 steps of many rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(precision.dtype), 32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``, through ``packed`` when there is one and either ``x`` has few rows or
    ``packed`` is bfloat16 (then in chunks of few rows); in ``x``'s dtype whatever the precision of
    ``packed``."""
    rows = x.shape[0]
    if packed is None or x.dim() != 2 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if rows > PACKED_MAX_ROWS:
        if packed.dtype == x.dtype:
            return F.linear(x, weight, bias)
        # A bfloat16 copy serves every row count, in chunks of bucketed sizes, so that a token's
        # projections round alike whether its step is a small decode or a long prefill.
        return torch.cat([linear(chunk, weight, bias, packed) for chunk in x.split(PACKED_MAX_ROWS)])
    bucket = next(b for b in ROW_BUCKETS if b >= rows)
    if bucket != rows:
        x = torch.cat([x, x.new_zeros(bucket - rows, x.shape[1])])
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]
    out = torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, None, "none", [], "")[:rows].to(x.dtype)
    return out if bias is None else out.add_(bias)


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``choose_precision`` chose, what it measured and why, for the pod's log."""

    precision: MatmulPrecision
    seconds: dict[MatmulPrecision, float]  # measured time of one round over the shapes (empty: not measured)
    reason: str


# bfloat16 is taken only below this fraction of float32's time: it costs accuracy, so a tie keeps float32.
BFLOAT16_MIN_GAIN = 0.9


def choose_precision(weights: Sequence[tuple[torch.Tensor, int]], rows: Sequence[int],
                     timer: Callable[[], float] = time.thread_time, repeats: int = 3) -> PrecisionChoice:
    """The faster precision for reordered copies of ``weights`` ((weight [out, in], how many
    weights of that shape the model has)) in steps of ``rows`` rows, measured on this CPU: each
    weight is packed in both precisions, run once to warm, then ``repeats`` times interleaved per
    row count, timed with ``timer``; a precision's time is the sum over weights and row counts of
    its best run times the weight's count. bfloat16 wins only below ``BFLOAT16_MIN_GAIN`` of
    float32's time. Deterministic given the timings.

    It runs on one torch thread, timed by default in that thread's CPU time: what each precision costs
    in instructions and memory traffic, which other jobs on the machine barely change. Wall time on
    two threads is not: on a loaded 2-core machine it measured bfloat16 at 0.80-1.24x float32 from
    one start-up to the next (one pod of a fleet choosing bfloat16 and its twin float32), this at
    0.61-0.63x."""
    if not bfloat16_supported():
        return PrecisionChoice(MatmulPrecision.FLOAT32, {}, "oneDNN has no bfloat16 matmul on this CPU")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        total = _measure(weights, rows, timer, repeats)
    finally:
        torch.set_num_threads(threads)
    f32, bf16 = total[MatmulPrecision.FLOAT32], total[MatmulPrecision.BFLOAT16]
    faster = bf16 < BFLOAT16_MIN_GAIN * f32
    choice = MatmulPrecision.BFLOAT16 if faster else MatmulPrecision.FLOAT32
    reason = (f"measured bfloat16 at {bf16 / f32:.2f}x float32's time" if f32 > 0
              else "no time measured for float32")
    return PrecisionChoice(choice, total, reason)


def _measure(weights: Sequence[tuple[torch.Tensor, int]], rows: Sequence[int], timer: Callable[[], float],
             repeats: int) -> dict[MatmulPrecision, float]:
    total = dict.fromkeys(MatmulPrecision, 0.0)
    for weight, count in weights:
        packs = {p: prepack(weight, p) for p in MatmulPrecision}
        for n in rows:
            x = torch.randn(n, weight.shape[1], generator=torch.Generator().manual_seed(n))
            best = dict.fromkeys(MatmulPrecision, math.inf)
            for pk in packs.values():
                linear(x, weight, None, pk)
            for _ in range(repeats):  # interleaved, so that a burst of load falls on both
                for p, pk in packs.items():
                    started = timer()
                    linear(x, weight, None, pk)
                    best[p] = min(best[p], timer() - started)
            for p in MatmulPrecision:
                total[p] += best[p] * count
    return total

"""Linear layers on CPU in fixed row tiles or one padded call, through oneDNN with weights reordered once.

Batch invariance. A matmul library chooses its kernel, and with it the order in which each output's
products are summed, from the shape of the call and the threads it has. Measured with torch 2.13
(oneDNN 3.12, MKL 2024.2) on a 2-core Xeon with AVX512-BF16 and AMX, on the demo model's weight
shapes: in float32 a row multiplied alone by the down projection (K = 1536) sums differently than
in a call of 2 or more rows, and MKL's plain matmul (which served steps of over 128 rows) differs
from oneDNN's at every row count; in bfloat16 the 3072-wide gate/up projection and the output head
round some rows differently past 32 rows (oneDNN switches to AMX kernels). So a row's result
depended on how many rows shared its step. Here every call has one shape: ``x`` is cut into tiles
of exactly ``CpuWeight.rows`` rows, the last one padded with zeros, so oneDNN runs one kernel for
every step, and within a tile a row's result depends neither on its position nor on the other rows
(checked at every position, every shape). A token's projections are then the same bits in a decode
step of 1 or 32 rows and in any prefill chunk. Where oneDNN's float32 kernel gives a row the same bits
in a call of any multiple of a few rows (on a 2-core Xeon with AMX: every multiple of 4, up to 1024
rows), one call over all rows padded to that multiple (``CpuWeight.whole``) keeps them as well and costs
less: a prefill chunk is one call, not one per tile, and a lone decode row pads 3 rows, not 15. Which of
the two holds, and with how many rows, is measured on the pod's own CPU at start-up (``row_rule``).

Speed. oneDNN takes a weight reordered ahead of time into its blocked layout ("prepacked"): for
the few rows of a decode step it runs the demo model's projections and its 49152-row output head
faster than a plain matmul, which re-lays the weight out on each call (benchmarks/history/serving-cpu.md,
"CPU fast paths"). Larger tiles
cost little per row for prefill and more for small decode steps, whose padding rows are computed
too; ``ROW_TILES`` holds the compromise measured per precision (benchmarks/RESULTS.md, "Batch
invariance"). The reordered copy adds the memory of the weights it covers in their precision.

Precision. The copy may take its operands in float32, bfloat16 or float16 (``pack``). In bfloat16
for a float32 model (``Precision.BFLOAT16_MATMUL``) the inputs and weights are rounded to bfloat16
(8 significant bits) and the products summed in float32, and each output is rounded to bfloat16
once: it moves from its float32 value by at most about 3·2⁻⁸ of the sum of its products' magnitudes
(tests/tolerances.py, ``rounded_operands_atol``). Whether a float32 pod on ``--dtype auto`` takes
it is measured at start-up (``choose_precision``, called by ``data_plane.pod``), on its model's own
weight shapes, not inferred from CPU flags: on a CPU with native bfloat16 dot products (AVX512-BF16,
AMX) it halves the bytes a memory-bound decode step reads; elsewhere oneDNN emulates it, slower.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from data_plane.model import amx_linear
from data_plane.model.precision import Precision

# The row tile of each operand dtype. float32 decode steps are compute-bound on the padding rows,
# so its tile is smaller; bfloat16 kernels run a 32-row tile in about the time of one row.
ROW_TILES = {torch.float32: 16, torch.bfloat16: 32, torch.float16: 32}


@dataclass(frozen=True)
class CpuWeight:
    """A weight prepared for fixed-tile CPU matmuls (``pack``)."""

    weight: torch.Tensor  # oneDNN's reordered copy (opaque) where ``reordered``, else the plain [out, in] in dtype
    dtype: torch.dtype  # the precision of the operands; inputs are rounded to it
    rows: int  # the row tile: every call multiplies exactly this many rows (``whole``: a multiple of it)
    reordered: bool
    whole: bool = False  # one call over all rows, padded to a multiple of ``rows``, instead of a call per tile
    ragged: bool = False  # the last tile holds the rows left over, unpadded (calls of up to ``rows`` rows)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` in ``x``'s dtype, in tiles of ``rows`` rows (``whole``: in one call, padded
        to a multiple of them; ``ragged``: the last tile unpadded) with operands in ``dtype``, so that each row's
        result depends on that row alone where the CPU's probe found it so (``row_rule``). ``weight`` is the
        plain weight this copy was made of (its bias is added in float32 where the operands are bfloat16)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        fused_bias = bias if bias is not None and bias.dtype == self.dtype else None
        out = self._product(x.to(self.dtype), fused_bias).to(x.dtype)
        if bias is not None and fused_bias is None:  # bfloat16 operands for float32 rows: the bias in float32
            out = out.add_(bias)
        return out.reshape(*shape[:-1], out.shape[-1])

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` in ``dtype`` for ``x`` in ``dtype``, in this copy's tiles."""
        rows, tile = x.shape[0], self.rows
        if rows % tile and not self.ragged:
            x = torch.cat([x, x.new_zeros(tile - rows % tile, x.shape[1])])
        if self.whole or x.shape[0] <= tile:
            return self._tile(x, bias)[:rows]
        return torch.cat([self._tile(t, bias) for t in x.split(tile)])[:rows]

    def _tile(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.reordered:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


@dataclass(frozen=True)
class AmxWeight(CpuWeight):
    """A bfloat16 weight in the AMX kernel's tiles (``amx_linear``): every call one call over all its rows,
    each row's bits its own; the product summed in float32 and rounded to bfloat16 once, as oneDNN's."""

    outs: int = 0  # the weight's rows: the product's width

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return amx_linear.matmul(x, self.weight, self.outs, bias)


def onednn_serves(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN reorders weights and runs matmuls in ``dtype`` on this CPU (natively or
    emulated)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def bfloat16_supported() -> bool:
    """Whether this torch's oneDNN runs bfloat16 matmuls on this CPU at all (natively or emulated)."""
    return onednn_serves(torch.bfloat16)


def pack(weight: torch.Tensor, dtype: torch.dtype | None = None, rows: int | None = None,
         whole: bool = False, ragged: bool = False, native: bool = False) -> CpuWeight:
    """``weight`` [out, in] ready for ``linear`` with operands in ``dtype`` (default: the weight's) in tiles
    of ``rows`` rows (default: ``ROW_TILES[dtype]``; with ``ragged`` the last one unpadded), or with
    ``whole`` in one call over all rows padded to a multiple of ``rows``: reordered by oneDNN where it serves
    ``dtype``, else kept plain (then each call runs a plain matmul, only slower). With ``native``: in the AMX
    kernel's tiles, one call over any rows (``amx_linear``; bfloat16 where ``amx_linear.unusable`` is "")."""
    dtype = dtype or weight.dtype
    if native:
        if reason := amx_linear.unusable(dtype):
            raise ValueError(reason)
        return AmxWeight(amx_linear.pack(weight), dtype, amx_linear.TILE_ROWS, False, True, outs=weight.shape[0])
    rows = rows or ROW_TILES[dtype]
    if onednn_serves(dtype):
        return CpuWeight(torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), rows), dtype, rows, True, whole,
                         ragged)
    return CpuWeight(weight.to(dtype).contiguous(), dtype, rows, False, whole, ragged)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: CpuWeight | None) -> torch.Tensor:
    """``x @ weight.T + bias``: through ``packed`` where given (a CPU weight's fixed-tile copy), else one
    plain matmul."""
    return F.linear(x, weight, bias) if packed is None else packed(x, weight, bias)


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``choose_precision`` chose, what it measured and why, for the pod's log."""

    precision: Precision
    seconds: dict[Precision, float]  # measured time of one round over the shapes (empty: not measured)
    reason: str


# bfloat16 projections are taken only below this fraction of float32's time: they cost accuracy, so a
# tie keeps float32.
BFLOAT16_MIN_GAIN = 0.9
_CANDIDATES = (Precision.FLOAT32, Precision.BFLOAT16_MATMUL)


def choose_precision(weights: Sequence[tuple[torch.Tensor, int]], rows: Sequence[int],
                     timer: Callable[[], float] = time.thread_time, repeats: int = 3) -> PrecisionChoice:
    """The faster of float32 and bfloat16 projections (``Precision.FLOAT32``, ``BFLOAT16_MATMUL``) for
    float32 ``weights`` ((weight [out, in], how many weights of that shape the model has)) in steps of
    ``rows`` rows, measured on this CPU: each weight is packed for both, run once to warm, then
    ``repeats`` times interleaved per row count, timed with ``timer``; a precision's time is the sum
    over weights and row counts of its best run times the weight's count. bfloat16 wins only below
    ``BFLOAT16_MIN_GAIN`` of float32's time. Deterministic given the timings.

    It runs on one torch thread, timed by default in that thread's CPU time: what each precision costs
    in instructions and memory traffic, which other jobs on the machine barely change. Wall time on
    two threads is not: on a loaded 2-core machine it measured bfloat16 at 0.80-1.24x float32 from
    one start-up to the next (one pod of a fleet choosing bfloat16 and its twin float32), this at
    0.61-0.63x."""
    if not bfloat16_supported():
        return PrecisionChoice(Precision.FLOAT32, {}, "oneDNN has no bfloat16 matmul on this CPU")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        total = _measure(weights, rows, timer, repeats)
    finally:
        torch.set_num_threads(threads)
    f32, bf16 = total[Precision.FLOAT32], total[Precision.BFLOAT16_MATMUL]
    faster = bf16 < BFLOAT16_MIN_GAIN * f32
    choice = Precision.BFLOAT16_MATMUL if faster else Precision.FLOAT32
    reason = (f"measured bfloat16 projections at {bf16 / f32:.2f}x float32's time" if f32 > 0
              else "no time measured for float32")
    return PrecisionChoice(choice, total, reason)


def _measure(weights: Sequence[tuple[torch.Tensor, int]], rows: Sequence[int], timer: Callable[[], float],
             repeats: int) -> dict[Precision, float]:
    total = dict.fromkeys(_CANDIDATES, 0.0)
    for weight, count in weights:
        # each as a pod would run it: bfloat16 through the AMX kernel where it serves
        packs = {p: pack(weight, p.matmul_dtype, native=not amx_linear.unusable(p.matmul_dtype)) for p in _CANDIDATES}
        for n in rows:
            x = torch.randn(n, weight.shape[1], generator=torch.Generator().manual_seed(n))
            best = dict.fromkeys(_CANDIDATES, math.inf)
            for pk in packs.values():
                linear(x, weight, None, pk)
            for _ in range(repeats):  # interleaved, so that a burst of load falls on both
                for p, pk in packs.items():
                    started = timer()
                    linear(x, weight, None, pk)
                    best[p] = min(best[p], timer() - started)
            for p in _CANDIDATES:
                total[p] += best[p] * count
    return total

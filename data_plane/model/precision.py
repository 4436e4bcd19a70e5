"""The precision a pod computes in: what ``--dtype`` names, what GetState, the metrics and the log report.

A precision says in which dtype the weights and activations are held and in which the projection
matmuls take their operands. Every CPU matmul runs in fixed row tiles (``cpu_linear``) and attention
in fixed key tiles (``tiled_attention``), so in each precision a request's tokens and log-probabilities
do not depend on what else shares its step.
"""

from __future__ import annotations

import enum

import torch

from conventions import defaults


class Precision(enum.Enum):
    """How a pod computes. The value is the ``--dtype`` spelling."""

    FLOAT32 = "float32"  # everything in float32
    BFLOAT16 = "bfloat16"  # weights, activations, KV cache and matmuls in bfloat16 (attention sums in float32)
    FLOAT16 = "float16"  # as bfloat16, in float16; CUDA only
    # float32 weights, activations, KV cache, attention, LoRA and output head; the projection matmuls round
    # their operands to bfloat16 and their outputs to bfloat16, summing products in float32. CPU only: on
    # CPUs with native bfloat16 dot products (AVX512-BF16, AMX) the projections run up to ~2x faster.
    BFLOAT16_MATMUL = "bfloat16-matmul"

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype of the weights, the activations and the KV cache."""
        return torch.float32 if self in (Precision.FLOAT32, Precision.BFLOAT16_MATMUL) else getattr(torch, self.value)

    @property
    def matmul_dtype(self) -> torch.dtype:
        """The dtype the projection matmuls take their operands in."""
        return torch.bfloat16 if self is Precision.BFLOAT16_MATMUL else self.weights_dtype

    @classmethod
    def of(cls, weights: torch.dtype, matmul: torch.dtype) -> Precision:
        """The precision whose weights and projection operands have these dtypes."""
        for p in cls:
            if (p.weights_dtype, p.matmul_dtype) == (weights, matmul):
                return p
        raise ValueError(f"no precision has {weights} weights and {matmul} matmuls")


AUTO = "auto"
DTYPE_CHOICES = defaults.DTYPES  # what --dtype accepts: AUTO, then every precision's value


def check_dtype(setting: str, device: str) -> None:
    """Raises ValueError, saying what to name instead, for a ``--dtype`` that is unknown or that
    ``device`` does not run."""
    if setting not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, not {setting!r}")
    if setting == Precision.BFLOAT16_MATMUL.value and device != "cpu":
        raise ValueError("--dtype bfloat16-matmul is a CPU precision; on cuda name bfloat16 (or auto)")
    if setting == Precision.FLOAT16.value and device == "cpu":
        raise ValueError("--dtype float16 runs on cuda only; on cpu name float32, bfloat16 or bfloat16-matmul "
                         "(or auto)")


def load_dtype(setting: str, device: str) -> torch.dtype:
    """The dtype to load the weights in for ``--dtype setting`` on ``device``: auto loads float32 on CPU,
    where the projections' precision is measured next, and bfloat16 on CUDA."""
    if setting == AUTO:
        return torch.float32 if device == "cpu" else torch.bfloat16
    return Precision(setting).weights_dtype

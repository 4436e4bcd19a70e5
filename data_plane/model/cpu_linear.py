"""Linear layers on CPU through oneDNN with weights reordered once, for steps of few rows.

A decode step multiplies a few dozen rows by every weight. For such shapes the default CPU
matmul re-lays the weight out on each call; oneDNN can take a weight reordered ahead of time
into its blocked layout ("prepacked"). Measured on a 2-core x86 VM with torch 2.13, float32,
32 rows: the demo model's projections run 1.2–1.5× faster and its 49152-row output projection
2×. Past ~128 rows (prefill) the default path is as fast or faster, so both are kept and the row
count picks one. The reordered copy doubles the memory of the weights it covers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_MAX_ROWS = 128
# oneDNN builds (and keeps) a kernel per input shape, about 0.5 MB each, and the differently sized
# buffers fragment the heap: measured, calling every row count 1..128 on the demo model's five
# weight shapes grew the process by 2 GB. Row counts are therefore padded up to one of these sizes.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's reordered layout serves float32 weights on CPU, where torch was built with it."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered for oneDNN (an opaque tensor; ``weight`` itself is kept)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``, through ``packed`` when there is one and ``x`` has few rows."""
    rows = x.shape[0]
    if packed is None or x.dim() != 2 or rows > PACKED_MAX_ROWS or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    bucket = next(b for b in ROW_BUCKETS if b >= rows)
    if bucket != rows:
        x = torch.cat([x, x.new_zeros(bucket - rows, x.shape[1])])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]

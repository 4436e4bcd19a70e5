"""bfloat16 projections on CPUs with AMX tiles, through our own kernel (``kernels/native/amx_linear.cpp``):
one call over any number of rows, each row's result summed in an order fixed by the row alone.

oneDNN runs a bfloat16 matmul of up to 32 rows in one kernel and of more rows in its AMX kernels, which
sum a row otherwise, so a batch-invariant pod had to cut prompt chunks into 32-row calls of the slower
kernel (``cpu_linear``'s tiles). Here every call takes the tile instruction for every row, in the same
order: a decode row and a prompt chunk's rows get the same bits, and a chunk costs one call
(benchmarks/RESULTS.md, "bfloat16 projections in AMX tiles", has its speed beside oneDNN's).

Used where the kernel builds with the tile instructions and the process may use them (``unusable``), and
the start-up probe finds a row's bits its own (``row_rule``); elsewhere oneDNN's tiles stay.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels import native_build

LIBRARY = "amx_linear"
TILE_ROWS, TILE_OUTS, TILE_K = 16, 16, 32  # as the source: rows, outputs and inputs of a tile

_P = ctypes.c_void_p
_I = ctypes.c_int


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it does not build here (``native_build.why_not(LIBRARY)``)."""
    lib = native_build.library(LIBRARY)
    if lib is not None and lib.amx_linear.argtypes is None:
        lib.amx_pack.argtypes = [_P, _I, _I, _P]
        lib.amx_pack.restype = None
        lib.amx_linear.argtypes = [_P, _I, _I, _P, _I, _P, _P, _I]
        lib.amx_linear.restype = _I
        lib.amx_linear_available.restype = _I
    return lib


def unusable(dtype: torch.dtype) -> str:
    """Why the kernel cannot run projections with operands in ``dtype`` here ("" where it can)."""
    if dtype != torch.bfloat16:
        return f"the AMX kernel takes bfloat16 operands, not {dtype}"
    lib = kernel()
    if lib is None:
        return f"the AMX kernel did not build: {native_build.why_not(LIBRARY)}"
    if not lib.amx_linear_available():
        return "this CPU or its kernel gives no AMX bfloat16 tiles (amx_tile, amx_bf16) to the process"
    return ""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in bfloat16 laid out in the kernel's tiles, its inputs padded with zeros to a
    multiple of 32 and its outputs to a multiple of 16."""
    outs, ins = weight.shape
    w = F.pad(weight.to(torch.bfloat16), (0, -ins % TILE_K)).contiguous()
    packed = torch.empty(-(-outs // TILE_OUTS) * TILE_OUTS * w.shape[1], dtype=torch.bfloat16)
    kernel().amx_pack(w.data_ptr(), outs, w.shape[1], packed.data_ptr())
    return packed


def matmul(x: torch.Tensor, packed: torch.Tensor, outs: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [rows, in] bfloat16 times the weight ``pack`` made of [outs, in], transposed, plus ``bias``
    [outs] (any float dtype, added in float32), rounded once to bfloat16: [rows, outs], on this thread's
    torch threads."""
    rows, ins = x.shape
    if ins % TILE_K or rows % TILE_ROWS:
        x = F.pad(x, (0, -ins % TILE_K, 0, -rows % TILE_ROWS))
    x = x.contiguous()
    bias = None if bias is None else bias.float().contiguous()
    out = torch.empty(rows, outs, dtype=torch.bfloat16)
    failed = kernel().amx_linear(x.data_ptr(), rows, x.shape[1], packed.data_ptr(), outs,
                                 None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if failed:
        raise RuntimeError("the AMX kernel refused its call (no tiles for this process)")
    return out

"""The CPU attention backend that reads the paged KV cache in place: one C++ call per layer
(``kernels/native/paged_attention.cpp``) for every new token of a step, decodes and prompt chunks
alike, each query over its own sequence's keys through its block table.

Gathering a step's contexts first (``torch_attention``) copies every key and value the step reads
before any matmul reads them again, at about the machine's copy bandwidth (benchmarks/RESULTS.md, "CPU
attention in place"). Here each key and value is read once, where it lies, and used by all the query
rows of its key/value head. A row's sums run in an order fixed by the
row alone (the source says how), so a query's output is the same bits as a decode, as a token of a
prompt chunk of any length, and beside any other sequences, on any CPU: nothing depends on a library's
choice of kernel by shape, which is what ``row_rule`` has to probe for the tiled path.

Used where the kernel builds on the machine and supports the cache (float32, bfloat16, float16 or e4m3 rows,
the last times their layer's scale; a head dimension that is a multiple of the build's vector width, 16
floats with AVX-512, 8 with AVX2); elsewhere ``attention_backends`` keeps tiled attention. The kernel trusts
the engine's block tables: a sequence reads only blocks it owns, checked against the table's width here.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from data_plane.model.attention import KV_FP8, AttentionInputs, write_kv
from kernels import native_build

LIBRARY = "paged_attention"
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, KV_FP8: 3}

_P = ctypes.c_void_p
_I = ctypes.c_int
_F = ctypes.c_float


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it does not build here (``native_build.why_not(LIBRARY)``)."""
    lib = native_build.library(LIBRARY)
    if lib is not None and lib.paged_attention.argtypes is None:
        lib.paged_attention.argtypes = [_P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I, _I, _I, _F, _F, _P, _I, _F, _F]
        lib.paged_attention.restype = _I
    return lib


def unusable(cache_dtype: torch.dtype, head_dim: int) -> str:
    """Why the kernel cannot serve a cache of ``cache_dtype`` rows of ``head_dim`` here ("" where it can)."""
    lib = kernel()
    if lib is None:
        return f"the native attention kernel did not build: {native_build.why_not(LIBRARY)}"
    if cache_dtype not in CACHE_TYPES:
        return f"the native attention kernel reads no {cache_dtype} cache"
    width = lib.paged_attention_width()
    if head_dim % width:
        return f"the native attention kernel takes heads of a multiple of {width} here, not {head_dim}"
    return ""


@dataclass(frozen=True)
class NativeStep:
    """One step's sequences as the kernel reads them; called by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot that receives each new token
    query_start: torch.Tensor  # [seqs + 1] int32
    context: torch.Tensor  # [seqs] int32, context length after the step (0: padding)
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, contiguous
    block_size: int
    lib: ctypes.CDLL

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, window: int | None, scale: float, softcap: float | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        write_kv(k_cache, self.slot_mapping, k, k_scale)
        write_kv(v_cache, self.slot_mapping, v, v_scale)
        num_tokens, heads, head_dim = q.shape
        q32 = q.float().contiguous() if q.dtype != torch.float32 or not q.is_contiguous() else q
        out = torch.zeros(num_tokens, heads * head_dim)  # rows of no sequence (a padded step's) stay zero
        failed = self.lib.paged_attention(
            q32.data_ptr(), heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(), CACHE_TYPES[k_cache.dtype],
            k_cache.shape[1], self.query_start.data_ptr(), self.context.data_ptr(), self.context.shape[0],
            self.block_tables.data_ptr(), self.block_tables.shape[1], self.block_size, window or 0, scale,
            softcap or 0.0, out.data_ptr(), torch.get_num_threads(), k_scale, v_scale)
        if failed == 2:
            raise ValueError("a sequence of the step has more new tokens than context")
        if failed:
            raise ValueError(f"the native attention kernel does not take {heads} heads of {head_dim} over "
                             f"{k_cache.shape[1]} key/value heads in {k_cache.dtype}")
        return out if q.dtype == torch.float32 else out.to(q.dtype)


class NativeAttention:
    """The backend: ``prepare`` turns a step's inputs into the kernel's arrays once per step."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def prepare(self, inputs: AttentionInputs) -> NativeStep:
        tables = inputs.block_tables.to(torch.int32).contiguous()
        context = inputs.seq_lens.to(torch.int32).contiguous()
        starts = inputs.query_start.to(torch.int32).contiguous()
        longest = int(context.max()) if context.numel() else 0
        if longest > tables.shape[1] * inputs.block_size:
            raise ValueError(f"a sequence needs {longest} slots but its block table holds "
                             f"{tables.shape[1]} blocks of {inputs.block_size}")
        return NativeStep(inputs.slot_mapping, starts, context, tables, inputs.block_size, self.lib)

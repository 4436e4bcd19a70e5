"""Both kernels compile for NVIDIA GPUs as the launchers run them there, checked without a GPU.

Under the interpreter every dot runs in float32, so the tensor-core path (dots in fp16/bf16,
what a GPU runs) is only exercised by compiling it: this catches type errors and layouts the
interpreter accepts but the compiler does not.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import lora_expand as expand_module
from kernels import lora_shrink as shrink_module

MAX_RANK = 64


def _compile_for(arch: int, kernel, pointers: dict[str, str], constexprs: dict[str, object]) -> None:
    """Compile ``kernel`` for an NVIDIA GPU of compute capability ``arch`` (no GPU needed), with
    the 16-byte alignment torch gives its allocations, and feature sizes and row strides
    divisible by 16 as in Llama-family layers."""
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in kernel.arg_names}
    aligned = {*pointers, "in_features", "out_features", "stride_xm", "stride_ym", "stride_bs", "stride_bm"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in aligned}
    source = ASTSource(kernel, signature, constexprs, attrs)
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def compile_gpu_code_path() -> None:
    """Compile both kernels with the launchers' default tiles for decode and prefill, for A100-
    and H100-class targets. Needs the interpreter off: run in a fresh process."""
    ints = ("ranks_ptr", "sorted_tokens_ptr", "seg_slots_ptr", "seg_starts_ptr", "slice_offsets_ptr")
    pointers = {n: "*i32" for n in ints} | {"buf_ptr": "*fp32"}
    # fp32 weights (no tensor cores, slowest to compile) only with decode tiles.
    configs = [(arch, "bf16", n) for arch in (80, 90) for n in (8, 4096)] + [(80, "fp32", 8), (90, "fp32", 8)]
    for arch, dtype, num_tokens in configs:
        tiles = shrink_module.default_tiles(num_tokens, MAX_RANK)
        shrink = {"x_ptr": f"*{dtype}", "lora_a_ptr": f"*{dtype}"} | pointers
        _compile_for(arch, shrink_module._lora_shrink_kernel, shrink, {
            "SEG_BLOCK": 64, "MAX_RANK": MAX_RANK, "RANK_TILES": MAX_RANK // tiles.n,
            "BLOCK_M": tiles.m, "BLOCK_R": tiles.n, "BLOCK_K": tiles.k, "UPCAST": False,
        })  # fmt: skip
        tiles = expand_module.default_tiles(num_tokens, MAX_RANK)
        expand = {"y_ptr": "*fp16", "lora_b_ptr": f"*{dtype}"} | pointers
        _compile_for(arch, expand_module._lora_expand_kernel, expand, {
            "SEG_BLOCK": 64, "NUM_SLICES": 3, "MAX_RANK": MAX_RANK, "RANK_ALIGN": 8,
            "BLOCK_M": tiles.m, "BLOCK_N": tiles.n, "BLOCK_K": tiles.k, "UPCAST": False,
        })  # fmt: skip


@pytest.mark.slow  # a child process
def test_gpu_code_path_compiles_without_a_gpu():
    # The interpreter patches triton.language while it runs and is chosen when a kernel is
    # defined, so the compile happens in a child process with the interpreter off.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.kernels.test_gpu_compile import compile_gpu_code_path; compile_gpu_code_path()"
    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]

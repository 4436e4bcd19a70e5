"""The Triton kernels compile for NVIDIA GPUs as the launchers run them there, checked without a GPU,
and fit the targets: no register spills, shared memory within each target's limit.

Under the interpreter every dot runs in float32, so the tensor-core path (dots in fp16/bf16, what a
GPU runs) is only exercised by compiling it: this catches type errors and layouts the interpreter
accepts but the compiler does not. Registers and spills come from the ptxas that ships in the
Triton wheel (``ptxas -v`` on each kernel's PTX), shared memory from the compiled kernel's metadata.

``python -m tests.kernels.test_gpu_compile`` prints the figures as a table (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import attention_launch, attention_unified, fused_activation, fused_norm, fused_rotary
from kernels import lora_expand as expand_module
from kernels import lora_fused as fused_module
from kernels import lora_shrink as shrink_module

MAX_RANK = 64
ARCHS = (80, 90)
# Shared memory one block may use (opt-in maximum): A100 163 KiB, H100 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
# Llama-3-8B's attention: 32 query heads on 8 kv heads.
NUM_KV_HEADS, GROUP = 8, 4
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@dataclass(frozen=True)
class Compiled:
    kernel: str
    arch: int
    dtype: str
    config: str  # what the launcher chose the tiles for
    registers: int  # per thread
    spills: int  # bytes of spill stores and loads
    shared: int  # bytes


def _compile_for(arch: int, kernel, types: dict[str, str], constexprs: dict[str, object], aligned: set[str],
                 num_warps: int, num_stages: int = 3):  # fmt: skip
    """Compile ``kernel`` for an NVIDIA GPU of compute capability ``arch`` (no GPU needed). Pointers
    get the 16-byte alignment torch gives its allocations; ``aligned`` ints (feature sizes, row
    strides) are divisible by 16 as in Llama-family layers; other arguments are i32."""
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in kernel.arg_names}
    divisible = {n for n, t in types.items() if t.startswith("*")} | aligned
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in divisible}
    source = ASTSource(kernel, signature, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers, spill bytes) that ptxas reports for the kernel in ``ptx``, compiled for the
    target the PTX names (sm_90a where it uses Hopper-only instructions)."""
    target = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.MULTILINE).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([str(PTXAS), "-v", "--gpu-name", target, str(path), "-o", str(path.with_suffix(".o"))],
                              capture_output=True, text=True, check=True)  # fmt: skip
    report = done.stdout + done.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return registers, spills


def _record(name: str, arch: int, dtype: str, config: str, compiled) -> Compiled:
    registers, spills = _ptxas_report(compiled.asm["ptx"])
    return Compiled(name, arch, dtype, config, registers, spills, compiled.metadata.shared)


def _lora_kernels(arch: int) -> list[Compiled]:
    """Shrink and expand with the launchers' default tiles (one set for every step), as a decode step
    runs them (8 tokens: the shrink split one program per chunk, the expand walking 4 column tiles, a
    tuned table's option) and a prefill step (4096: one program walks the chunks); fp32 weights (no
    tensor cores, slowest to compile) only as a decode step."""
    ints = ("ranks_ptr", "sorted_tokens_ptr", "seg_slots_ptr", "seg_starts_ptr", "slice_offsets_ptr", "counters_ptr")
    pointers = {n: "*i32" for n in ints} | {"buf_ptr": "*fp32", "part_ptr": "*fp32"}
    aligned = {"in_features", "out_features", "stride_xm", "stride_ym", "stride_bs", "stride_bm", "stride_pc"}
    rows = []
    for dtype, num_tokens in (("bf16", 8), ("bf16", 4096), ("fp32", 8)):
        tiles = shrink_module.default_tiles(TORCH_DTYPES[dtype])
        split = num_tokens <= shrink_module.SPLIT_TOKENS
        config = (f"{num_tokens} tokens, rank {MAX_RANK}; tiles {tiles.m}x{tiles.n}x{tiles.k}, chunk {tiles.chunk}"
                  + (", split" if split else ""))
        shrink = _compile_for(arch, shrink_module._lora_shrink_kernel, {"x_ptr": f"*{dtype}", "lora_a_ptr": f"*{dtype}"}
                              | pointers, {
            "SEG_BLOCK": 64, "MAX_RANK": MAX_RANK, "RANK_TILES": MAX_RANK // tiles.n,
            "BLOCK_M": tiles.m, "BLOCK_R": tiles.n, "BLOCK_K": tiles.k, "CHUNK": tiles.chunk, "SPLIT": split,
            "UPCAST": False,
        }, aligned, tiles.num_warps)  # fmt: skip
        rows.append(_record("lora_shrink", arch, dtype, config, shrink))
        tiles = expand_module.default_tiles(MAX_RANK)
        expand = _compile_for(arch, expand_module._lora_expand_kernel, {"y_ptr": "*fp16", "lora_b_ptr": f"*{dtype}"}
                              | pointers, {
            "SEG_BLOCK": 64, "NUM_SLICES": 3, "MAX_RANK": MAX_RANK, "RANK_ALIGN": 8,
            "BLOCK_M": tiles.m, "BLOCK_N": tiles.n, "BLOCK_K": tiles.k, "COL_TILES": 4 if split else 1,
            "UPCAST": False,
        }, aligned, tiles.num_warps)  # fmt: skip
        config = f"{num_tokens} tokens, rank {MAX_RANK}; tiles {tiles.m}x{tiles.n}x{tiles.k}" + (
            ", 4 column tiles a program" if split else "")
        rows.append(_record("lora_expand", arch, dtype, config, expand))
    return rows + _lora_fused_kernels(arch, pointers, aligned)


def _lora_fused_kernels(arch: int, pointers: dict[str, str], aligned: set[str]) -> list[Compiled]:
    """The fused shrink + expand with every tile shape a tuned table may name (``lora_fused.candidates``;
    of the column-group widths, the widest per column tile: the most unrolled), at the largest rank it
    holds, over three slices (q/k/v)."""
    rows = []
    for dtype in ("bf16", "fp32"):
        shapes: dict[tuple[int, int, int], object] = {}
        for tiles in fused_module.candidates(fused_module.MAX_FUSED_RANK, TORCH_DTYPES[dtype]):
            key = (tiles.n, tiles.k, tiles.num_warps)
            if key not in shapes or tiles.col_tiles > shapes[key].col_tiles:
                shapes[key] = tiles
        for tiles in shapes.values():
            rank = fused_module.MAX_FUSED_RANK
            kernel = _compile_for(arch, fused_module._lora_fused_kernel, {
                "y_ptr": "*fp16", "x_ptr": f"*{dtype}", "lora_a_ptr": f"*{dtype}", "lora_b_ptr": f"*{dtype}",
            } | pointers, {
                "SEG_BLOCK": 64, "NUM_SLICES": 3, "MAX_RANK": rank, "RANK_ALIGN": 8,
                "BLOCK_R": fused_module.rank_block(rank), "BLOCK_M": tiles.m, "BLOCK_N": tiles.n, "BLOCK_K": tiles.k,
                "COL_TILES": tiles.col_tiles, "UPCAST": False,
            }, aligned, tiles.num_warps)  # fmt: skip
            config = (f"rank {rank}, 3 slices; tiles {tiles.m}x{tiles.n}x{tiles.k}, {tiles.col_tiles} column tiles "
                      f"a program, {tiles.num_warps} warps")
            rows.append(_record("lora_fused", arch, dtype, config, kernel))
    return rows


def _fused_kernels(arch: int) -> list[Compiled]:
    """The fused layer ops as the CUDA path launches them: residual add + RMSNorm (Llama-3-8B's hidden 4096,
    Gemma 2 9B's 3584 with its ``1 + weight`` scaling, a plain norm), rotary on 32 + 8 heads of 128 (all of
    it, and Phi-4-mini's 96 of 128; Gemma's heads of 256) and the gated activations."""
    rows = []
    for dtype in ("bf16", "fp16", "fp32"):
        for hidden, residual, offset in ((4096, True, False), (3584, True, True), (4096, False, False)):
            kernel = _compile_for(arch, fused_norm._add_rms_norm_kernel, {
                n: f"*{dtype}" for n in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr")
            } | {"eps": "fp32", "offset": "fp32"}, {
                "HAS_RESIDUAL": residual, "OFFSET_SCALE": offset, "BLOCK": triton.next_power_of_2(hidden),
            }, {"stride_x", "stride_r", "stride_o", "hidden"}, fused_norm.num_warps(hidden))  # fmt: skip
            config = f"hidden {hidden}" + (", residual add" if residual else "") + (", 1 + weight" if offset else "")
            rows.append(_record("add_rms_norm", arch, dtype, config, kernel))
        for heads, head_dim, rotary_dim in ((40, 128, 128), (40, 128, 96), (12, 256, 256)):
            block_h = fused_rotary.block_heads(heads, rotary_dim)
            kernel = _compile_for(arch, fused_rotary._rotary_kernel, {
                n: f"*{dtype}" for n in ("qk_ptr", "cos_ptr", "sin_ptr")
            }, {
                "HALF": rotary_dim // 2, "HALF_PAD": triton.next_power_of_2(rotary_dim // 2), "BLOCK_H": block_h,
            }, {"stride_qt", "stride_qh", "stride_ct", "stride_st"}, 4)  # fmt: skip
            rows.append(_record("rotary", arch, dtype, f"{heads} heads of {head_dim}, rotary_dim {rotary_dim}, "
                                                       f"{block_h} heads a program", kernel))
        for activation in fused_activation.ACTIVATIONS:
            kernel = _compile_for(arch, fused_activation._act_mul_kernel, {
                n: f"*{dtype}" for n in ("gate_up_ptr", "out_ptr")
            }, {"ACT": activation, "BLOCK": fused_activation.BLOCK}, {"stride_g", "stride_o", "width"}, 4)
            rows.append(_record("act_mul", arch, dtype, f"{activation}, {fused_activation.BLOCK} columns a program",
                                kernel))
    return rows


def _attention_kernels(arch: int, dtype: str, head_dim: int, windowed: bool, softcap: bool = False,
                       kv_fp8: bool = False) -> list[Compiled]:
    """The unified attention kernel (decode splits, their merge and prefill blocks in one launch) with
    the launcher's default tiles, for a Llama-3-8B-like GQA group (4 query heads a kv head, 8 kv heads)
    and KV block size 16; ``softcap``: Gemma 2's soft-capped scores; ``kv_fp8``: an FP8 (e4m3) KV cache."""
    data = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    if kv_fp8:
        data |= {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}
    ints = {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "counters_ptr")}
    parts = {n: "*fp32" for n in ("part_max_ptr", "part_sum_ptr", "part_acc_ptr")}
    types = data | ints | parts | {"qk_scale": "fp32", "cap": "fp32", "k_scale": "fp32", "v_scale": "fp32"}
    aligned = {"stride_qt", "stride_qh", "stride_ot", "stride_oh"}
    shape = f"head_dim {head_dim}, {GROUP * NUM_KV_HEADS}/{NUM_KV_HEADS} heads, block 16"
    shape += ", window" if windowed else ""
    shape += ", soft-capped" if softcap else ""
    shape += ", FP8 KV cache" if kv_fp8 else ""
    tiles = attention_unified.default_tiles(head_dim, TORCH_DTYPES[dtype])
    config = (f"{shape}; prefill {tiles.block_m} rows x {tiles.block_n} keys, decode {tiles.decode_block_n}-key "
              f"tiles in {tiles.min_split}+-key splits (at most {tiles.max_splits}), {tiles.num_warps} warps")
    unified = _compile_for(arch, attention_unified._unified_kernel, types, {
        "SEQ_BLOCK": 64, "NUM_KV_HEADS": NUM_KV_HEADS, "GROUP": GROUP,
        "GROUP_ROWS": attention_launch.group_rows(GROUP), "HEAD_DIM": head_dim,
        "HEAD_PAD": triton.next_power_of_2(head_dim), "BLOCK_SIZE": 16, "BLOCK_M": tiles.block_m,
        "BLOCK_Q": tiles.block_m // GROUP, "BLOCK_N": tiles.block_n, "DECODE_BLOCK_N": tiles.decode_block_n,
        "MIN_SPLIT": tiles.min_split, "MAX_SPLITS": tiles.max_splits, "WINDOWED": windowed, "SOFTCAP": softcap,
        "UPCAST": False, "KV_FP8": kv_fp8,
    }, aligned, tiles.num_warps, tiles.num_stages)  # fmt: skip
    return [_record("attention_unified", arch, dtype, config, unified)]


def compiled_kernels() -> list[Compiled]:
    """Every kernel as its launcher runs it on a GPU, compiled for A100- and H100-class targets.
    Needs the interpreter off: run in a fresh process."""
    rows = []
    for arch in ARCHS:
        rows += _lora_kernels(arch)
        rows += _fused_kernels(arch)
        for dtype, head_dim, windowed in itertools.product(("bf16", "fp16", "fp32"), (128, 64), (False, True)):
            rows += _attention_kernels(arch, dtype, head_dim, windowed)
        # Gemma 2 and 3: head_dim 256, sliding layers beside global ones, Gemma 2's scores soft-capped.
        for dtype, windowed in itertools.product(("bf16", "fp32"), (False, True)):
            rows += _attention_kernels(arch, dtype, 256, windowed, softcap=True)
        # Phi-3-mini and Phi-3.5-mini: head_dim 96, tiles of 128 columns with the last 32 masked.
        for dtype in ("bf16", "fp32"):
            rows += _attention_kernels(arch, dtype, 96, windowed=True)
    # An FP8 KV cache (--kv-cache-dtype fp8): e4m3 conversions need sm_89+, so H100-class only.
    for dtype, head_dim, windowed in itertools.product(("bf16", "fp16"), (128, 64), (False, True)):
        rows += _attention_kernels(90, dtype, head_dim, windowed, kv_fp8=True)
    return rows


def table(rows: list[Compiled]) -> str:
    """A markdown table, one line per kernel and configuration with sm_80 and sm_90 side by side
    (registers / spill bytes / shared bytes); dtypes with the same figures share a line. Sliding-
    window variants of a listed configuration are left out (the test checks them too)."""
    figures: dict[tuple[str, str, str], dict[int, tuple[int, int, int]]] = {}
    unwindowed = {(r.kernel, r.config, r.dtype) for r in rows if "window" not in r.config}
    for r in rows:
        if "window" in r.config and (r.kernel, r.config.replace(", window", ""), r.dtype) in unwindowed:
            continue
        figures.setdefault((r.kernel, r.config, r.dtype), {})[r.arch] = (r.registers, r.spills, r.shared)
    lines: dict[tuple, list[str]] = {}  # (kernel, config, figures) -> dtypes
    for (kernel, config, dtype), by_arch in figures.items():
        lines.setdefault((kernel, config, tuple(by_arch.get(a) for a in ARCHS)), []).append(dtype)
    out = [
        "| kernel | dtype | configuration | "
        + " | ".join(f"sm_{a}: registers / spills / shared" for a in ARCHS)
        + " |",
        "|---|---|---|" + "---|" * len(ARCHS),
    ]
    for (kernel, config, by_arch), dtypes in lines.items():
        cells = " | ".join("-" if f is None else f"{f[0]} / {f[1]} / {f[2]}" for f in by_arch)
        out.append(f"| {kernel} | {', '.join(dtypes)} | {config} | {cells} |")
    return "\n".join(out)


@pytest.mark.slow  # a child process
def test_kernels_compile_for_sm80_and_sm90_without_spills_and_within_shared_memory():
    # The interpreter patches triton.language while it runs and is chosen when a kernel is
    # defined, so the compile happens in a child process with the interpreter off.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "tests.kernels.test_gpu_compile", "--json"], cwd=root, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [Compiled(**row) for row in json.loads(done.stdout)]
    kernels = {r.kernel for r in rows}
    assert {"lora_shrink", "lora_expand", "lora_fused", "attention_unified"} <= kernels
    assert {r.arch for r in rows} == set(ARCHS)
    assert {"add_rms_norm", "rotary", "act_mul"} <= kernels
    for r in rows:
        assert r.spills == 0, f"{r} spills registers"
        assert 0 < r.registers <= 255, r
        assert r.shared <= SHARED_LIMIT[r.arch], f"{r} needs more shared memory than sm_{r.arch} has"


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    compiled = compiled_kernels()
    if sys.argv[1:] == ["--json"]:
        print(json.dumps([dataclasses.asdict(r) for r in compiled]))
    else:
        print(f"triton {triton.__version__}, ptxas {PTXAS.relative_to(pathlib.Path(triton.__file__).parent)}")
        print(table(compiled))

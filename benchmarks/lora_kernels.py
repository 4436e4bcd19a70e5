"""Multi-adapter LoRA kernels (shrink + expand) at Llama-3-8B shapes, on one CUDA GPU.

For each layer, rank, number of distinct adapters and token count it prints one markdown row:
the median time (CUDA events, L2 flushed before every run) of Triton shrink+expand, of the
base layer's GEMM on the same tokens, of the same two kernels replayed from a CUDA graph
(decode sizes), and of the plain torch reference (``kernels.reference``); the bytes and FLOPs
the LoRA ops must move and do, as GB/s and TFLOP/s and as a share of ceilings measured on this
GPU in the same run (a large device-to-device copy, a large bf16 matmul). Each row is first
checked against the reference. Tokens go round-robin over the adapters, all of the given rank.

Bytes counted: x and y (read + write) once, A and B of the adapters in use once, buf written
and read once. FLOPs counted: 2 * tokens * rank * (S * in + out); expand's fp16/bf16 path
issues twice that for its own part (buf is carried as two halves, see kernels/lora_expand.py).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import torch

from kernels import reference
from kernels.lora_expand import lora_expand
from kernels.lora_meta import LoraMetaBuilder
from kernels.lora_shrink import lora_shrink

LAYERS = {  # name: (in_features, output slice widths)
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DECODE_MAX_TOKENS = 256  # CUDA-graph replay is timed up to this many tokens


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


class Timer:
    """Median of CUDA-event timings, with L2 flushed before every timed run."""

    def __init__(self, iters: int, warmup: int) -> None:
        self.iters, self.warmup = iters, warmup
        self._flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # > L2 of any current GPU

    def ms(self, fn, iters: int | None = None) -> float:
        for _ in range(self.warmup):
            fn()
        events = []
        for _ in range(iters or self.iters):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def ceilings(timer: Timer) -> tuple[float, float]:
    """(GB/s of a 1 GiB device copy counting read + write, TFLOP/s of an 8192^3 bf16 matmul)."""
    src = torch.empty(2**30, dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = timer.ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(a)
    mm_ms = timer.ms(lambda: torch.matmul(a, b, out=out))
    return 2 * src.numel() / copy_ms / 1e6, 2 * 8192**3 / mm_ms / 1e9


def bench_row(timer, layer, rank, adapters, tokens, dtype, ref_iters):
    """(LoRA ms, graph ms or None, reference ms, GB/s, TFLOP/s) of one configuration."""
    in_features, widths = LAYERS[layer]
    num_slices, out_features = len(widths), sum(widths)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    dev, e = "cuda", torch.tensor([], dtype=dtype).element_size()
    lora_a = (torch.randn(num_slices, adapters, rank, in_features, device=dev) / in_features**0.5).to(dtype)
    lora_b = (torch.randn(adapters, out_features, rank, device=dev) / rank**0.5).to(dtype)
    ranks = torch.full((num_slices, adapters), rank, dtype=torch.int32, device=dev)
    host_ranks = ranks.tolist()
    slice_offsets = torch.tensor(offsets, dtype=torch.int32, device=dev)
    # As in the layers: buf is a [S, tokens, rank] view of the step metadata's scratch buffer.
    builder = LoraMetaBuilder(tokens, adapters, dev, max_rank=rank, max_slices=num_slices)
    meta = builder.build([t % adapters for t in range(tokens)])
    x = torch.randn(tokens, in_features, device=dev, dtype=dtype)
    y = torch.zeros(tokens, out_features, device=dev, dtype=dtype)
    y_ref = torch.zeros_like(y)
    buf = meta.buffer[:num_slices, :tokens]  # [S, tokens, rank] float32
    buf_ref = torch.empty_like(buf)

    def triton_ops():
        lora_shrink(x, lora_a, ranks, meta, buf)
        lora_expand(y, buf, lora_b, ranks, slice_offsets, meta)

    def torch_ops():
        reference.lora_shrink(x, lora_a, ranks, meta, buf_ref, host_ranks)
        reference.lora_expand(y_ref, buf_ref, lora_b, ranks, offsets, meta, host_ranks)

    triton_ops()
    torch_ops()
    torch.testing.assert_close(y, y_ref, rtol=1.6e-2, atol=1e-2)

    lora_ms = timer.ms(triton_ops)
    graph_ms = None
    if tokens <= DECODE_MAX_TOKENS:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_ops()
        graph_ms = timer.ms(graph.replay)
    ref_ms = timer.ms(torch_ops, iters=ref_iters)

    used = min(adapters, tokens)
    moved = e * tokens * (in_features + 2 * out_features)  # x read, y read and written
    moved += e * used * rank * (num_slices * in_features + out_features)  # A and B in use
    moved += 4 * 2 * num_slices * tokens * rank  # buf written and read
    flops = 2 * tokens * rank * (num_slices * in_features + out_features)
    return lora_ms, graph_ms, ref_ms, moved / lora_ms / 1e6, flops / lora_ms / 1e9


def base_gemm_ms(timer: Timer, layer: str, tokens: int, dtype: torch.dtype) -> float:
    in_features, widths = LAYERS[layer]
    w = torch.randn(sum(widths), in_features, device="cuda", dtype=dtype)  # [out, in], as nn.Linear
    x = torch.randn(tokens, in_features, device="cuda", dtype=dtype)
    return timer.ms(lambda: torch.matmul(x, w.T))


def _layers(text: str) -> list[str]:
    layers = text.split(",")
    unknown = sorted(set(layers) - set(LAYERS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown layers {unknown}; choose from {list(LAYERS)}")
    return layers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--layers", type=_layers, default=list(LAYERS), help=f"comma-separated, of {','.join(LAYERS)}")
    parser.add_argument("--ranks", type=_ints, default=[8, 16, 64])
    parser.add_argument("--adapters", type=_ints, default=[1, 8, 64], help="distinct adapters in the batch")
    parser.add_argument("--tokens", type=_ints, default=[1, 8, 64, 256, 4096, 16384])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--ref-iters", type=int, default=5, help="timed runs of the slow torch reference")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(
            "benchmarks/lora_kernels.py needs a CUDA GPU and torch sees none "
            "(torch.cuda.is_available() is False); the kernels' CPU tests are in tests/kernels."
        )
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    timer = Timer(args.iters, warmup=3)

    peak_gbs, peak_tflops = ceilings(timer)
    print(f"# LoRA kernels on {torch.cuda.get_device_name()}, {args.dtype}, torch {torch.__version__}\n")
    print(f"Ceilings measured in this run: copy {peak_gbs:.0f} GB/s, "
          f"bf16 matmul {peak_tflops:.0f} TFLOP/s.\n")  # fmt: skip
    print(
        "| layer | rank | adapters | tokens | base GEMM µs | LoRA µs | LoRA / base | LoRA graph µs "
        "| torch ref µs | ref / LoRA | GB/s | % copy | TFLOP/s | % matmul |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layer, tokens in itertools.product(args.layers, args.tokens):
        base_ms = base_gemm_ms(timer, layer, tokens, dtype)
        for rank, adapters in itertools.product(args.ranks, args.adapters):
            lora_ms, graph_ms, ref_ms, gbs, tflops = bench_row(timer, layer, rank, adapters, tokens, dtype,
                                                               args.ref_iters)  # fmt: skip
            cells = [
                layer, rank, adapters, tokens,
                f"{base_ms * 1e3:.1f}", f"{lora_ms * 1e3:.1f}", f"{lora_ms / base_ms:.2f}",
                "-" if graph_ms is None else f"{graph_ms * 1e3:.1f}",
                f"{ref_ms * 1e3:.1f}", f"{ref_ms / lora_ms:.1f}",
                f"{gbs:.0f}", f"{100 * gbs / peak_gbs:.0f}",
                f"{tflops:.1f}", f"{100 * tflops / peak_tflops:.0f}",
            ]  # fmt: skip
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

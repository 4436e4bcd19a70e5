"""The CPU LoRA path alone, per step: the native kernel (kernels/native_lora.py) against the torch path's row
tiles (kernels/cpu_lora.py) over the demo model's LoRA layers (30 layers of qkv, o, gate_up and down;
hidden 576, intermediate 1536, 3 of 9 heads per key/value head, head dim 64), slots of serve.py's mix of
ranks (8, 8, 8, 16; random weights), steps of ``--rows`` rows spread round-robin over the base model and
the four adapters (sorted by slot, as the model runner orders them), or all of one adapter (``--one``).

One thread, timed in its CPU time (which other jobs on a shared machine barely change); the fastest of
``--repeats`` steps after one warm step. Prints one markdown row per step size.

    PYTHONPATH=.:protos python benchmarks/lora_layers.py [--rows 8 32 128 512] [--one] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from processes import cpu_flags, cpu_model, load_average  # benchmarks/processes.py

from kernels import cpu_lora, native_lora
from kernels.lora_backend import intra_op_threads
from kernels.lora_meta import LoraMetaBuilder

LAYERS = 30
SHAPES = {"qkv": (576, (576, 192, 192)), "o": (576, (576,)), "gate_up": (576, (1536, 1536)), "down": (1536, (576,))}
RANKS = (8, 8, 8, 16)  # slots 0-3; the other slots of --max-loras 8 are empty
MAX_LORAS, MAX_RANK = 8, 64


def layer(in_features: int, outs: tuple[int, ...], gen: torch.Generator):
    """One layer's slots packed for each path: (torch pack, native table, out_features)."""
    lora_a = torch.randn(len(outs), MAX_LORAS, MAX_RANK, in_features, generator=gen) * 0.05
    lora_b = torch.randn(MAX_LORAS, sum(outs), MAX_RANK, generator=gen) * 0.05
    ranks = [[RANKS[slot] if slot < len(RANKS) else 0 for slot in range(MAX_LORAS)] for _ in outs]
    offsets = [0]
    for out in outs:
        offsets.append(offsets[-1] + out)
    table = native_lora.SlotTable.empty(MAX_LORAS, len(outs))
    for slot in range(MAX_LORAS):
        table.update(lora_a, lora_b, ranks, offsets, slot)
    return cpu_lora.pack_segments(lora_a, lora_b, ranks, offsets), table, offsets[-1]


def step_tiles(layers: dict, xs: dict, ys: dict, meta) -> None:
    """One step's LoRA work by the torch path's tiles, on one thread."""
    with intra_op_threads(1):
        for _ in range(LAYERS):
            for name, (pack, _, _) in layers.items():
                cpu_lora.lora_segmented(ys[name], xs[name], pack, meta)


def step_native(lib, layers: dict, xs: dict, ys: dict, meta) -> None:
    """One step's LoRA work by the native kernel, on one thread."""
    for _ in range(LAYERS):
        for name, (_, table, _) in layers.items():
            native_lora.lora_native(lib, ys[name], xs[name], table, meta, 1)


def fastest(run, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        run()
        best = min(best, time.thread_time() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[8, 32, 128, 512])
    parser.add_argument("--one", action="store_true", help="every row of one adapter")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    lib = native_lora.kernel()
    if lib is None:
        raise SystemExit(native_lora.unusable(torch.float32))
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    layers = {name: layer(*shape, gen) for name, shape in SHAPES.items()}
    print(f"{time.strftime('%Y-%m-%d')}, {cpu_model()} ({cpu_flags()}), torch {torch.__version__}, load average "
          f"{load_average()}; one thread, CPU time, fastest of {args.repeats} steps; rows "
          f"{'of one adapter' if args.one else 'round-robin over the base model and 4 adapters'}\n")
    print("| rows | torch tiles ms | native ms | native / tiles |\n|---|---|---|---|")
    for n in args.rows:
        slots = sorted([0] * n if args.one else [i % (len(RANKS) + 1) - 1 for i in range(n)], key=lambda s: (s < 0, s))
        meta = LoraMetaBuilder(n, MAX_LORAS, "cpu").build(slots)
        xs = {name: torch.randn(n, SHAPES[name][0], generator=gen) for name in SHAPES}
        ys = {name: torch.zeros(n, out) for name, (_, _, out) in layers.items()}

        torch_s = fastest(partial(step_tiles, layers, xs, ys, meta), args.repeats)
        native_s = fastest(partial(step_native, lib, layers, xs, ys, meta), args.repeats)
        print(f"| {n} | {torch_s * 1e3:.1f} | {native_s * 1e3:.1f} | {native_s / torch_s:.2f} |")


if __name__ == "__main__":
    main()

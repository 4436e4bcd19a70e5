"""The split shrink: one program per chunk of in_features, the last to arrive adding the chunks' partial
sums in order (kernels/lora_shrink.py). It must give the bits of one program walking every chunk, so a
row's bits do not depend on the step it is in; and its launch shapes at Llama-3-8B's projections must
give a decode step's few rows many programs, each with a short serial loop.

Under the interpreter programs run one after another, so the order in which chunks arrive is fixed
here; on a GPU, benchmarks/lora_sweep.py replays the split launch 200 times against one program.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest
import torch

from kernels import reference
from kernels.lora_launch import Tiles
from kernels.lora_meta import SPLIT_TOKENS, LoraMeta, LoraMetaBuilder, partial_rows
from kernels.lora_shrink import launch_grid, lora_shrink
from tests.kernels.test_lora_kernels import DEVICE, MAX_RANK, NUM_SLOTS, QKV, SINGLE, Layer, _bits, _mix
from tests.tolerances import magnitude, tolerances

# K steps of 32 in chunks of 64: QKV's 96 features are one full chunk and one half chunk; WIDE's 200,
# three full chunks and one of 8 features.
TILES = Tiles(m=16, n=16, k=32, chunk=64)
WIDE = Layer(200, SINGLE.widths, SINGLE.ranks)


def _inputs(layer: Layer, token_slots: list[int], dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_slices = len(layer.widths)
    x = torch.randn(len(token_slots), layer.in_features, generator=gen).to(DEVICE, dtype)
    lora_a = torch.randn(num_slices, NUM_SLOTS, MAX_RANK, layer.in_features, generator=gen) / layer.in_features**0.5
    ranks = torch.tensor(layer.ranks, dtype=torch.int32, device=DEVICE)
    return x, lora_a.to(DEVICE, dtype), ranks


def _meta(layer: Layer, token_slots: list[int], split: bool) -> LoraMeta:
    rows = partial_rows([(len(layer.widths), layer.in_features)]) if split else 0
    return LoraMetaBuilder(len(token_slots), NUM_SLOTS, DEVICE, max_rank=MAX_RANK, partial_rows=rows).build(token_slots)


def _shrink(x, lora_a, ranks, meta: LoraMeta, tiles: Tiles = TILES) -> torch.Tensor:
    buf = torch.full((lora_a.shape[0], x.shape[0], MAX_RANK), float("nan"), device=DEVICE)  # poisoned
    lora_shrink(x, lora_a, ranks, meta, buf, tiles=tiles)
    return buf


@pytest.mark.parametrize(("layer", "mix", "tokens", "dtype"), [
    (QKV, "distinct", 7, torch.float32), (QKV, "skewed", 40, torch.float16), (WIDE, "zipf", 13, torch.float32),
    (WIDE, "uniform", 3, torch.float16),
])  # fmt: skip
def test_split_shrink_gives_the_bits_of_one_program_and_leaves_its_counters_at_zero(layer, mix, tokens, dtype):
    token_slots = _mix(mix, tokens, random.Random(tokens))
    x, lora_a, ranks = _inputs(layer, token_slots, dtype, seed=tokens)
    split_meta = _meta(layer, token_slots, split=True)
    grid, split = launch_grid(tokens, len(layer.widths), layer.in_features, MAX_RANK, NUM_SLOTS, TILES, split_meta)
    chunks = -(-layer.in_features // TILES.chunk)
    assert split and grid[0] == len(layer.widths) * (MAX_RANK // TILES.n) * chunks  # a program per chunk

    split_buf = _shrink(x, lora_a, ranks, split_meta)
    one_program = _shrink(x, lora_a, ranks, _meta(layer, token_slots, split=False))

    assert torch.equal(_bits(split_buf), _bits(one_program))
    assert not split_meta.counters.any(), "a split launch must leave its arrival counters at zero"
    expected = torch.full_like(split_buf, float("nan"))
    reference.lora_shrink(x, lora_a, ranks, split_meta, expected)
    abs_sums = torch.full_like(split_buf, float("nan"))
    reference.lora_shrink(x.abs(), lora_a.abs(), ranks, split_meta, abs_sums)
    rtol, atol = tolerances(dtype, depth=layer.in_features, scale=magnitude(abs_sums))
    torch.testing.assert_close(split_buf, expected, rtol=rtol, atol=atol, equal_nan=True)


def test_a_rows_bits_are_the_same_alone_beside_others_and_in_a_prefill_sized_step():
    # Row 0 (slot 3) alone, in a split decode step of 40 tokens, and in a step too long to split: the
    # same tiles (one set per shape), so the same sums in the same order.
    layer = QKV
    tokens = SPLIT_TOKENS + 9
    slots = [3, *_mix("uniform", tokens - 1, random.Random(5))]
    x, lora_a, ranks = _inputs(layer, slots, torch.float32, seed=9)
    rows = {}
    for n in (1, 40, tokens):
        meta = _meta(layer, slots[:n], split=True)
        _, split = launch_grid(n, 3, layer.in_features, MAX_RANK, NUM_SLOTS, TILES, meta)
        assert split == (n <= SPLIT_TOKENS)
        rows[n] = _shrink(x[:n], lora_a, ranks, meta)[:, 0]
    assert torch.equal(_bits(rows[1]), _bits(rows[40]))
    assert torch.equal(_bits(rows[1]), _bits(rows[tokens]))


def test_a_step_without_enough_scratch_runs_one_program_per_tile():
    # Metadata built for a narrower layer holds too few partial rows for QKV: the launch falls back.
    slots = [0, 1, 2]
    meta = LoraMetaBuilder(3, NUM_SLOTS, DEVICE, max_rank=MAX_RANK, partial_rows=1).build(slots)
    grid, split = launch_grid(3, 3, QKV.in_features, MAX_RANK, NUM_SLOTS, TILES, meta)
    assert not split and grid[0] == 3 * MAX_RANK // TILES.n
    x, lora_a, ranks = _inputs(QKV, slots, torch.float32, seed=2)
    one_program = _shrink(x, lora_a, ranks, _meta(QKV, slots, split=False))
    assert torch.equal(_bits(_shrink(x, lora_a, ranks, meta)), _bits(one_program))


def test_chunks_are_whole_k_steps_of_at_least_the_smallest_chunk():
    with pytest.raises(ValueError, match="multiple of k"):
        Tiles(m=16, n=16, k=128, chunk=192)
    with pytest.raises(ValueError, match="at least 64"):
        Tiles(m=16, n=16, k=32, chunk=32)
    with pytest.raises(ValueError, match="at least one column tile"):
        Tiles(m=16, n=64, k=16, col_tiles=0)


def test_every_tuned_table_keeps_one_kind_of_tensor_core_instruction():
    # Blocks of 16 rows everywhere (kernels/lora_tuning.py): 64-row blocks would run Hopper's warpgroup
    # MMA, 16-row ones mma.sync, and nothing promises the two sum a row alike.
    from kernels import lora_tuning

    tables = list(lora_tuning.TABLES.glob("*.json"))
    assert tables
    for path in tables:
        for key, tiles in lora_tuning._table(json.loads(path.read_text())["device"]).items():
            assert tiles.m == 16, f"{path.name}: {key} has {tiles.m}-row blocks"


# Llama-3-8B's LoRA projections: (slices, in_features, out_features).
LLAMA3_8B = {"qkv": (3, 4096, 6144), "o": (1, 4096, 4096), "gate_up": (2, 4096, 28672), "down": (1, 14336, 4096)}
H100_SMS = 132


@pytest.mark.parametrize("device_name", ["NVIDIA H200", ""])  # the measured table, and the stated default
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_decode_launches_at_llama3_8b_shapes_keep_serial_loops_short_and_fill_the_gpu_from_64_rows(device_name, tokens):
    # Every token its own rank-16 adapter, as the serving benchmark's 64-adapter mix. Each program's
    # serial loop (shrink: the K steps of its chunk; expand: the rank steps of each slice) is at most 16
    # steps at every batch. From 64 rows on, the programs with work outnumber an H100's SMs. At 1 and 16
    # rows some launches have fewer (the o projection at batch 1: 8 shrink programs): on an H200 the
    # sweep measured fewer, longer chunks faster there (down at batch 1: chunks of 64 features, 224
    # programs, 19.5 us; chunks of 512, 28 programs, 10.4 us): a decode launch of a few rows is bound
    # by its chain of dependent loads, not by programs in flight (benchmarks/RESULTS.md).
    from kernels import lora_expand, lora_shrink, lora_tuning

    rank, dtype = 16, torch.bfloat16
    for name, (slices, in_features, out_features) in LLAMA3_8B.items():
        shrink = (lora_tuning.tuned("shrink", slices, in_features, rank, dtype, device_name)
                  or lora_shrink.default_tiles(dtype))
        expand = (lora_tuning.tuned("expand", slices, out_features, rank, dtype, device_name)
                  or lora_expand.default_tiles(rank))
        meta = dataclasses.make_dataclass("Scratch", ["partials", "counters"])(
            torch.empty(partial_rows([(slices, in_features)]) * SPLIT_TOKENS * rank), torch.empty(1 << 16))
        grid, split = launch_grid(tokens, slices, in_features, rank, 64, shrink, meta)
        assert split, f"{name}: a decode step's shrink must split"
        assert shrink.chunk // shrink.k <= 16, f"{name}: {shrink.chunk // shrink.k} serial K steps in a chunk"
        assert -(-rank // expand.k) <= 16
        busy_shrink = grid[0] * tokens  # one token block per distinct adapter
        busy_expand = -(-out_features // expand.n) * tokens
        if tokens >= 64:
            assert min(busy_shrink, busy_expand) >= H100_SMS, f"{name}: {busy_shrink} / {busy_expand} programs"


# Llama-3-8B's output slices per projection (q/k/v with 8 kv heads of 128, gate/up).
LLAMA3_8B_SLICES = {"qkv": (4096, 1024, 1024), "o": (4096,), "gate_up": (14336, 14336), "down": (4096,)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_launches_at_llama3_8b_shapes_fill_the_gpu_from_64_rows_and_bound_the_recomputed_shrink(dtype):
    # The fused kernel (kernels/lora_fused.py) has no split along in_features: each program walks all of it
    # (in_features / k steps: 32-64 at 4096, 112-224 for the down projection) for each slice its column
    # group meets, and is taken only where a table measured it faster than the split pair (below). For
    # every tile shape a table may name: from 64 rows the programs fill an H100, or else (the widest groups
    # on q/k/v, o and down: 1-2 programs per token block) h is computed at most twice per slice; h is
    # recomputed at most 28 times per slice (gate/up in groups of 512), and some candidate keeps that to
    # at most 4 on every projection (groups of 4,096: q/k/v, o and down 1x, gate/up 4x).
    from kernels import lora_fused, lora_launch, lora_tuning

    rank = 16
    least = dict.fromkeys(LLAMA3_8B, math.inf)
    for tiles in lora_fused.candidates(rank, dtype):
        width = tiles.n * tiles.col_tiles
        assert 512 <= width <= 4096, tiles
        for name, (slices, _, out_features) in LLAMA3_8B.items():
            offsets = [0, *itertools.accumulate(LLAMA3_8B_SLICES[name])]
            assert offsets[-1] == out_features
            grid = lora_launch.column_grid(64, out_features, 64, tiles)
            met = [sum(lo < g * width + width and hi > g * width for lo, hi in itertools.pairwise(offsets))
                   for g in range(grid[0])]
            rework = sum(met) / slices  # h computed per token block and slice; the split pair's: 1
            assert rework <= 28, f"{name} {tiles}: h computed {rework}x"
            assert grid[0] * 64 >= H100_SMS or rework <= 2, f"{name} {tiles}: {grid[0] * 64} programs, {rework}x"
            least[name] = min(least[name], rework)
    assert max(least.values()) <= 4, least
    # Without a table (or with the committed H200 one, measured before the fused kernel) the layers take
    # the split pair at every shape: defaults keep today's kernels.
    for device_name in ("NVIDIA H200", ""):
        for slices, in_features, out_features in LLAMA3_8B.values():
            assert lora_tuning.tuned("fused", slices, in_features, rank, torch.bfloat16, device_name,
                                     out_features=out_features) is None

"""Shrink and expand in one launch (kernels/lora_fused.py) agree with ``kernels.reference`` and write
nothing else, a row's bits do not depend on what shares its step, and the kernel runs only where a
GPU's tuned table chose it for the shape.

Poisoned as in test_lora_kernels.py, and more: the rank padding of A is NaN too (the fused kernel
never writes a ``buf`` that would show a shrink reading past the rank, so the padding must), rows of
base-model tokens and columns of rank-0 slices start as -0.0 and must come back bit-identical.
"""

from __future__ import annotations

import itertools
import random
import zlib

import pytest
import torch

from kernels import lora_fused, lora_tuning, reference
from kernels.lora_backend import LoraSlots, TritonBackend
from kernels.lora_launch import Tiles
from kernels.lora_meta import LoraMetaBuilder
from tests.kernels.test_lora_kernels import (
    DEVICE,
    MAX_RANK,
    NUM_SLOTS,
    QKV,
    SINGLE,
    Y_PAD,
    Layer,
    Problem,
    _assert_untouched,
    _bits,
    _mix,
    _poisoned_y,
    _problem,
)
from tests.tolerances import magnitude, tolerances

# gate/up: two equal slices; slot 1 adapts only up, slot 3 only gate, ranks mixed.
GATE_UP = Layer(80, (56, 56), ((16, 0, 8, 64, 1), (16, 8, 8, 0, 4)))
# GQA-like q/k/v with 8 kv-head columns a slice (q four times as wide), ranks mixed, a rank-0 slice.
GQA = Layer(48, (64, 16, 16), ((8, 16, 64, 1, 0), (8, 0, 64, 4, 16), (8, 16, 64, 2, 16)))
LAYERS = {"qkv": QKV, "gqa": GQA, "gate_up": GATE_UP, "single": SINGLE}
# Tiles under the interpreter: "narrow" gives several column groups and several K steps (groups straddle
# slice edges); "wide" one group over every slice, one K step.
TILES = {"narrow": Tiles(m=16, n=16, k=32, col_tiles=2), "wide": Tiles(m=16, n=128, k=128)}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fused_problem(layer: Layer, token_slots: list[int], dtype: torch.dtype, seed: int) -> Problem:
    p = _problem(layer, token_slots, dtype, seed)
    for s, slot in itertools.product(range(len(layer.widths)), range(NUM_SLOTS)):
        p.lora_a[s, slot, layer.ranks[s][slot]:] = float("nan")  # A past the rank: never to be read
    return p


def _run_fused(p: Problem, dtype: torch.dtype, tiles: Tiles, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y's poisoned storage after the fused launch, before it)."""
    wide0 = _poisoned_y(p, dtype, seed)
    wide = wide0.clone()
    out_features = p.layer.offsets[-1]
    lora_fused.lora_fused(wide[:, :out_features], p.x, p.lora_a, p.lora_b, p.ranks, p.slice_offsets, p.meta, tiles)
    return wide, wide0


def _check_against_reference(p: Problem, dtype: torch.dtype, tiles: Tiles, seed: int) -> None:
    wide, wide0 = _run_fused(p, dtype, tiles, seed)
    out_features = p.layer.offsets[-1]
    num_slices, num_tokens = len(p.layer.widths), len(p.token_slots)
    buf = torch.full((num_slices, num_tokens, MAX_RANK), float("nan"), device=DEVICE)
    reference.lora_shrink(p.x, p.lora_a, p.ranks, p.meta, buf)
    expected = wide0.clone()
    reference.lora_expand(expected[:, :out_features], buf, p.lora_b, p.ranks, p.layer.offsets, p.meta)
    # |y0| + |B| @ (|A| @ |x|): what the sums add up in absolute value, over the chain shrink -> expand -> add.
    abs_buf = torch.full_like(buf, float("nan"))
    reference.lora_shrink(p.x.abs(), p.lora_a.abs(), p.ranks, p.meta, abs_buf)
    abs_sums = wide0[:, :out_features].float().abs()
    reference.lora_expand(abs_sums, abs_buf, p.lora_b.abs(), p.ranks, p.layer.offsets, p.meta)
    rtol, atol = tolerances(dtype, depth=p.layer.in_features + MAX_RANK + 1, scale=magnitude(abs_sums))
    torch.testing.assert_close(wide, expected, rtol=rtol, atol=atol)
    _assert_untouched(wide, wide0, p.untouched())


def _cases():
    """Each layer meets every dtype, each token count and mix a few of them: coverage without the product."""
    pairs = list(itertools.product(LAYERS, DTYPES))
    mixes = ("distinct", "uniform", "zipf", "skewed", "identical", "all_base")
    for i, (layer, dtype) in enumerate(pairs):
        tokens = (1, 3, 7, 40)[i % 4]
        mix = mixes[i % len(mixes)] if tokens > 1 or i % len(mixes) != 5 else "uniform"
        tiles = list(TILES)[(i // 2) % 2]
        yield pytest.param(tokens, mix, layer, dtype, tiles,
                           id=f"{tokens}tok-{mix}-{layer}-{str(dtype).removeprefix('torch.')}-{tiles}")


@pytest.mark.parametrize(("num_tokens", "mix", "layer", "dtype", "tiles"), list(_cases()))
def test_fused_matches_reference_and_leaves_base_rows_and_rank_zero_slices_bit_identical(
        num_tokens, mix, layer, dtype, tiles):
    seed = zlib.crc32(f"{num_tokens}-{mix}-{layer}".encode())
    p = _fused_problem(LAYERS[layer], _mix(mix, num_tokens, random.Random(seed)), dtype, seed)
    _check_against_reference(p, dtype, TILES[tiles], seed)


def test_unsorted_tokens_of_mixed_ranks_and_rows_without_an_adapter():
    # Slots interleaved and out of order, base-model rows among them, every rank of GQA's slots.
    token_slots = [2, -1, 0, 3, 2, -1, 1, 4, 0, 3, -1, 2, 4]
    p = _fused_problem(GQA, token_slots, torch.bfloat16, seed=21)
    _check_against_reference(p, torch.bfloat16, TILES["narrow"], seed=21)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_are_the_same_alone_beside_others_and_in_a_prefill_sized_step(dtype):
    # Row 0 (slot 3, rank 64 in every slice) alone, beside 39 others, and in a 300-token step: the same
    # kernel and tiles in every step, so the same sums in the same order.
    layer, tiles = QKV, TILES["narrow"]
    tokens = 300
    slots = [3, *_mix("uniform", tokens - 1, random.Random(8))]
    p = _fused_problem(layer, slots, dtype, seed=4)
    y0 = torch.randn(tokens, layer.offsets[-1], generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    rows = {}
    for n in (1, 40, tokens):
        meta = LoraMetaBuilder(n, NUM_SLOTS, DEVICE, max_rank=MAX_RANK).build(slots[:n])
        y = y0[:n].clone()
        lora_fused.lora_fused(y, p.x[:n], p.lora_a, p.lora_b, p.ranks, p.slice_offsets, meta, tiles)
        rows[n] = y[0]
    assert torch.equal(_bits(rows[1]), _bits(rows[40]))
    assert torch.equal(_bits(rows[1]), _bits(rows[tokens]))
    assert not torch.equal(_bits(rows[1]), _bits(y0[0])), "row 0 has an adapter: it must change"


def test_a_column_group_over_every_slice_gives_the_bits_of_narrow_groups():
    # A column's sum does not depend on which group computes it: one group over all 128 columns and
    # groups of 16 columns (h recomputed by each) give the same bits.
    token_slots = [0, 2, -1, 3, 4, 1, 2]
    p = _fused_problem(QKV, token_slots, torch.float32, seed=13)
    one, _ = _run_fused(p, torch.float32, Tiles(m=16, n=128, k=32), seed=13)
    narrow, _ = _run_fused(p, torch.float32, Tiles(m=16, n=16, k=32), seed=13)
    assert torch.equal(_bits(one), _bits(narrow))


def test_triton_backend_runs_the_fused_kernel_only_where_a_tuned_table_chose_it(monkeypatch):
    token_slots = [1, -1, 3, 0]
    p = _fused_problem(QKV, token_slots, torch.float32, seed=17)
    slots = LoraSlots(p.lora_a, p.lora_b, p.ranks, p.slice_offsets, [list(r) for r in QKV.ranks], QKV.offsets)
    assert TritonBackend(slots).fused is None, "without a table (a CPU, or a GPU never measured): the split pair"
    # A GPU whose table holds a fused entry for this shape: the backend takes it, and computes the delta.
    key = lora_tuning.entry_key("fused", 3, QKV.in_features, MAX_RANK, torch.float32, out_features=QKV.offsets[-1])
    monkeypatch.setattr(lora_tuning, "_device_name", lambda device: "test gpu")
    monkeypatch.setattr(lora_tuning, "_table", lambda name: {key: TILES["narrow"]} if name == "test gpu" else {})
    backend = TritonBackend(slots)
    assert backend.fused == TILES["narrow"]
    wide0 = _poisoned_y(p, torch.float32, seed=17)
    wide = wide0.clone()
    backend.apply(wide[:, : QKV.offsets[-1]], p.x, p.meta)
    expected, _ = _run_fused(p, torch.float32, TILES["narrow"], seed=17)
    assert torch.equal(_bits(wide), _bits(expected))
    # Another shape (rank 16 slots), or a rank past the bound: the split pair.
    assert lora_fused.fused_tiles(p.lora_a[:, :, :16].contiguous(), p.lora_b[:, :, :16].contiguous()) is None
    big = torch.empty(3, NUM_SLOTS, 128, QKV.in_features)
    assert lora_fused.fused_tiles(big, torch.empty(NUM_SLOTS, QKV.offsets[-1], 128)) is None


def test_fused_launcher_rejects_what_it_cannot_run():
    p = _fused_problem(QKV, [0, 1, -1], torch.float16, seed=3)
    y = torch.zeros(3, QKV.offsets[-1] + Y_PAD, dtype=torch.float16, device=DEVICE)[:, : QKV.offsets[-1]]
    run = lambda **kw: lora_fused.lora_fused(**{"y": y, "x": p.x, "lora_a": p.lora_a, "lora_b": p.lora_b,  # noqa: E731
                                                "ranks": p.ranks, "slice_offsets": p.slice_offsets, "meta": p.meta,
                                                "tiles": TILES["narrow"], **kw})
    with pytest.raises(ValueError, match="x and lora_a must share one dtype"):
        run(x=p.x.float())
    with pytest.raises(ValueError, match="y must be"):
        run(y=y[:, :-1])
    with pytest.raises(ValueError, match="slice_offsets must be an int32 tensor"):
        run(slice_offsets=QKV.offsets)
    with pytest.raises(ValueError, match="meta was built for 3 tokens"):
        run(x=p.x[:2], y=y[:2])
    with pytest.raises(ValueError, match="holds ranks up to 64"):
        run(lora_a=torch.zeros(3, NUM_SLOTS, 128, QKV.in_features, dtype=torch.float16),
            lora_b=torch.zeros(NUM_SLOTS, QKV.offsets[-1], 128, dtype=torch.float16))

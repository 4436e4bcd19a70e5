"""The CPU LoRA path agrees with the reference's shrink + expand, gives a row the same bits whatever
shares its step, and follows slot changes one slot at a time."""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest
import torch

from kernels import reference
from kernels.cpu_lora import ROW_TILE, SHRINK_COLUMNS, lora_segmented, pack_segments, update_slot
from kernels.lora_backend import intra_op_threads
from kernels.lora_meta import LoraMetaBuilder
from tests.kernels.test_lora_kernels import LAYERS, MIXES, QKV, Layer, _mix, _problem
from tests.tolerances import magnitude, tolerances

DTYPES = (torch.float32, torch.bfloat16)
# gate_up-like, two slices of one width; slot 1 adapts neither, slot 4 only the first.
GATE_UP = Layer(48, (40, 40), ((4, 0, 8, 16, 2), (4, 0, 8, 16, 0)))
CPU_LAYERS = {**LAYERS, "gate_up": GATE_UP}


def _segmented(y, p) -> None:
    with intra_op_threads(1):
        lora_segmented(y, p.x, pack_segments(p.lora_a, p.lora_b, p.ranks.tolist(), p.layer.offsets), p.meta)


def _reference(p, y: torch.Tensor) -> torch.Tensor:
    buf = p.meta.buffer[: len(p.layer.widths), : len(p.token_slots)]
    reference.lora_shrink(p.x, p.lora_a, p.ranks, p.meta, buf)
    out = y.clone()
    reference.lora_expand(out, buf, p.lora_b, p.ranks, p.layer.offsets, p.meta)
    return out


def _tolerances(p, y: torch.Tensor, rows=slice(None)) -> tuple[float, float]:
    """(rtol, atol) for ``y`` + the LoRA delta of ``p`` against the reference: the reference run on
    absolute values gives |y| + |B| @ (|A| @ |x|), what each element's sums add up to."""
    abs_sums = _reference(dataclasses.replace(p, x=p.x.abs(), lora_a=p.lora_a.abs(), lora_b=p.lora_b.abs()),
                          y.float().abs())
    depth = p.layer.in_features + max(max(r) for r in p.layer.ranks) + 1  # shrink, expand, the add to y
    return tolerances(p.x.dtype, depth=depth, scale=magnitude(abs_sums[rows]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layer", list(CPU_LAYERS))
@pytest.mark.parametrize("mix", MIXES)
def test_the_cpu_path_matches_the_reference_for_every_mix(mix, layer, dtype):
    seed = zlib.crc32(f"segmented-{mix}-{layer}".encode())
    p = _problem(CPU_LAYERS[layer], _mix(mix, 21, random.Random(seed)), dtype, seed)
    y = torch.randn(len(p.token_slots), p.layer.offsets[-1], generator=torch.Generator().manual_seed(seed)).to(dtype)
    expected = _reference(p, y)
    rtol, atol = _tolerances(p, y)

    _segmented(y, p)

    torch.testing.assert_close(y, expected, rtol=rtol, atol=atol)
    base_rows = [t for t, slot in enumerate(p.token_slots) if slot < 0]
    assert torch.equal(y[base_rows], expected[base_rows]), "rows without an adapter changed"


def _delta_of_row(x: torch.Tensor, slots: list[int], row: int, packed, out_features: int) -> torch.Tensor:
    meta = LoraMetaBuilder(256, 5, "cpu", max_rank=64).build(slots)
    y = torch.zeros(len(slots), out_features)
    with intra_op_threads(1):
        lora_segmented(y, x, packed, meta)
    return y[row]


@pytest.mark.parametrize("layer", list(CPU_LAYERS))
def test_a_rows_delta_is_the_same_bits_whatever_shares_its_step(layer):
    layer = CPU_LAYERS[layer]
    p = _problem(layer, [3] * 8, torch.float32, seed=11)
    packed = pack_segments(p.lora_a, p.lora_b, p.ranks.tolist(), layer.offsets)
    gen = torch.Generator().manual_seed(12)
    mine = torch.randn(layer.in_features, generator=gen)
    alone = _delta_of_row(mine[None], [3], 0, packed, layer.offsets[-1])
    assert alone.abs().max() > 0
    rng = random.Random(13)
    for others in (1, ROW_TILE - 1, ROW_TILE, 2 * ROW_TILE + 3, 150):
        for mix in ("identical", "uniform", "distinct"):
            slots = _mix(mix, others + 1, rng)
            at = rng.randrange(others + 1)
            slots[at] = 3
            if mix != "identical":
                slots.sort()  # the model runner's order: each adapter's rows one run
                at = slots.index(3) + rng.randrange(slots.count(3))
            x = torch.randn(others + 1, layer.in_features, generator=gen)
            x[at] = mine
            got = _delta_of_row(x, slots, at, packed, layer.offsets[-1])
            assert torch.equal(got, alone), (others, mix)


def test_a_segment_gathered_from_scattered_rows_gives_the_bits_of_one_run():
    p = _problem(QKV, [1] * 4, torch.float32, seed=14)
    packed = pack_segments(p.lora_a, p.lora_b, p.ranks.tolist(), QKV.offsets)
    x = torch.randn(ROW_TILE + 5, QKV.in_features, generator=torch.Generator().manual_seed(15))
    base = [-1] * (ROW_TILE + 1)
    run = _delta_of_row(x, [1, 1, 1, 1, *base], 2, packed, QKV.offsets[-1])  # one run, read in place
    scattered = _delta_of_row(x, [1, -1, 1, 1, 1, *base[1:]], 2, packed, QKV.offsets[-1])  # not one run: indexed
    assert torch.equal(run, scattered)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_delta_is_the_same_bits_at_every_place_in_its_tile(dtype):
    # a lone row of slot 2 at each row of a step of 2 * ROW_TILE: read in place, its tile is the step's
    # last ROW_TILE rows once it is among them, so it sits at each place of the tile in turn; alone (a
    # padded copy) it starts the tile
    p = _problem(GATE_UP, [2], dtype, seed=18)
    packed = pack_segments(p.lora_a, p.lora_b, p.ranks.tolist(), GATE_UP.offsets)
    gen = torch.Generator().manual_seed(19)
    mine = torch.randn(GATE_UP.in_features, generator=gen).to(dtype)
    alone = _delta_of_row(mine[None], [2], 0, packed, GATE_UP.offsets[-1])
    for at in range(2 * ROW_TILE):
        x = torch.randn(2 * ROW_TILE, GATE_UP.in_features, generator=gen).to(dtype)
        x[at] = mine
        slots = [-1] * (2 * ROW_TILE)
        slots[at] = 2
        assert torch.equal(_delta_of_row(x, slots, at, packed, GATE_UP.offsets[-1]), alone), at


def test_an_overflowing_adapter_does_not_reach_other_rows():
    token_slots = [3, 0, -1, 1, 3]
    p = _problem(QKV, token_slots, torch.float32, seed=9)
    p.lora_a[:, 3] *= 1e38
    y = torch.zeros(len(token_slots), QKV.offsets[-1])

    _segmented(y, p)

    assert torch.isfinite(y[[1, 2, 3]]).all()
    expected = _reference(p, torch.zeros_like(y))
    rtol, atol = _tolerances(p, torch.zeros_like(y), rows=[1, 2, 3])
    torch.testing.assert_close(y[[1, 2, 3]], expected[[1, 2, 3]], rtol=rtol, atol=atol)


def test_the_pack_holds_real_ranks_only_and_each_adapted_slice_on_its_own():
    p = _problem(QKV, [0, 1], torch.float32, seed=2)
    ranks = p.ranks.tolist()
    packed = pack_segments(p.lora_a, p.lora_b, ranks, QKV.offsets)
    assert sorted(packed.slots) == [slot for slot in range(5) if any(ranks[s][slot] for s in range(3))]
    for slot, ps in packed.slots.items():
        adapted = [s for s in range(3) if ranks[s][slot]]
        real = sum(ranks[s][slot] for s in adapted)
        assert ps.a.shape == (max(real, SHRINK_COLUMNS), QKV.in_features)
        assert not ps.a[real:].any(), "rows past the ranks are zero (the shrink's columns are never fewer)"
        assert [(sl.lo, sl.hi) for sl in ps.slices] == [(QKV.offsets[s], QKV.offsets[s + 1]) for s in adapted]
        c = 0
        for s, sl in zip(adapted, ps.slices, strict=True):
            r, (lo, hi) = ranks[s][slot], (QKV.offsets[s], QKV.offsets[s + 1])
            assert (sl.first, sl.last) == (c, c + r)
            assert not sl.b.isnan().any(), "rank padding of B (NaN in this problem) was packed"
            assert torch.equal(ps.a[c : c + r], p.lora_a[s, slot, :r])
            assert torch.equal(sl.b, p.lora_b[slot, lo:hi, :r])
            c += r


def test_slices_a_slot_does_not_adapt_are_left_as_they_are():
    # Slot 4 of GATE_UP adapts the first slice only: the second keeps its bits, -0.0 and NaN included.
    p = _problem(GATE_UP, [4, 4, 4], torch.float32, seed=6)
    y = torch.randn(3, GATE_UP.offsets[-1], generator=torch.Generator().manual_seed(7))
    lo = GATE_UP.offsets[1]
    y[0, lo] = -0.0
    y[1, lo + 1] = float("nan")
    before = y.clone()

    _segmented(y, p)

    assert torch.equal(y[:, lo:].view(torch.int32), before[:, lo:].view(torch.int32))
    assert not torch.equal(y[:, :lo], before[:, :lo])


def test_a_run_read_in_place_among_its_neighbours_gives_the_bits_of_a_padded_copy():
    # A run of 3 rows of slot 2 in a step of 20: read in place, its tile is completed by its
    # neighbours' rows (before it when it ends the step). The same rows alone in a step are padded
    # with zero rows.
    p = _problem(QKV, [2] * 3, torch.float32, seed=16)
    packed = pack_segments(p.lora_a, p.lora_b, p.ranks.tolist(), QKV.offsets)
    gen = torch.Generator().manual_seed(17)
    mine = torch.randn(3, QKV.in_features, generator=gen)
    alone = [_delta_of_row(mine, [2, 2, 2], k, packed, QKV.offsets[-1]) for k in range(3)]
    for at in (0, 5, ROW_TILE - 1, 17):
        slots = [-1] * at + [2] * 3 + [0] * (17 - at)
        x = torch.randn(20, QKV.in_features, generator=gen)
        x[at : at + 3] = mine
        for k in range(3):
            assert torch.equal(_delta_of_row(x, slots, at + k, packed, QKV.offsets[-1]), alone[k]), (at, k)


def test_a_changed_slot_is_repacked_alone_and_an_emptied_one_dropped():
    p = _problem(QKV, [0, 1], torch.float32, seed=4)
    ranks = p.ranks.tolist()
    packed = pack_segments(p.lora_a, p.lora_b, ranks, QKV.offsets)
    untouched = packed.slots[0]
    gen = torch.Generator().manual_seed(5)
    ranks[0][1], ranks[1][1], ranks[2][1] = 2, 0, 0  # slot 1: another adapter, rank 2 on q only
    p.lora_a[0, 1, :2] = torch.randn(2, QKV.in_features, generator=gen)
    p.lora_b[1, :, :2] = torch.randn(QKV.offsets[-1], 2, generator=gen)
    update_slot(packed, p.lora_a, p.lora_b, ranks, QKV.offsets, 1)
    fresh = pack_segments(p.lora_a, p.lora_b, ranks, QKV.offsets)
    assert torch.equal(packed.slots[1].a, fresh.slots[1].a)
    assert [(sl.lo, sl.hi, sl.first, sl.last) for sl in packed.slots[1].slices] == [(0, QKV.offsets[1], 0, 2)]
    assert torch.equal(packed.slots[1].slices[0].b, fresh.slots[1].slices[0].b)
    assert packed.slots[0] is untouched, "an unchanged slot was repacked"
    ranks[0][1] = 0
    update_slot(packed, p.lora_a, p.lora_b, ranks, QKV.offsets, 1)
    assert 1 not in packed.slots

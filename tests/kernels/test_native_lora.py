"""The native CPU LoRA kernel (kernels/native/lora.cpp, compiled here at first use) against the reference's
shrink + expand for every adapter mix, layer and dtype; a row's delta the same bits whatever shares its
step (other rows, other adapters, its place in its segment, the segment's length, threads); rows and slices
it must not touch kept to the bit; and a layer's backend that follows slot changes, falls back to the torch
path's tiles where told, and refuses the kernel where it did not build."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from kernels import native_lora
from kernels.cpu_lora import pack_segments
from kernels.lora_backend import CpuBackend, LoraSlots
from kernels.lora_meta import LoraMetaBuilder
from tests.kernels.test_cpu_lora import CPU_LAYERS, DTYPES, GATE_UP, _reference, _tolerances
from tests.kernels.test_lora_kernels import MIXES, QKV, _mix, _problem


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    if native_lora.kernel() is None:
        pytest.fail(f"the kernel must build on a CI machine: {native_lora.native_build.why_not(native_lora.LIBRARY)}")


def _table(p) -> native_lora.SlotTable:
    table = native_lora.SlotTable.empty(p.lora_a.shape[1], p.lora_a.shape[0])
    for slot, packed in pack_segments(p.lora_a, p.lora_b, p.ranks.tolist(), p.layer.offsets).slots.items():
        table.set_slot(slot, packed)
    return table


def _native(y: torch.Tensor, x: torch.Tensor, table, slots: list[int], threads: int = 1) -> None:
    meta = LoraMetaBuilder(max(len(slots), 1), table.table.shape[0], "cpu").build(slots)
    native_lora.lora_native(native_lora.kernel(), y, x, table, meta, threads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layer", list(CPU_LAYERS))
@pytest.mark.parametrize("mix", MIXES)
def test_the_native_kernel_matches_the_reference_for_every_mix(mix, layer, dtype):
    seed = zlib.crc32(f"native-{mix}-{layer}".encode())
    p = _problem(CPU_LAYERS[layer], _mix(mix, 21, random.Random(seed)), dtype, seed)
    y = torch.randn(len(p.token_slots), p.layer.offsets[-1], generator=torch.Generator().manual_seed(seed)).to(dtype)
    expected = _reference(p, y)
    rtol, atol = _tolerances(p, y)

    _native(y, p.x, _table(p), p.token_slots)

    torch.testing.assert_close(y, expected, rtol=rtol, atol=atol)
    base_rows = [t for t, slot in enumerate(p.token_slots) if slot < 0]
    assert torch.equal(y[base_rows], expected[base_rows]), "rows without an adapter changed"


def _delta_of_row(x, slots, row, table, out_features, threads=1) -> torch.Tensor:
    y = torch.zeros(len(slots), out_features, dtype=x.dtype)
    _native(y, x, table, slots, threads)
    return y[row]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layer", list(CPU_LAYERS))
def test_a_rows_delta_is_the_same_bits_whatever_shares_its_step(layer, dtype):
    layer = CPU_LAYERS[layer]
    p = _problem(layer, [3] * 8, dtype, seed=11)
    table = _table(p)
    gen = torch.Generator().manual_seed(12)
    mine = torch.randn(layer.in_features, generator=gen).to(dtype)
    alone = _delta_of_row(mine[None], [3], 0, table, layer.offsets[-1])
    assert alone.abs().max() > 0
    rng = random.Random(13)
    # steps of every size around the kernel's blocks of rows (4) and items (32), and one large enough for
    # its threads: the row at every kind of place, in a segment of every length
    for others in (1, 2, 3, 4, 5, 7, 31, 32, 33, 150, 700):
        for mix in ("identical", "uniform", "distinct", "skewed"):
            slots = _mix(mix, others + 1, rng)
            at = rng.randrange(others + 1)
            slots[at] = 3
            if mix != "identical":
                slots.sort(key=lambda s: (s < 0, s))  # the model runner's order: each adapter's rows one run
                at = slots.index(3) + rng.randrange(slots.count(3))
            x = torch.randn(others + 1, layer.in_features, generator=gen).to(dtype)
            x[at] = mine
            for threads in (1, 2):
                got = _delta_of_row(x, slots, at, table, layer.offsets[-1], threads)
                assert torch.equal(got, alone), (others, mix, threads)


def test_a_rows_delta_is_the_same_bits_at_every_place_of_a_segment_of_every_length():
    p = _problem(GATE_UP, [2], torch.float32, seed=18)
    table = _table(p)
    gen = torch.Generator().manual_seed(19)
    mine = torch.randn(GATE_UP.in_features, generator=gen)
    alone = _delta_of_row(mine[None], [2], 0, table, GATE_UP.offsets[-1])
    for length in range(1, 11):
        for at in range(length):
            x = torch.randn(length + 3, GATE_UP.in_features, generator=gen)
            x[1 + at] = mine
            slots = [0] + [2] * length + [-1, 4]
            assert torch.equal(_delta_of_row(x, slots, 1 + at, table, GATE_UP.offsets[-1]), alone), (length, at)


def test_scattered_rows_of_a_slot_give_the_bits_of_one_run():
    p = _problem(QKV, [1] * 4, torch.float32, seed=14)
    table = _table(p)
    x = torch.randn(13, QKV.in_features, generator=torch.Generator().manual_seed(15))
    run = _delta_of_row(x, [1, 1, 1, 1, *[-1] * 9], 2, table, QKV.offsets[-1])
    scattered = _delta_of_row(x, [1, -1, 1, 0, 1, *[-1] * 8], 2, table, QKV.offsets[-1])
    assert torch.equal(run, scattered)


def test_slices_a_slot_does_not_adapt_and_rows_of_no_adapter_keep_their_bits():
    # Slot 4 of GATE_UP adapts the first slice only: the second keeps its bits, -0.0 and NaN included.
    p = _problem(GATE_UP, [4, 4, -1, 4], torch.float32, seed=6)
    y = torch.randn(4, GATE_UP.offsets[-1], generator=torch.Generator().manual_seed(7))
    lo = GATE_UP.offsets[1]
    y[0, lo] = -0.0
    y[1, lo + 1] = float("nan")
    y[2, 0] = -0.0
    before = y.clone()

    _native(y, p.x, _table(p), p.token_slots)

    assert torch.equal(y[:, lo:].view(torch.int32), before[:, lo:].view(torch.int32))
    assert torch.equal(y[2].view(torch.int32), before[2].view(torch.int32))
    assert not torch.equal(y[:, :lo], before[:, :lo])


def test_an_overflowing_adapter_does_not_reach_other_rows():
    token_slots = [3, 0, -1, 1, 3]
    p = _problem(QKV, token_slots, torch.float32, seed=9)
    p.lora_a[:, 3] *= 1e38
    y = torch.zeros(len(token_slots), QKV.offsets[-1])

    _native(y, p.x, _table(p), token_slots)

    assert torch.isfinite(y[[1, 2, 3]]).all()
    expected = _reference(p, torch.zeros_like(y))
    rtol, atol = _tolerances(p, torch.zeros_like(y), rows=[1, 2, 3])
    torch.testing.assert_close(y[[1, 2, 3]], expected[[1, 2, 3]], rtol=rtol, atol=atol)


def _backend(p) -> CpuBackend:
    ranks = p.ranks.tolist()
    return CpuBackend(LoraSlots(p.lora_a, p.lora_b, p.ranks, torch.tensor(p.layer.offsets, dtype=torch.int32),
                                ranks, p.layer.offsets))


def test_a_native_backend_follows_a_changed_slot_and_agrees_with_the_tiles():
    p = _problem(QKV, [0, 1, 1, 2, -1, 3], torch.float32, seed=4)
    backend = _backend(p)
    backend.use_row_tile(8, native=True)
    meta = LoraMetaBuilder(8, 5, "cpu").build(p.token_slots)
    before = torch.zeros(6, QKV.offsets[-1])
    backend.apply(before, p.x, meta)
    # slot 1: another adapter, rank 2 on q only
    gen = torch.Generator().manual_seed(5)
    p.lora_a[0, 1, :2] = torch.randn(2, QKV.in_features, generator=gen)
    p.lora_b[1, :, :2] = torch.randn(QKV.offsets[-1], 2, generator=gen)
    backend.slots.host_ranks[0][1], backend.slots.host_ranks[1][1], backend.slots.host_ranks[2][1] = 2, 0, 0
    backend.slot_changed(1)
    native = torch.zeros(6, QKV.offsets[-1])
    backend.apply(native, p.x, meta)
    assert torch.equal(native[[0, 3, 4, 5]], before[[0, 3, 4, 5]]), "rows of unchanged slots moved"
    assert not native[[1, 2], QKV.offsets[1] :].any(), "the new adapter adapts q only"
    backend.use_row_tile(8)  # the torch path's tiles, on the same slots
    tiled = torch.zeros(6, QKV.offsets[-1])
    backend.apply(tiled, p.x, meta)
    torch.testing.assert_close(native, tiled, rtol=1e-5, atol=1e-4)


def test_a_backend_told_to_run_a_kernel_that_did_not_build_says_why(monkeypatch):
    monkeypatch.setattr(native_lora, "kernel", lambda: None)
    monkeypatch.setattr(native_lora.native_build, "why_not", lambda name: "no C++ compiler found")
    backend = _backend(_problem(QKV, [0], torch.float32, seed=3))
    with pytest.raises(RuntimeError, match="did not build: no C\\+\\+ compiler found"):
        backend.use_row_tile(8, native=True)

"""The dense, gathered and segmented CPU LoRA paths agree with the reference's shrink + expand, and
the layers of one step share what they compute alike."""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest
import torch

from kernels import reference
from kernels.cpu_lora import (
    CpuStepCache,
    DensePack,
    lora_dense,
    lora_gathered,
    lora_segmented,
    pack,
    pack_gathered,
    pack_segments,
    update_gathered,
)
from kernels.cpu_tuner import CpuLoraPath, plan
from tests.kernels.test_lora_kernels import LAYERS, MIXES, QKV, Layer, _mix, _problem
from tests.tolerances import magnitude, tolerances

DTYPES = (torch.float32, torch.bfloat16)
# gate_up-like, two slices of one width; slot 1 adapts neither, slot 4 only the first.
GATE_UP = Layer(48, (40, 40), ((4, 0, 8, 16, 2), (4, 0, 8, 16, 0)))
CPU_LAYERS = {**LAYERS, "gate_up": GATE_UP}


def _pack(p) -> DensePack:
    return pack(p.lora_a, p.lora_b, p.ranks.tolist(), p.layer.offsets)


def _dense(y, p, step: CpuStepCache):
    packed = _pack(p)
    lora_dense(y, p.x, packed, step.mask(packed, p.meta.token_slots))


def _gathered(y, p, step: CpuStepCache):
    packed = pack_gathered(p.lora_a, p.lora_b, p.ranks.tolist(), p.layer.offsets)
    lora_gathered(y, p.x, packed, step.gather_index(packed, p.meta.token_slots))


def _segmented(y, p, step: CpuStepCache):
    lora_segmented(y, p.x, pack_segments(p.lora_a, p.lora_b, p.ranks.tolist(), p.layer.offsets), p.meta)


PATHS = {CpuLoraPath.DENSE: _dense, CpuLoraPath.GATHERED: _gathered, CpuLoraPath.SEGMENTED: _segmented}
SHARING = (CpuLoraPath.DENSE, CpuLoraPath.GATHERED)  # the paths that compute a per-step value once


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


@pytest.mark.parametrize("path", list(PATHS), ids=lambda path: path.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layer", list(CPU_LAYERS))
@pytest.mark.parametrize("mix", MIXES)
def test_cpu_paths_match_the_reference_for_every_mix(mix, layer, dtype, path):
    seed = zlib.crc32(f"dense-{mix}-{layer}".encode())
    p = _problem(CPU_LAYERS[layer], _mix(mix, 21, random.Random(seed)), dtype, seed)
    y = torch.randn(len(p.token_slots), p.layer.offsets[-1], generator=torch.Generator().manual_seed(seed)).to(dtype)
    expected = _reference(p, y)
    rtol, atol = _tolerances(p, y)

    PATHS[path](y, p, CpuStepCache())

    torch.testing.assert_close(y, expected, rtol=rtol, atol=atol)
    base_rows = [t for t, slot in enumerate(p.token_slots) if slot < 0]
    assert torch.equal(y[base_rows], expected[base_rows]), "rows without an adapter changed"


def test_packed_columns_hold_only_real_ranks_and_their_slots():
    p = _problem(QKV, [0, 1], torch.float32, seed=2)
    packed = _pack(p)
    real = sum(sum(ranks) for ranks in QKV.ranks)
    assert packed.rank == real
    assert packed.packed_a.shape == (QKV.in_features, real)
    # columns grouped by slice, then by slot; each slice's B covers that slice's rows only
    expected_slots = [slot for s in range(3) for slot in range(5) for _ in range(QKV.ranks[s][slot])]
    assert packed.col_slots.tolist() == expected_slots
    assert [(e.lo, e.hi, e.end - e.start) for e in packed.expands] == [
        (QKV.offsets[s], QKV.offsets[s + 1], sum(QKV.ranks[s])) for s in range(3)]
    assert all(e.b.shape == (e.end - e.start, e.hi - e.lo) for e in packed.expands)
    assert not any(e.b.isnan().any() for e in packed.expands), "rank padding of B (NaN in this problem) was packed"


@pytest.mark.parametrize("path", SHARING, ids=lambda path: path.value)
def test_layers_of_one_step_share_its_mask_or_gather_index(path):
    p = _problem(QKV, [0, 3, -1, 1], torch.float32, seed=6)
    step = CpuStepCache()

    def shared() -> list[torch.Tensor]:
        return [*step.masks.values(), *step.gather_indices.values()]

    y1, y2 = torch.zeros(4, QKV.offsets[-1]), torch.zeros(4, QKV.offsets[-1])
    PATHS[path](y1, p, step)
    (first,) = shared()
    PATHS[path](y2, p, step)  # a second layer of the same layout, in the same step
    (second,) = shared()
    assert second is first, "the second layer computed the step's value again"
    torch.testing.assert_close(y2, y1)
    rtol, atol = _tolerances(p, torch.zeros_like(y1))
    torch.testing.assert_close(y1, _reference(p, torch.zeros_like(y1)), rtol=rtol, atol=atol)


@pytest.mark.parametrize("path", list(PATHS), ids=lambda path: path.value)
def test_an_overflowing_adapter_does_not_reach_other_rows(path):
    # Slot 3's A is so large that x @ A is inf for every token, including those of other slots:
    # those products must be dropped, not multiplied by zero (inf * 0 = NaN).
    token_slots = [3, 0, -1, 1, 3]
    p = _problem(QKV, token_slots, torch.float32, seed=9)
    p.lora_a[:, 3] *= 1e38
    y = torch.zeros(len(token_slots), QKV.offsets[-1])

    PATHS[path](y, p, CpuStepCache())

    assert torch.isfinite(y[[1, 2, 3]]).all()
    expected = _reference(p, torch.zeros_like(y))
    rtol, atol = _tolerances(p, torch.zeros_like(y), rows=[1, 2, 3])
    torch.testing.assert_close(y[[1, 2, 3]], expected[[1, 2, 3]], rtol=rtol, atol=atol)


def test_plan_counts_the_real_ranks_of_the_resident_slots_and_equal_layouts_plan_alike():
    cpu_plan = plan([list(r) for r in QKV.ranks], QKV.in_features, QKV.offsets[-1])
    assert cpu_plan.rank == sum(sum(r) for r in QKV.ranks)
    assert cpu_plan == plan([list(r) for r in QKV.ranks], QKV.in_features, QKV.offsets[-1])
    moved = [list(r) for r in QKV.ranks]
    moved[0][0], moved[1][0] = moved[1][0] + 1, moved[0][0]  # another layout
    assert plan(moved, QKV.in_features, QKV.offsets[-1]) != cpu_plan
    assert plan([[0] * 5] * 3, QKV.in_features, QKV.offsets[-1]).rank == 0


def test_gathered_pack_copies_real_ranks_only_and_ends_with_a_zero_slot():
    p = _problem(QKV, [0, 1], torch.float32, seed=2)
    gathered = pack_gathered(p.lora_a, p.lora_b, p.ranks.tolist(), p.layer.offsets)
    r = max(max(ranks) for ranks in QKV.ranks)
    assert gathered.rank == r and gathered.a.shape == (6, 3 * r, QKV.in_features)
    assert gathered.b.shape == (6, QKV.offsets[-1], r)
    assert not gathered.b.isnan().any(), "rank padding of B (NaN in this problem) was packed"
    assert not gathered.a[5].any() and not gathered.b[5].any(), "the slot of tokens without an adapter is not zero"
    a = gathered.a.view(6, 3, r, QKV.in_features)
    for s in range(3):
        for slot in range(5):
            assert not a[slot, s, QKV.ranks[s][slot]:].any(), f"A's rank padding of slot {slot}, slice {s} is not zero"
    assert gathered.row_slice.flatten().tolist() == [s for s in range(3) for _ in range(QKV.widths[s])]


def test_a_changed_slot_is_patched_into_the_gathered_pack_unless_it_outgrows_it():
    p = _problem(QKV, [0, 1], torch.float32, seed=4)
    ranks = [list(r) for r in QKV.ranks]
    packed = pack_gathered(p.lora_a, p.lora_b, ranks, p.layer.offsets)
    gen = torch.Generator().manual_seed(5)
    # slot 1 gets another adapter of rank 2 on q only, within the pack's rank
    ranks[0][1], ranks[1][1], ranks[2][1] = 2, 0, 0
    p.lora_a[0, 1, :2] = torch.randn(2, QKV.in_features, generator=gen)
    p.lora_b[1, :, :2] = torch.randn(QKV.offsets[-1], 2, generator=gen)
    assert update_gathered(packed, p.lora_a, p.lora_b, ranks, p.layer.offsets, 1)
    fresh = pack_gathered(p.lora_a, p.lora_b, ranks, p.layer.offsets)
    assert torch.equal(packed.a, fresh.a) and torch.equal(packed.b, fresh.b)

    small = pack_gathered(p.lora_a[:, :, :8], p.lora_b[:, :, :8], [[min(r, 8) for r in rs] for rs in ranks],
                          p.layer.offsets)
    assert small.rank == 8
    assert not update_gathered(small, p.lora_a, p.lora_b, ranks, p.layer.offsets, 3), "slot 3 has rank 64"

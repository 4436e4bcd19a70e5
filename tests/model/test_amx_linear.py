"""bfloat16 projections through our AMX kernel (``amx_linear``): the product of the rounded operands summed
in float32 (against float64, within float32's summation error) and rounded to bfloat16 as torch rounds,
the bias added before, each row the same bits alone, in any call
and at any place, odd widths padded away, the bias as oneDNN's; where the kernel cannot serve, the probe
says why and keeps oneDNN's tiles. The kernel's tests run where this CPU gives AMX tiles; the fallback's
run everywhere."""

from __future__ import annotations

import pytest
import torch

from data_plane.model import amx_linear, cpu_linear, row_rule
from tests.model.test_row_rule import _probe
from tests.tolerances import magnitude, tolerances

needs_amx = pytest.mark.skipif(bool(amx_linear.unusable(torch.bfloat16)),
                               reason=amx_linear.unusable(torch.bfloat16) or "usable")


def _operands(rows: int, outs: int, ins: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, ins, generator=gen).to(torch.bfloat16),
            torch.randn(outs, ins, generator=gen).div_(ins**0.5).to(torch.bfloat16))


@needs_amx
@pytest.mark.parametrize(("rows", "outs", "ins"), [(1, 16, 32), (7, 200, 48), (33, 576, 576), (300, 96, 1536)])
def test_the_product_is_the_rounded_operands_summed_in_float32(rows, outs, ins):
    x, w = _operands(rows, outs, ins, rows + outs)
    out = amx_linear.matmul(x, amx_linear.pack(w), outs)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, outs)
    exact = (x.double() @ w.double().T).float()
    rtol, atol = tolerances(torch.float32, depth=ins, scale=magnitude(x.float().abs() @ w.float().abs().T))
    # the float32 sum's error, then one rounding to bfloat16 (half a unit in its last place)
    torch.testing.assert_close(out.float(), exact, rtol=rtol + 2**-8, atol=atol)


@needs_amx
def test_each_output_is_its_float32_sum_plus_the_bias_rounded_to_nearest_even_as_torch_rounds():
    gen = torch.Generator().manual_seed(5)
    outs, ins = 200, 64  # 200 outputs: a last block of 8
    w = ((torch.rand(outs, ins, generator=gen) + 0.5) * torch.randn(outs, ins, generator=gen).sign()).to(torch.bfloat16)
    bias = torch.randn(outs, generator=gen)
    pairs = [(r % ins, (5 * r + 3) % ins) for r in range(20)]  # two inputs of 1 per row: an exact float32 sum
    x = torch.zeros(len(pairs), ins, dtype=torch.bfloat16)
    for r, (a, b) in enumerate(pairs):
        x[r, a] = x[r, b] = 1
    wf = w.float()
    sums = torch.stack([wf[:, a] + wf[:, b] for a, b in pairs])
    packed = amx_linear.pack(w)
    assert torch.equal(amx_linear.matmul(x, packed, outs), sums.to(torch.bfloat16))
    assert torch.equal(amx_linear.matmul(x, packed, outs, bias), (sums + bias).to(torch.bfloat16))
    # a NaN as torch's vectorized conversion of a tensor writes it (the old path, float32 then .to, on this CPU)
    nan = amx_linear.matmul(x, packed, outs, torch.full((outs,), float("nan")))
    assert torch.equal(nan.view(torch.int16), torch.full_like(sums, float("nan")).to(torch.bfloat16).view(torch.int16))


@needs_amx
@pytest.mark.parametrize(("outs", "ins"), [(576, 576), (200, 48), (96, 1536)])
def test_a_row_gets_the_same_bits_alone_in_any_call_and_at_any_place(outs, ins):
    x, w = _operands(300, outs, ins, outs)
    packed = amx_linear.pack(w)
    whole = amx_linear.matmul(x, packed, outs)
    for row in (0, 5, 16, 17, 150, 299):
        assert torch.equal(amx_linear.matmul(x[row : row + 1], packed, outs)[0], whole[row]), row
    for size in (3, 16, 37, 64):
        assert torch.equal(torch.cat([amx_linear.matmul(t, packed, outs) for t in x.split(size)]), whole), size
    assert torch.equal(amx_linear.matmul(x.roll(7, 0), packed, outs).roll(-7, 0), whole)


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_packed_weight_rounds_like_onednns_and_adds_the_bias_as_it_does(dtype):
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(96, 64, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(40, 64, generator=gen).to(dtype)
    amx = cpu_linear.pack(weight, torch.bfloat16, native=True)
    assert isinstance(amx, cpu_linear.AmxWeight) and amx.whole
    got = cpu_linear.linear(x, weight, bias, amx)
    onednn = cpu_linear.linear(x, weight, bias, cpu_linear.pack(weight, torch.bfloat16, rows=32))
    assert got.dtype == dtype and got.shape == onednn.shape
    # both round each output to bfloat16 once (the sums' order differs: at most a unit of its last place)
    assert (got.float() - onednn.float()).abs().max() <= 2**-7 * onednn.float().abs().max()


def test_where_the_kernel_cannot_serve_the_probe_says_why_and_keeps_onednns_tiles(monkeypatch):
    monkeypatch.setattr(amx_linear, "unusable", lambda dtype: "no AMX tiles here (test)")
    rule = _probe("tiny", torch.bfloat16)
    assert not rule.projection.native and not rule.broken
    assert rule.projection in row_rule.PROJECTION_TILINGS[torch.bfloat16][1:]
    with pytest.raises(ValueError, match="no AMX tiles here"):
        cpu_linear.pack(torch.ones(16, 32), torch.bfloat16, native=True)


def test_the_probe_turns_down_a_kernel_whose_rows_depend_on_each_other(monkeypatch):
    if amx_linear.unusable(torch.bfloat16):
        pytest.skip(amx_linear.unusable(torch.bfloat16))
    matmul = amx_linear.matmul
    # a kernel that sums a call's rows otherwise once it holds more than 16 (as a library switching kernels)
    monkeypatch.setattr(amx_linear, "matmul", lambda x, packed, outs, bias=None: matmul(x, packed, outs, bias) * (
        1 + 2**-6 * (x.shape[0] > 16)))
    rule = _probe("tiny", torch.bfloat16)
    assert not rule.projection.native


@needs_amx
def test_the_probe_takes_the_kernel_where_it_serves():
    rule = _probe("tiny", torch.bfloat16, torch.bfloat16)
    assert rule.projection.native and rule.projection.describe() == "one call of the AMX kernel"
    assert rule.head.native and not rule.broken  # a bfloat16 model's head too

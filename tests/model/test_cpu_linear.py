"""Projections and the output head of a CPU model run in fixed row tiles, through oneDNN with reordered
weights where it serves the precision: a row gives the same bits at any row count and position, and
what a plain matmul gives (in bfloat16, within the rounding of its operands). A pod computes in the
precision --dtype names, or on auto in the one it measures faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data_plane.model import cpu_linear, load_model
from data_plane.model.llama import Projection
from data_plane.model.precision import Precision, load_dtype
from data_plane.pod import set_precision
from tests.model.conftest import run_chunks
from tests.tolerances import logits_atol, longest_sum, magnitude, rounded_operands_atol, tolerances


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny")
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _plain(monkeypatch) -> None:
    """As on a CPU whose oneDNN serves no dtype: every tile runs a plain matmul."""
    monkeypatch.setattr(cpu_linear, "onednn_serves", lambda dtype: False)


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 300])
def test_linear_matches_a_plain_matmul_at_any_row_count(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(200, 48, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(rows, 48, generator=gen)
    out = cpu_linear.linear(x, weight, bias, cpu_linear.pack(weight))
    # 48 products and the bias: their absolute sum bounds what any summation order can round
    rtol, atol = tolerances(torch.float32, depth=48 + 1, scale=magnitude(F.linear(x.abs(), weight.abs(), bias.abs())))
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=rtol, atol=atol)


@pytest.mark.parametrize("rows", [1, 5, 16, 21, 40])
def test_ragged_tiles_compute_every_row_in_calls_of_at_most_the_tile(monkeypatch, rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(64, 24, generator=gen), torch.randn(64, generator=gen)
    x = torch.randn(rows, 24, generator=gen)
    packed = cpu_linear.pack(weight, rows=16, ragged=True)
    calls = []
    tile = packed._tile
    monkeypatch.setattr(cpu_linear.CpuWeight, "_tile", lambda self, t, b: calls.append(t.shape[0]) or tile(t, b))
    out = cpu_linear.linear(x, weight, bias, packed)
    assert calls == [16] * (rows // 16) + ([rows % 16] if rows % 16 else [])  # no padding rows computed
    rtol, atol = tolerances(torch.float32, depth=24 + 1, scale=magnitude(F.linear(x.abs(), weight.abs(), bias.abs())))
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=rtol, atol=atol)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1536, 96), (96, 1536), (3072, 64)], ids=str)
def test_a_row_gives_the_same_bits_at_any_row_count_and_position(monkeypatch, dtype, onednn, shape):
    if not onednn:
        _plain(monkeypatch)
    gen = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
    packed = cpu_linear.pack(weight, dtype)
    assert packed.reordered == (onednn and cpu_linear.onednn_serves(dtype))
    x = torch.randn(300, shape[1], generator=gen)
    alone = cpu_linear.linear(x[:1], weight, None, packed)
    for rows in (2, 3, packed.rows - 1, packed.rows, packed.rows + 1, 3 * packed.rows + 5, 300):
        batch = x[:rows].roll(rows // 2, dims=0)  # row 0 somewhere in the middle, not first
        assert torch.equal(cpu_linear.linear(batch, weight, None, packed)[rows // 2], alone[0]), rows


def test_a_float32_cpu_model_gets_packed_weights_and_the_same_logits(tiny_dir):
    model = load_model(tiny_dir, "float32")
    projections = [m for m in model.modules() if isinstance(m, Projection)]
    assert projections and all(p.packed is not None and p.packed.dtype == torch.float32 for p in projections)
    assert model.precision is Precision.FLOAT32
    ids = list(range(3, 40))
    packed = run_chunks(model, ids, [20, 1, 16])  # a prefill chunk and decode-sized steps
    for p in projections:
        p.packed = None
    model._head_matmul = torch.nn.functional.linear
    plain = run_chunks(model, ids, [20, 1, 16])
    torch.testing.assert_close(packed, plain, rtol=0, atol=logits_atol(longest_sum(model.config), magnitude(plain)))


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "plain"])
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
def test_bfloat16_operands_give_float32_rows_within_the_rounding_of_its_operands(monkeypatch, rows, onednn):
    if not onednn:
        _plain(monkeypatch)
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(200, 48, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(rows, 48, generator=gen)
    packed = cpu_linear.pack(weight, torch.bfloat16)
    out = cpu_linear.linear(x, weight, bias, packed)
    assert out.dtype == torch.float32 and out.shape == (rows, 200)
    exact = F.linear(x.double(), weight.double(), bias.double()).float()
    scale = magnitude(F.linear(x.abs(), weight.abs(), bias.abs()))
    atol = rounded_operands_atol(torch.bfloat16, depth=48 + 1, scale=scale)
    torch.testing.assert_close(out, exact, rtol=0, atol=atol)
    # and it is the bfloat16 product, not a float32 one: the operands' rounding shows
    assert (out - exact).abs().max() > 100 * (F.linear(x, weight, bias) - exact).abs().max()


class ScriptedClock:
    """A timer for ``choose_precision``: it times float32 then bfloat16 in turn, so the clock reads
    alternate start/end pairs; each pair spans ``costs[precision]`` seconds."""

    ORDER = (Precision.FLOAT32, Precision.BFLOAT16_MATMUL)

    def __init__(self, costs: dict[Precision, float]) -> None:
        self.costs, self.t, self.calls = costs, 0.0, 0

    def __call__(self) -> float:
        if self.calls % 2:  # an end: the run of this pair's precision took its cost
            self.t += self.costs[self.ORDER[(self.calls // 2) % 2]]
        self.calls += 1
        return self.t


WEIGHTS = [(torch.randn(24, 16), 3), (torch.randn(40, 16), 1)]


@pytest.mark.parametrize(("f32", "bf16", "chosen"), [
    (1.0, 0.5, Precision.BFLOAT16_MATMUL),
    (1.0, 0.95, Precision.FLOAT32),  # faster, but not by BFLOAT16_MIN_GAIN: accuracy is worth more
    (0.5, 1.0, Precision.FLOAT32),
])
def test_the_auto_precision_is_the_measured_faster_one(monkeypatch, f32, bf16, chosen):
    monkeypatch.setattr(cpu_linear, "bfloat16_supported", lambda: True)
    clock = ScriptedClock({Precision.FLOAT32: f32, Precision.BFLOAT16_MATMUL: bf16})
    choice = cpu_linear.choose_precision(WEIGHTS, rows=[1, 8], timer=clock, repeats=2)
    assert choice.precision is chosen
    # every weight at every row count, two timed runs each, weighted by how many weights share the shape
    assert clock.calls == 2 * 2 * 2 * 2 * len(WEIGHTS)
    assert choice.seconds[Precision.FLOAT32] == pytest.approx(f32 * 2 * (3 + 1))
    assert choice.seconds[Precision.BFLOAT16_MATMUL] == pytest.approx(bf16 * 2 * (3 + 1))


def test_without_bfloat16_in_onednn_auto_is_float32_unmeasured(monkeypatch):
    monkeypatch.setattr(cpu_linear, "bfloat16_supported", lambda: False)
    clock = ScriptedClock(dict.fromkeys(ScriptedClock.ORDER, 1.0))
    choice = cpu_linear.choose_precision(WEIGHTS, rows=[1], timer=clock)
    assert (choice.precision, choice.seconds, clock.calls) == (Precision.FLOAT32, {}, 0)
    assert "no bfloat16" in choice.reason


@pytest.mark.parametrize("setting", ["float32", "bfloat16", "bfloat16-matmul"])
def test_the_named_precision_is_the_one_every_matmul_runs_in(tiny_dir, setting):
    model = load_model(tiny_dir, load_dtype(setting, "cpu"))
    assert set_precision(model, setting, max_num_seqs=8) is Precision(setting) is model.precision
    precision = Precision(setting)
    packs = [m.packed for m in model.modules() if isinstance(m, Projection)]
    assert {p.dtype for p in packs} == {precision.matmul_dtype}
    # logits stay in the weights' precision: float32 unless the user named bfloat16
    assert model._head_matmul.dtype == precision.weights_dtype
    logits = run_chunks(model, list(range(3, 40)), [20, 1, 16])
    assert logits.dtype == torch.float32 and logits.isfinite().all()


def test_float32_named_is_float32_even_where_bfloat16_measures_faster(tiny_dir, monkeypatch):
    def faster_bfloat16(*args, **kwargs):
        raise AssertionError("a named precision is not measured")

    monkeypatch.setattr(cpu_linear, "choose_precision", faster_bfloat16)
    model = load_model(tiny_dir, load_dtype("float32", "cpu"))
    assert set_precision(model, "float32", max_num_seqs=8) is Precision.FLOAT32
    assert all(m.packed.dtype == torch.float32 for m in model.modules() if isinstance(m, Projection))


@pytest.mark.parametrize("measured", [Precision.FLOAT32, Precision.BFLOAT16_MATMUL])
def test_auto_on_cpu_takes_what_the_measurement_chose(tiny_dir, monkeypatch, measured):
    monkeypatch.setattr(cpu_linear, "choose_precision",
                        lambda *args, **kwargs: cpu_linear.PrecisionChoice(measured, {}, "scripted"))
    model = load_model(tiny_dir, load_dtype("auto", "cpu"))
    assert set_precision(model, "auto", max_num_seqs=8) is measured is model.precision


def test_a_precision_the_model_cannot_run_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="--dtype bfloat16-matmul: a model of torch.bfloat16 weights"):
        set_precision(load_model(tiny_dir, "bfloat16"), "bfloat16-matmul", max_num_seqs=8)

"""Projections and the output head of a float32 CPU model run through oneDNN with reordered
weights for small steps, and give what a plain matmul gives; in bfloat16, within the rounding of
its operands. The precision is the one measured faster, or the one the pod is told."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data_plane.model import cpu_linear, load_model
from data_plane.model.cpu_linear import MatmulPrecision
from data_plane.model.llama import Projection
from data_plane.pod import set_cpu_matmul_precision
from tests.model.conftest import run_chunks
from tests.tolerances import logits_atol, longest_sum, magnitude, rounded_operands_atol, tolerances

pytestmark = pytest.mark.skipif(not cpu_linear.can_prepack(torch.zeros(1)), reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny")
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("rows", [1, 7, cpu_linear.PACKED_MAX_ROWS, cpu_linear.PACKED_MAX_ROWS + 1])
def test_linear_matches_a_plain_matmul_on_both_sides_of_the_row_limit(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(200, 48, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(rows, 48, generator=gen)
    out = cpu_linear.linear(x, weight, bias, cpu_linear.prepack(weight))
    # 48 products and the bias: their absolute sum bounds what any summation order can round
    rtol, atol = tolerances(torch.float32, depth=48 + 1, scale=magnitude(F.linear(x.abs(), weight.abs(), bias.abs())))
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=rtol, atol=atol)


def test_a_float32_cpu_model_gets_reordered_weights_and_the_same_logits(tiny_dir):
    model = load_model(tiny_dir, "float32")
    projections = [m for m in model.modules() if isinstance(m, Projection)]
    assert projections and all(p.packed is not None for p in projections)
    ids = list(range(3, 40))
    packed = run_chunks(model, ids, [20, 1, 16])  # a prefill chunk and decode-sized steps
    for p in projections:
        p.packed = None
    model._packed_head = None
    plain = run_chunks(model, ids, [20, 1, 16])
    torch.testing.assert_close(packed, plain, rtol=0, atol=logits_atol(longest_sum(model.config), magnitude(plain)))


def test_other_dtypes_keep_the_plain_matmul(tiny_dir):
    model = load_model(tiny_dir, "bfloat16")
    assert all(m.packed is None for m in model.modules() if isinstance(m, Projection))


needs_bfloat16 = pytest.mark.skipif(not cpu_linear.can_prepack(torch.zeros(1)) or not cpu_linear.bfloat16_supported(),
                                    reason="oneDNN has no bfloat16 matmul on this CPU")


@needs_bfloat16
@pytest.mark.parametrize("rows", [1, 7, cpu_linear.PACKED_MAX_ROWS, cpu_linear.PACKED_MAX_ROWS + 1, 300])
def test_a_bfloat16_copy_gives_float32_rows_within_the_rounding_of_its_operands_at_any_row_count(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(200, 48, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(rows, 48, generator=gen)
    packed = cpu_linear.prepack(weight, MatmulPrecision.BFLOAT16)
    assert packed.dtype == torch.bfloat16
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

    def __init__(self, costs: dict[MatmulPrecision, float]) -> None:
        self.costs, self.t, self.calls = costs, 0.0, 0

    def __call__(self) -> float:
        if self.calls % 2:  # an end: the run of this pair's precision took its cost
            self.t += self.costs[list(MatmulPrecision)[(self.calls // 2) % 2]]
        self.calls += 1
        return self.t


WEIGHTS = [(torch.randn(24, 16), 3), (torch.randn(40, 16), 1)]


@needs_bfloat16
@pytest.mark.parametrize(("f32", "bf16", "chosen"), [
    (1.0, 0.5, MatmulPrecision.BFLOAT16),
    (1.0, 0.95, MatmulPrecision.FLOAT32),  # faster, but not by BFLOAT16_MIN_GAIN: accuracy is worth more
    (0.5, 1.0, MatmulPrecision.FLOAT32),
])
def test_the_precision_is_the_measured_faster_one(f32, bf16, chosen):
    clock = ScriptedClock({MatmulPrecision.FLOAT32: f32, MatmulPrecision.BFLOAT16: bf16})
    choice = cpu_linear.choose_precision(WEIGHTS, rows=[1, 8], timer=clock, repeats=2)
    assert choice.precision is chosen
    # every weight at every row count, two timed runs each, weighted by how many weights share the shape
    assert clock.calls == 2 * 2 * 2 * 2 * len(WEIGHTS)
    assert choice.seconds[MatmulPrecision.FLOAT32] == pytest.approx(f32 * 2 * (3 + 1))
    assert choice.seconds[MatmulPrecision.BFLOAT16] == pytest.approx(bf16 * 2 * (3 + 1))


def test_without_bfloat16_in_onednn_the_choice_is_float32_unmeasured(monkeypatch):
    monkeypatch.setattr(cpu_linear, "bfloat16_supported", lambda: False)
    clock = ScriptedClock(dict.fromkeys(MatmulPrecision, 1.0))
    choice = cpu_linear.choose_precision(WEIGHTS, rows=[1], timer=clock)
    assert (choice.precision, choice.seconds, clock.calls) == (MatmulPrecision.FLOAT32, {}, 0)
    assert "no bfloat16" in choice.reason


@needs_bfloat16
@pytest.mark.parametrize("setting", ["float32", "bfloat16", "auto"])
def test_the_pod_setting_gives_every_reordered_weight_one_precision(tiny_dir, setting):
    model = load_model(tiny_dir, "float32")
    precision = set_cpu_matmul_precision(model, setting, max_num_seqs=8)
    if setting != "auto":
        assert precision is MatmulPrecision(setting)
    packs = [m.packed for m in model.modules() if isinstance(m, Projection)]
    assert {p.dtype for p in packs} == {precision.dtype}
    assert model._packed_head.dtype == torch.float32  # logits stay float32: they are the log-probabilities
    logits = run_chunks(model, list(range(3, 40)), [20, 1, 16])
    assert logits.dtype == torch.float32 and logits.isfinite().all()


def test_the_setting_leaves_models_without_reordered_weights_alone(tiny_dir):
    model = load_model(tiny_dir, "bfloat16")
    assert set_cpu_matmul_precision(model, "bfloat16", max_num_seqs=8) is None
    assert all(m.packed is None for m in model.modules() if isinstance(m, Projection))


def test_bfloat16_is_refused_where_onednn_has_none(tiny_dir, monkeypatch):
    monkeypatch.setattr(cpu_linear, "bfloat16_supported", lambda: False)
    with pytest.raises(ValueError, match="--cpu-matmul bfloat16: oneDNN has no bfloat16 matmul on this CPU"):
        set_cpu_matmul_precision(load_model(tiny_dir, "float32"), "bfloat16", max_num_seqs=8)

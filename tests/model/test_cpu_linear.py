"""Projections and the output head of a float32 CPU model run through oneDNN with reordered
weights for small steps, and give what a plain matmul gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data_plane.model import cpu_linear, load_model
from data_plane.model.llama import Projection
from tests.model.conftest import run_chunks
from tests.tolerances import logits_atol, longest_sum, magnitude, tolerances

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

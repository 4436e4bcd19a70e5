"""The model with the CUDA path's fused layer ops (``triton_layer_ops``: the Triton kernels, run on CPU tensors
under Triton's interpreter) computes what it computes with the CPU path's torch ops, for each family's
layout: Llama's pre-norms, Gemma's sandwich norms with ``1 + weight`` scaling and GELU-tanh, Qwen3's and
Gemma 3's q/k norms beside the rotary, Phi's partial rotary. The ops are chosen once, by device."""

from __future__ import annotations

import pytest
import torch

from data_plane.model.layer_ops import TorchOps, layer_ops
from data_plane.model.llama import LlamaForCausalLM, RMSNorm
from data_plane.model.triton_layer_ops import TritonOps
from tests.data_plane.tiny_model import tiny_model
from tests.model.conftest import run_chunks
from tests.tolerances import logits_atol, longest_sum

GEMMA = dict(query_pre_attn_scalar=8, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
             hidden_activation="gelu_pytorch_tanh")
FAMILIES = {
    "llama": {},
    "gemma2": dict(GEMMA, architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=1.5,
                   final_logit_softcapping=4.0),
    "gemma3": dict(GEMMA, architectures=["Gemma3ForCausalLM"], rope_local_base_freq=100.0),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"]),
    "phi3": dict(architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.5),
}
IDS = [(7 * i + 3) % 97 for i in range(11)]
CHUNKS = [7, 3, 1]  # a prefill, a chunk beside its cached prefix, a decode


def _model(family: str, dtype: torch.dtype) -> LlamaForCausalLM:
    model = tiny_model(**FAMILIES[family])
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):  # weights off 1 (tiny_model's), so that a scaling left out shows
                m.weight.add_(torch.randn(m.weight.shape, generator=gen) * 0.2)
    model = model.to(dtype)
    model.use_device("cpu")  # the rotary tables back in float32, the embedding scale in the new dtype
    return model


class CountingOps(TritonOps):
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __getattribute__(self, name: str):
        if name in ("add_norm", "norm", "rotary", "act_mul"):
            self.calls[name] = self.calls.get(name, 0) + 1
        return super().__getattribute__(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_fused_ops_compute_what_the_torch_ops_compute(family, dtype):
    model = _model(family, dtype)
    assert isinstance(model.ops, TorchOps)
    expected = run_chunks(model, IDS, CHUNKS)
    model.ops = TritonOps()
    got = run_chunks(model, IDS, CHUNKS)
    # Both run the same matmuls and attention; in bfloat16 what differs is where the elementwise ops round
    # (each a few ulps of its output, which the layers carry like their outputs), not the order of any
    # long sum: the bound without logits_atol's sqrt(K) for a sum's rounding (which in bfloat16 would be
    # most of the logits' size).
    reduction = longest_sum(model.config, tokens=len(IDS)) if dtype == torch.float32 else 1
    atol = logits_atol(reduction, float(expected.abs().max()), dtype)
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_every_norm_rotary_and_activation_of_a_forward_runs_through_the_models_ops(family):
    model = _model(family, torch.float32)
    model.ops = ops = CountingOps()
    run_chunks(model, IDS, [len(IDS)])
    layers = model.config.num_layers
    sandwich = 2 * layers if model.config.sandwich_norms else 0  # Gemma's norms of each block's output
    assert ops.calls == {"add_norm": 2 * layers + 1, "rotary": layers, "act_mul": layers} | (
        {"norm": sandwich} if sandwich else {})


def test_the_ops_are_chosen_by_device():
    assert isinstance(layer_ops("cpu"), TorchOps)
    assert isinstance(layer_ops("cuda"), TritonOps)

"""An FP8 base: checkpoints in the layouts published FP8 checkpoints use load and give transformers' logits on
their dequantized weights; ``--quantization fp8`` quantizes an unquantized checkpoint per output channel; the
GPU matmuls (W8A8 with per-token activation scales, weight-only) compute what they promise; anything else is
refused at load, naming the scheme or the tensor to fix."""

from __future__ import annotations

import json

import pytest
import torch

from data_plane.errors import ModelLoadError
from data_plane.lora.layer import wrap_with_lora
from data_plane.model import load_model
from data_plane.model.config import ModelConfig
from data_plane.model.llama import Projection
from data_plane.model.quantization import FP8, FP8_MAX, Fp8Compute, dequantize, quantize, w8a8, weight_only
from tests.fp8_checkpoints import compressed_tensors_config, plain_fp8_config, write_dequantized, write_fp8
from tests.tolerances import eps, logits_atol, longest_sum, magnitude, sum_atol

IDS = [5, 17, 3, 99, 42, 8, 64, 23, 77, 1, 30, 12, 90, 55, 6, 41, 19]


def _logits(model, chunked) -> torch.Tensor:
    return chunked(model, IDS, [7, 10])


def _transformers_logits(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([IDS])).logits[0]


def _atol(model_dir, reference: torch.Tensor) -> float:
    return logits_atol(longest_sum(ModelConfig.from_dir(model_dir), tokens=len(IDS)), magnitude(reference))


STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
# name -> (quantization_config, per tensor, scale shape, static input and KV-cache scales)
MIXED = compressed_tensors_config("channel") | {"format": "mixed-precision"}
MIXED["config_groups"]["group_0"]["format"] = "float-quantized"
LAYOUTS = {
    "compressed-tensors, mixed-precision, one float-quantized group": (MIXED, False, None, False),
    "compressed-tensors, per channel": (compressed_tensors_config("channel"), False, None, False),
    "compressed-tensors, per tensor, static input scales": (compressed_tensors_config("tensor", activations=STATIC),
                                                             True, None, True),
    "fp8, per tensor, scalar scales": (plain_fp8_config(), True, (), False),
    "fp8, per channel, static": (plain_fp8_config(activation_scheme="static"), False, None, True),
    "fbgemm_fp8, per channel": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                 "modules_to_not_convert": ["lm_head"]}, False, None, False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_fp8_checkpoint_gives_transformers_logits_on_its_dequantized_weights(base_dir, tmp_path, chunked, layout):
    # Per tensor, q, k and v (gate and up) each carry their own scale: the packed projection's rows differ.
    # Static input and KV-cache scales are read past: activations are scaled per token, the KV cache unquantized.
    config, per_tensor, shape, static = LAYOUTS[layout]
    fp8_dir = write_fp8(base_dir, tmp_path / "fp8", config, per_tensor=per_tensor, scale_shape=shape, static=static)
    model = load_model(fp8_dir, "float32")
    assert model.quantization == "fp8" and model.precision_name == "float32+fp8"
    reference = _transformers_logits(write_dequantized(fp8_dir, tmp_path / "dequantized"))
    ours = _logits(model, chunked)
    assert (ours - reference).abs().max().item() < _atol(base_dir, reference)
    # and FP8 is not a no-op: the unquantized base answers measurably otherwise
    assert (_transformers_logits(base_dir) - reference).abs().max().item() > 10 * _atol(base_dir, reference)


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_per_output_channel(base_dir, tmp_path, chunked):
    quantized = load_model(base_dir, "float32", quantization="fp8")
    plain = load_model(base_dir, "float32")
    assert quantized.precision_name == "float32+fp8" and plain.precision_name == "float32"
    # the same numbers as the per-channel checkpoint made independently (absmax / 448 per row)
    fp8_dir = write_fp8(base_dir, tmp_path / "fp8", compressed_tensors_config("channel"))
    assert torch.equal(_logits(quantized, chunked), _logits(load_model(fp8_dir, "float32"), chunked))
    for (name, q), p in zip(quantized.named_modules(), plain.modules(), strict=True):
        if isinstance(q, Projection):  # each weight within e4m3's rounding (3 mantissa bits) of its row's values
            bound = p.weight.abs().amax(dim=1, keepdim=True) * 2.0**-4 + p.weight.abs() * 2.0**-4
            assert ((q.weight - p.weight).abs() <= bound).all(), name
            assert not torch.equal(q.weight, p.weight), name


def test_modules_the_checkpoint_ignores_stay_unquantized(base_dir, tmp_path):
    config = compressed_tensors_config("channel", ignore=("lm_head", "re:.*mlp\\.down_proj$"))
    fp8_dir = write_fp8(base_dir, tmp_path / "fp8", config, keep="down_proj")
    from safetensors.torch import load_file

    stored = load_file(base_dir / "model.safetensors")
    for compute in (Fp8Compute.DEQUANTIZED, Fp8Compute.WEIGHT_ONLY):
        model = load_model(fp8_dir, "float32", fp8_compute=compute)
        down = model.layers[1].mlp.down_proj
        assert down.quantized is None and torch.equal(down.weight, stored["model.layers.1.mlp.down_proj.weight"])
        assert (model.layers[1].mlp.gate_up_proj.quantized is None) == (compute is Fp8Compute.DEQUANTIZED)


@pytest.mark.parametrize("compute", [Fp8Compute.WEIGHT_ONLY, Fp8Compute.W8A8])
def test_gpu_layouts_keep_e4m3_weights_and_adapters_in_the_activations_dtype(base_dir, tmp_path, chunked, compute):
    # What a CUDA pod holds, run here on CPU (torch's CPU _scaled_mm): e4m3 weights with one scale per row.
    fp8_dir = write_fp8(base_dir, tmp_path / "fp8", compressed_tensors_config("tensor"), per_tensor=True)
    model = load_model(fp8_dir, "float32", fp8_compute=compute)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.quantized.scale.shape == (qkv.out_features,)
    assert len(set(qkv.quantized.scale.tolist())) == 3  # q, k and v each kept their own per-tensor scale
    ours = _logits(model, chunked)
    reference = _logits(load_model(fp8_dir, "float32"), chunked)  # dequantized at load
    if compute is Fp8Compute.WEIGHT_ONLY:  # the same products, summed in another order
        assert (ours - reference).abs().max().item() < _atol(base_dir, reference)
    else:  # activations rounded to e4m3 (2^-4 relative) too: close, not equal
        assert (ours - reference).abs().max().item() < 0.1 * magnitude(reference)
        assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.8
    layers = wrap_with_lora(model, max_loras=2, max_rank=4)
    assert {layer.lora_a.dtype for layer in layers.values()} == {torch.float32}


def _reference_w8a8(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row rounded to e4m3 by its own absmax / 448 (in float32, as ``w8a8`` promises), then a float64 matmul
    on the dequantized operands."""
    s = x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX
    xq = (x.float() / s).to(FP8).double() * s.double()
    return xq @ (w8.double() * scale.double()[:, None]).T


@pytest.mark.parametrize("rows", [1, 3, 7, 133])
def test_w8a8_scales_each_token_by_its_own_absmax(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen) * torch.rand(rows, 1, generator=gen) * 10  # rows of other magnitudes
    w8, scale = quantize(torch.randn(48, 96, generator=gen))
    ours = w8a8(x, w8, scale, None)
    reference = _reference_w8a8(x, w8, scale)
    # float32 accumulation of the same e4m3 products, then rounded once to float32
    scale_sum = (x.abs() @ dequantize(w8, scale, torch.float32).abs().T).double()
    assert ((ours.double() - reference).abs() <= sum_atol(96, 1.0) * scale_sum + eps(torch.float32) *
            reference.abs()).all()
    alone = w8a8(x[-1:], w8, scale, None)  # a row's quantization is its own: alone, the same up to summation order
    assert torch.allclose(alone, ours[-1:], rtol=2 * eps(torch.float32), atol=sum_atol(96, scale_sum[-1].max()))


def test_weight_only_is_the_matmul_on_dequantized_weights():
    gen = torch.Generator().manual_seed(0)
    x, bias = torch.randn(7, 64, generator=gen), torch.randn(32, generator=gen)
    w8, scale = quantize(torch.randn(32, 64, generator=gen))
    dense = dequantize(w8, scale, torch.float32)
    scale_sum = float((x.abs() @ dense.abs().T).max())
    torch.testing.assert_close(weight_only(x, w8, scale, bias), torch.nn.functional.linear(x, dense, bias),
                               rtol=2 * eps(torch.float32), atol=sum_atol(64, scale_sum))


# ---- refused at start-up -----------------------------------------------------------------------------


def _with_quantization(base_dir, tmp_path, config: dict, **kwargs):
    return write_fp8(base_dir, tmp_path / "fp8", config, **kwargs)


@pytest.mark.parametrize(("config", "named"), [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    (plain_fp8_config(weight_block_size=[128, 128]), r"block-wise scales \(weight_block_size \[128, 128\]\)"),
    (compressed_tensors_config("block"), "block-wise and group-wise"),
    (compressed_tensors_config() | {"format": "pack-quantized"}, "format 'pack-quantized'"),
    (compressed_tensors_config() | {"sparsity_config": {"format": "sparse-24-bitmask"}},
     "sparsity format 'sparse-24-bitmask'"),
    ({**compressed_tensors_config(), "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 8,
                                                                               "strategy": "channel"}}}}, "not FP8"),
])
def test_a_scheme_this_pod_does_not_read_is_refused_naming_it_and_what_is_supported(base_dir, tmp_path, config,
                                                                                    named):
    fp8_dir = _with_quantization(base_dir, tmp_path, config)
    for setting in ("auto", "fp8"):
        with pytest.raises(ModelLoadError, match=named) as refused:
            load_model(fp8_dir, quantization=setting)
        assert "supported: compressed-tensors FP8" in str(refused.value)


def test_a_missing_scale_is_refused_naming_the_tensor(base_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8_dir = _with_quantization(base_dir, tmp_path, compressed_tensors_config())
    tensors = load_file(fp8_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, fp8_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks model\.layers\.1\.self_attn\.k_proj\.weight_scale, the scale "
                                             r"of the FP8 weight model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(fp8_dir)


@pytest.mark.parametrize(("shape", "value", "named"), [
    ((48, 1), 1.0, r"has shape \(48, 1\); a weight of 96 rows"),  # gate_proj's scale given half its rows
    ((3, 2), 1.0, r"has shape \(3, 2\)"),  # a block-wise grid
    ((96, 1), float("nan"), "holds NaN, infinite, zero or negative"),
    ((1,), float("inf"), "holds NaN, infinite, zero or negative"),
    ((1,), 0.0, "holds NaN, infinite, zero or negative"),
])
def test_a_bad_scale_is_refused_naming_the_tensor(base_dir, tmp_path, shape, value, named):
    from safetensors.torch import load_file, save_file

    fp8_dir = _with_quantization(base_dir, tmp_path, compressed_tensors_config())
    tensors = load_file(fp8_dir / "model.safetensors")
    tensors["model.layers.0.mlp.gate_proj.weight_scale"] = torch.full(shape, value)
    save_file(tensors, fp8_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=f"scale model.layers.0.mlp.gate_proj.weight_scale {named}"):
        load_model(fp8_dir)


def test_fp8_weights_without_a_quantization_config_are_refused(base_dir, tmp_path):
    fp8_dir = _with_quantization(base_dir, tmp_path, compressed_tensors_config())
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="is FP8, but only the projections' weights may be, in a checkpoint "
                                             "whose config.json says how it is quantized"):
        load_model(fp8_dir)


def test_w8a8_is_chosen_only_where_it_runs_and_agrees_with_weight_only(monkeypatch):
    from data_plane.model import quantization

    assert quantization.choose_compute("cpu", torch.float32)[0] is Fp8Compute.DEQUANTIZED
    assert quantization.w8a8_failure("cpu", torch.float32) is None  # torch's CPU _scaled_mm
    monkeypatch.setattr(quantization, "w8a8", lambda x, w8, scale, bias: weight_only(x, w8, scale, bias) * 1.5)
    assert "wrong results on a 1-row probe" in quantization.w8a8_failure("cpu", torch.float32)

    def unsupported(*args):
        raise RuntimeError("scaled_mm is not supported on this device\nmore")

    monkeypatch.setattr(quantization, "w8a8", unsupported)
    assert quantization.w8a8_failure("cpu", torch.float32) == ("row-wise scaled torch._scaled_mm does not run here: "
                                                               "scaled_mm is not supported on this device")


def test_a_checkpoint_storing_packed_projections_loads_its_fp8_weights_whole(tmp_path, chunked):
    # Phi-3 stores qkv_proj and gate_up_proj packed: one e4m3 weight and one scale for all of its slices.
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                        initializer_range=0.1)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    fp8_dir = write_fp8(tmp_path / "base", tmp_path / "fp8", compressed_tensors_config("tensor"), per_tensor=True)
    reference = _transformers_logits(write_dequantized(fp8_dir, tmp_path / "dequantized"))
    ours = _logits(load_model(fp8_dir, "float32"), chunked)
    assert (ours - reference).abs().max().item() < _atol(fp8_dir, reference)

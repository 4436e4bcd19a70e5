"""An FP8 KV cache on CPU (``--kv-cache-dtype fp8``): both CPU attention backends (the native kernel reading
the cache in place, tiled attention over gathered keys) read an e4m3 cache as ``kernels.reference`` does
(``e4m3 · scale``, then the same math) and write a step's keys and values quantized by their layer's scale;
the native kernel keeps a query's bits whatever shares its step; a cache element is one byte; the scales come
from the checkpoint where it carries them (compressed-tensors ``kv_cache_scheme``) and are refused, naming the
tensor, where they are not one finite positive number per layer; else they are calibrated at start-up."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_plane.errors import ModelLoadError
from data_plane.model import load_model, native_attention, row_rule
from data_plane.model.attention import KV_FP8, AttentionInputs, KVCache, quantize_kv, write_kv
from data_plane.model.kv_scales import (
    CALIBRATION_TEXT,
    HEADROOM,
    MIN_TOKENS,
    calibrate,
    calibration_ids,
    checkpoint_scales,
    power_of_two_scale,
    use_fp8_kv_cache,
)
from data_plane.model.torch_attention import TorchAttention
from kernels import reference
from tests.fp8_checkpoints import compressed_tensors_config, write_fp8
from tests.model.test_native_attention import BLOCK, _step

KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _backend(kind: str, window: int | None):
    if kind == "native":
        return native_attention.NativeAttention(native_attention.kernel())
    return TorchAttention({window})


@pytest.mark.parametrize("kind", ["native", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 32), (4, 4, 16)])
@pytest.mark.parametrize(("window", "softcap", "scales"), [
    (None, None, (2.0**-3, 2.0**-4)), (7, None, (0.37, 1.3)), (None, 30.0, (1.0, 1.0)), (20, 50.0, (2.0**-6, 4.0)),
])
def test_a_cpu_backend_reads_an_fp8_cache_as_the_reference_does(kind, dtype, heads, kv_heads, head_dim, window,
                                                                 softcap, scales):
    # STEP's decodes of odd lengths, prompt chunks over cached context, a padding sequence; NaN (e4m3's) in every
    # slot no query may read, for the native kernel (tiled attention multiplies the keys it gathers past a row's
    # context by zero weights: a pod's cache holds no NaN)
    inputs, q, k, v, k_cache, v_cache = _step(heads, kv_heads, head_dim, dtype, heads * head_dim + 7)
    if kind == "tiled":
        k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    k_scale, v_scale = scales
    k_cache, v_cache = quantize_kv(k_cache, k_scale), quantize_kv(v_cache, v_scale)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    got = _backend(kind, window).prepare(inputs)(q, k, v, k_cache, v_cache, window, head_dim**-0.5, softcap,
                                                 k_scale, v_scale)
    # the step's keys and values written quantized by their scales, nothing else touched
    expected_k[inputs.slot_mapping], expected_v[inputs.slot_mapping] = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    want = torch.zeros(q.shape[0], heads, head_dim)
    reference.paged_attention(q, expected_k, expected_v, inputs.block_tables, inputs.seq_lens, inputs.query_start,
                              want, block_size=BLOCK, scale=head_dim**-0.5, window=window,
                              max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len, softcap=softcap,
                              k_scale=k_scale, v_scale=v_scale)
    assert got.dtype == dtype and not got.isnan().any()
    # both read the same dequantized floats as the reference: float32 sums in another order (scores to ~|q||k|
    # over 150 keys), one rounding to dtype; values up to 448 · v_scale
    v_max = float((expected_v.float() * v_scale).nan_to_num().abs().max())
    atol = (2e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps) * max(1.0, v_max)
    torch.testing.assert_close(got.float(), want.view(q.shape[0], -1).to(dtype).float(), atol=atol, rtol=atol)


def test_the_native_kernel_reads_every_e4m3_byte_exactly_times_its_scale():
    # one query over one key (slot 0 of a block of 16): the output is that key's value row, here the 256 e4m3
    # values (NaN, subnormals and ±448 included) times the scale, each rounded once as torch rounds it
    values = torch.arange(256, dtype=torch.uint8).view(KV_FP8).view(1, 1, 256)  # one head of 256
    inputs = AttentionInputs(torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32),
                             torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1, 1, 16)
    step = native_attention.NativeAttention(native_attention.kernel()).prepare(inputs)
    for scale in (1.0, 0.37, 2.0**-5):
        cache = torch.zeros(16, 1, 256, dtype=KV_FP8)
        # the step writes its key and value first: these quantize back to the same bytes
        got = step(torch.zeros(1, 1, 256), torch.zeros(1, 1, 256), values.float() * scale, cache.clone(), cache,
                   None, 1.0, None, 1.0, scale)
        want = values.float().view(1, 256) * scale
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), scale


def test_the_native_kernel_keeps_a_querys_bits_over_an_fp8_cache():
    for head_dim, per_kv in ((64, 3), (32, 4)):
        assert row_rule._native_breaks(KV_FP8, head_dim, per_kv) is None
    assert native_attention.unusable(KV_FP8, 64) == ""


def test_a_write_divides_by_the_scale_rounds_to_nearest_and_saturates_at_448():
    cache = torch.zeros(8, 1, 4, dtype=KV_FP8)
    x = torch.tensor([[[0.5, -300.0, 1000.0, 0.26]], [[float("nan"), -1e9, 0.0, 7.0]]])
    write_kv(cache, torch.tensor([5, 2]), x, 0.5)
    assert cache[5, 0].float().tolist() == [1.0, -448.0, 448.0, 0.5]  # 0.52 -> 0.5 (e4m3 step 1/16 there)
    assert math.isnan(cache[2, 0, 0].float()) and cache[2, 0, 1:].float().tolist() == [-448.0, 0.0, 14.0]
    assert not cache[[0, 1, 3, 4, 6, 7]].float().any()


def test_an_fp8_cache_takes_one_byte_an_element_and_its_scales():
    assert KVCache.bytes_per_block(30, 16, 3, 64, KV_FP8) * 2 == KVCache.bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    assert KVCache.bytes_per_block(30, 16, 3, 64, KV_FP8) == 2 * 30 * 16 * 3 * 64
    cache = KVCache(2, 4, 16, 3, 64, KV_FP8, "cpu", ((0.5, 1.0), (2.0, 4.0)))
    assert cache.k.element_size() == 1 and cache.k_scales == (0.5, 1.0) and cache.v_scales == (2.0, 4.0)
    with pytest.raises(ValueError, match="scales"):
        KVCache(2, 4, 16, 3, 64, KV_FP8, "cpu")


def test_calibrated_scales_are_powers_of_two_with_headroom():
    for amax in (1e-3, 0.7, 3.0, 17.5, 224.0, 300.0, 5000.0):
        scale = power_of_two_scale(amax)
        assert math.log2(scale).is_integer() and HEADROOM * amax <= 448 * scale < 2 * HEADROOM * amax
    assert power_of_two_scale(0.0) == 1.0


def _with_kv_scales(src, dst, scales: dict[str, torch.Tensor], scheme: dict | None = KV_SCHEME):
    """``src``'s checkpoint with extra tensors ``scales`` and, unless None, a compressed-tensors quantization_config
    that quantizes its KV cache only."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(load_file(src / "model.safetensors") | scales, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if scheme is not None:
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense",
                                         "config_groups": {}, "kv_cache_scheme": scheme}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _layer_scales(k: tuple[float, float], v: tuple[float, float], old_names: bool = False) -> dict:
    name = "model.layers.{}.self_attn.{}_proj.output_scale" if old_names else "model.layers.{}.self_attn.{}_scale"
    return {name.format(i, w): torch.tensor(s) for w, pair in (("k", k), ("v", v)) for i, s in enumerate(pair)}


@pytest.mark.parametrize("old_names", [False, True])
def test_a_checkpoints_kv_scales_are_read_as_published(base_dir, tmp_path, old_names):
    model_dir = _with_kv_scales(base_dir, tmp_path / "kv", _layer_scales((0.02, 0.03), (0.5, 0.25), old_names))
    scales = checkpoint_scales(model_dir, 2)
    assert (scales.k, scales.v, scales.source) == ((0.019999999552965164, 0.029999999329447746), (0.5, 0.25),
                                                   "checkpoint")
    model = load_model(model_dir, "float32")  # the weights load as unquantized, the KV scales left to kv_scales
    assert model.quantization == "" and model.kv_dtype is None
    use_fp8_kv_cache(model, model_dir, list(range(3, 40)))
    assert model.kv_scales == (scales.k, scales.v) and model.precision_name == "float32+kv-fp8"
    cache = model.new_kv_cache(4, 16)
    assert cache.k.dtype == KV_FP8 and cache.k_scales == scales.k


def test_an_fp8_weight_checkpoints_static_kv_scales_serve_its_kv_cache(base_dir, tmp_path):
    config = compressed_tensors_config("tensor") | {"kv_cache_scheme": KV_SCHEME}
    fp8_dir = write_fp8(base_dir, tmp_path / "fp8", config, per_tensor=True, static=True)  # k/v_scale 0.1 a layer
    model = load_model(fp8_dir, "float32")
    use_fp8_kv_cache(model, fp8_dir, [])
    assert model.kv_scales == ((pytest.approx(0.1),) * 2,) * 2 and model.precision_name == "float32+fp8+kv-fp8"


@pytest.mark.parametrize(("scales", "scheme", "match"), [
    (_layer_scales((0.1, float("nan")), (0.1, 0.1)), KV_SCHEME, r"model\.layers\.1\.self_attn\.k_scale is nan"),
    (_layer_scales((0.1, 0.1), (float("inf"), 0.1)), KV_SCHEME, r"layers\.0\.self_attn\.v_scale is inf"),
    (_layer_scales((0.0, 0.1), (0.1, 0.1)), KV_SCHEME, r"layers\.0\.self_attn\.k_scale is 0\.0"),
    (_layer_scales((0.1, 0.1), (0.1, -2.0)), None, r"layers\.1\.self_attn\.v_scale is -2\.0"),
    (_layer_scales((0.1, 0.1), (0.1, 0.1)) | {"model.layers.0.self_attn.k_scale": torch.ones(2)}, KV_SCHEME,
     r"k_scale has shape \(2,\); only one scale per layer"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(0.1)}, None, r"lacks 3 of them, e\.g\. layer 0 v_scale"),
    ({}, KV_SCHEME, "names a kv_cache_scheme but lacks 4"),
    ({}, KV_SCHEME | {"strategy": "attn_head"}, "strategy 'attn_head' is not read"),
    ({}, KV_SCHEME | {"num_bits": 4, "type": "int"}, "int 4-bit"),
])
def test_bad_kv_scales_are_refused_at_start_up_naming_what_to_fix(base_dir, tmp_path, scales, scheme, match):
    model_dir = _with_kv_scales(base_dir, tmp_path / "bad", scales, scheme)
    model = load_model(model_dir, "float32")
    with pytest.raises(ModelLoadError, match=match) as refused:
        use_fp8_kv_cache(model, model_dir, list(range(3, 40)))
    assert "--kv-cache-dtype fp8" in str(refused.value) or "export it again" in str(refused.value)
    assert model.kv_dtype is None


def test_without_checkpoint_scales_the_pod_calibrates_and_the_logits_stay_close(base_dir, chunked):
    ids = [(7 * i + 3) % 128 for i in range(90)]
    model = load_model(base_dir, "float32")
    exact = chunked(model, ids, [len(ids)])
    calibration = list(range(3, 100))
    with torch.inference_mode():
        calibrated = calibrate(model, calibration)
    scales = use_fp8_kv_cache(model, base_dir, calibration)
    assert scales == calibrated and scales.source == "calibrated" and model.precision_name == "float32+kv-fp8"
    assert all(math.log2(s).is_integer() and s < 1 for s in scales.k + scales.v)  # this model's keys are small
    fp8 = chunked(model, ids, [len(ids)])
    # e4m3 keeps 3 mantissa bits (relative error up to 1/16): logits move a little, the greedy choice barely
    assert 0 < (fp8 - exact).abs().max() < 0.1 * exact.abs().max()
    assert (fp8.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.8  # a random model: close top-2 logits


def test_the_calibration_text_tokenizes_to_a_few_hundred_tokens(demo_tokenizer):
    ids = demo_tokenizer.encode(CALIBRATION_TEXT)
    assert MIN_TOKENS <= len(ids) <= 400 and calibration_ids(ids, 49152) == ids


def test_a_tokenizer_that_makes_little_of_the_text_is_helped_out_by_the_vocabulary():
    # a word-level tokenizer may make the whole text one unknown token: the prefill still has MIN_TOKENS
    ids = calibration_ids([0], 256)
    assert len(ids) == MIN_TOKENS and ids[0] == 0 and len(set(ids[1:])) == MIN_TOKENS - 1
    assert all(0 <= i < 256 for i in ids)

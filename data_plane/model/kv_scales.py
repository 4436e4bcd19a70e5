"""The FP8 KV cache's scales (``--kv-cache-dtype fp8``): per layer, one for its keys and one for its values.

The cache holds ``key / k_scale`` and ``value / v_scale`` rounded to e4m3 and saturated to ±448
(``attention.write_kv``); attention reads them back as ``e4m3 · scale``. A scale says where e4m3's 3-bit
mantissa and its range, 2^-9 to 448, fall on the layer's numbers: a key past ``448 · k_scale`` is clipped,
one under ``2^-6 · k_scale`` loses mantissa bits. Where the scales come from, in order:

1. **The checkpoint**, where it carries them: compressed-tensors' ``kv_cache_scheme`` (llm-compressor: 8-bit
   float, per tensor) with a ``k_scale`` and a ``v_scale`` per attention layer
   (``model.layers.N.self_attn.k_scale``; older exports name them ``k_proj.output_scale`` and
   ``v_proj.output_scale``), read as published (``x ≈ e4m3 · scale``). Every layer must have both, finite and
   positive, one value each; anything else is refused at start-up, naming the tensor. A checkpoint's scales
   are the same on every pod that loads it.
2. **Otherwise calibrated at start-up** (``calibrate``): one prefill of ``CALIBRATION_TEXT`` (a fixed text of
   prose, code and figures; where the model's tokenizer makes fewer than ``MIN_TOKENS`` of it, followed by token
   ids spread evenly over the vocabulary, ``calibration_ids``) through the model in the pod's precision, with a
   cache in the model's dtype; each layer's scale is the power of two at or above ``HEADROOM · amax / 448`` of
   the keys (values) it wrote. e4m3's error is relative (3 mantissa bits: 1/16 at most) over its normal range,
   ``2^-6 · scale`` to ``448 · scale``; under it a value keeps an absolute error of at most ``2^-10 · scale``,
   past it a value is clipped, the one error that grows without bound. So the headroom is generous: the
   keys and values of other prompts, and of adapters (a LoRA on k_proj or v_proj moves them; the calibration
   runs the base model), may reach past the calibration's amax, and 16x to 32x of room costs a value under
   ``amax / 1000`` an absolute error of at most ``amax · 7e-5`` (on the tiny test model with random adapters,
   a first token's 3 most likely log-probabilities moved by up to 0.124 with 2x of room, 0.057 with 16x). A
   power of two makes ``e4m3 · scale`` exact in every dtype (bfloat16 included) and the division by it exact
   before the rounding, and a scale changes only where a layer's amax crosses a power of two: pods of one
   model agree on their scales even where their devices' arithmetic differs by a rounding.

vLLM's default is 1.0 for every layer (no calibration): ``448`` is then the clip, and a model whose keys
stay near 1-20 (most) keeps them in e4m3's normal range, but a small value loses bits and a model with
larger keys or values (Qwen2's k biases reach hundreds) is clipped. Calibrating costs one prefill of ~200
tokens at start-up and fits each layer, with far more room than clipping needs at the top.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from data_plane.errors import ModelLoadError
from data_plane.model.attention import KV_FP8, KV_FP8_MAX, AttentionInputs
from data_plane.model.llama import ForwardBatch, LlamaForCausalLM
from data_plane.model.loader import checkpoint_files

log = logging.getLogger("lorafleet.model")

HEADROOM = 16.0  # calibrated scales leave keys and values at least this many times the calibration amax
MIN_TOKENS = 128  # the fewest tokens a calibration prefill runs
_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$")

CALIBRATION_TEXT = """\
The committee met on Tuesday to review the budget for the coming year. Spending on roads rose by 4.5% to \
12,800,000, while the library's grant was cut from 310,000 to 275,500. Several members asked why the \
figures had changed since March; the treasurer answered that two contracts had been signed late.
def moving_average(values, width=3):
    return [sum(values[i:i + width]) / width for i in range(len(values) - width + 1)]
Q: What is the boiling point of water at sea level? A: 100 degrees Celsius, or 212 degrees Fahrenheit.
<|im_start|>user
Translate "good morning, how are you?" into French and Spanish.<|im_end|>
<|im_start|>assistant
Bonjour, comment allez-vous ? / Buenos días, ¿cómo estás?<|im_end|>
"""


@dataclass(frozen=True)
class KvScales:
    """Each layer's k and v scale, and where they came from ("checkpoint" or "calibrated")."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str

    def describe(self) -> dict:
        """The fields of the pod's "kv cache" log line."""
        return {"kv_cache_dtype": "fp8", "kv_scales": self.source, "k_scales": list(self.k), "v_scales": list(self.v)}


def kv_cache_scheme(model_dir: Path) -> dict | None:
    """The checkpoint's compressed-tensors ``kv_cache_scheme``, or None. Raises ModelLoadError, saying what is
    read, for a scheme that is not 8-bit float per tensor."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
    scheme = quant.get("kv_cache_scheme") if isinstance(quant, dict) else None
    if not scheme:
        return None
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8 or scheme.get("strategy", "tensor") != "tensor" \
            or scheme.get("dynamic") or scheme.get("symmetric") is False:
        raise ModelLoadError(
            f"{model_dir}/config.json: kv_cache_scheme {scheme.get('type')} {scheme.get('num_bits')}-bit, strategy "
            f"{scheme.get('strategy')!r}{', dynamic' if scheme.get('dynamic') else ''} is not read with "
            "--kv-cache-dtype fp8 (only static, symmetric 8-bit float scales per tensor: a k_scale and a v_scale "
            "per layer); run without --kv-cache-dtype fp8")
    return scheme


def checkpoint_scales(model_dir: Path, num_layers: int) -> KvScales | None:
    """The scales the checkpoint in ``model_dir`` carries for its ``num_layers`` layers, or None where it
    carries none. Raises ModelLoadError, naming the tensor, for a scale that is not one finite positive number,
    and for a checkpoint that names a ``kv_cache_scheme`` or carries some scales but not every layer's."""
    model_dir = Path(model_dir)
    scheme = kv_cache_scheme(model_dir)
    found: dict[tuple[str, int], float] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                match = _SCALE.search(name)
                if not match:
                    continue
                layer, which = int(match.group(1)), match.group(2) or match.group(3)
                found[which, layer] = _scale_value(f.get_tensor(name), name, path)
    if not found and scheme is None:
        return None
    missing = [f"layer {i} {w}_scale" for i in range(num_layers) for w in "kv" if (w, i) not in found]
    if missing:
        why = "names a kv_cache_scheme" if scheme is not None else "carries KV-cache scales"
        raise ModelLoadError(f"{model_dir}: the checkpoint {why} but lacks {len(missing)} of them, e.g. "
                             f"{', '.join(missing[:4])}; export it again with every attention layer's k_scale and "
                             "v_scale, or remove them (the pod then calibrates its own)")
    return KvScales(tuple(found["k", i] for i in range(num_layers)), tuple(found["v", i] for i in range(num_layers)),
                    "checkpoint")


def _scale_value(tensor: torch.Tensor, name: str, path: Path) -> float:
    if tensor.numel() != 1:
        raise ModelLoadError(f"{path.name}: KV-cache scale {name} has shape {tuple(tensor.shape)}; only one scale "
                             "per layer is read (per tensor), not one per head or channel; run without "
                             "--kv-cache-dtype fp8, or export the checkpoint with per-tensor KV-cache scales")
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ModelLoadError(f"{path.name}: KV-cache scale {name} is {value}, not a finite positive number: the "
                             "checkpoint is damaged; download it again, or run without --kv-cache-dtype fp8")
    return value


def calibration_ids(text_ids: list[int], vocab_size: int) -> list[int]:
    """``text_ids`` (``CALIBRATION_TEXT``'s tokens), followed where they are fewer than ``MIN_TOKENS`` by ids
    spread evenly over the vocabulary (a tokenizer may make one unknown token of the whole text)."""
    missing = MIN_TOKENS - len(text_ids)
    return text_ids + [int(i * vocab_size / missing) for i in range(missing)] if missing > 0 else text_ids


def power_of_two_scale(amax: float) -> float:
    """The power of two at or above ``HEADROOM · amax / 448`` (1 for an amax of 0)."""
    if amax <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(HEADROOM * amax / KV_FP8_MAX))


def calibrate(model: LlamaForCausalLM, ids: list[int], block_size: int = 16) -> KvScales:
    """Scales from one prefill of ``ids`` through ``model`` (its KV cache still in the model's dtype):
    ``power_of_two_scale`` of each layer's keys' and values' amax. Raises ModelLoadError where a layer's keys
    or values are not finite."""
    device = model.head_weight.device
    n = len(ids)
    blocks = -(-n // block_size)
    cache = model.new_kv_cache(blocks, block_size)
    inputs = AttentionInputs(
        slot_mapping=torch.arange(n, device=device), block_tables=torch.arange(blocks, dtype=torch.int32,
                                                                               device=device)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start=torch.tensor([0, n], dtype=torch.int32, device=device), max_query_len=n, max_seq_len=n,
        block_size=block_size)
    with torch.inference_mode():
        model(ForwardBatch(torch.tensor(ids, device=device), torch.arange(n, device=device), inputs, cache))
        k_amax = cache.k[:, :n].abs().amax(dim=(1, 2, 3)).float().tolist()  # [layers]
        v_amax = cache.v[:, :n].abs().amax(dim=(1, 2, 3)).float().tolist()
    for layer, (k, v) in enumerate(zip(k_amax, v_amax, strict=True)):
        if not (math.isfinite(k) and math.isfinite(v)):
            raise ModelLoadError(f"calibrating the FP8 KV cache: layer {layer}'s keys or values are not finite "
                                 f"(amax {k}, {v}); the model's weights are damaged, or run without "
                                 "--kv-cache-dtype fp8")
    return KvScales(tuple(map(power_of_two_scale, k_amax)), tuple(map(power_of_two_scale, v_amax)), "calibrated")


def unsupported(model: LlamaForCausalLM) -> str:
    """Why ``model``'s device cannot run an FP8 KV cache ("" where it can). On CPU both attention backends
    read one. On CUDA the Triton kernel must convert e4m3 (compute capability 8.9+) and pass
    ``kernel_failure``'s probe."""
    device = model.head_weight.device
    if device.type != "cuda":
        return ""
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return (f"compute capability {capability[0]}.{capability[1]} has no float8_e4m3fn conversions in Triton; "
                "an FP8 KV cache needs 8.9+ (L4, L40S, H100, H200)")
    return kernel_failure(model, device)


def kernel_failure(model: LlamaForCausalLM, device: torch.device | str) -> str:
    """Why the Triton attention kernel cannot serve ``model`` over an FP8 KV cache on ``device`` ("" where it
    can): tried once on a small cache of the model's own heads, in its dtype (a decode beside a 4-token chunk,
    scales 0.5 and 2), it must run and agree with ``kernels.reference``."""
    from kernels import reference  # Triton: the `cuda` extra
    from kernels.paged_attention import paged_attention

    c, dtype = model.config, model.embed_tokens.weight.dtype
    gen = torch.Generator(device=device).manual_seed(0)
    k_cache, v_cache = (torch.randn(64, c.num_kv_heads, c.head_dim, device=device, generator=gen).to(KV_FP8)
                        for _ in range(2))
    q = torch.randn(5, c.num_heads, c.head_dim, device=device, generator=gen).to(dtype)
    tables = torch.arange(4, dtype=torch.int32, device=device).view(2, 2)
    lens = torch.tensor([30, 9], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 1, 5], dtype=torch.int32, device=device)
    got, want = torch.empty_like(q), torch.zeros_like(q)
    args = dict(block_size=16, scale=c.head_dim**-0.5, window=None, max_query_len=4, max_seq_len=30, k_scale=0.5,
                v_scale=2.0)
    try:
        paged_attention(q, k_cache, v_cache, tables, lens, starts, got, **args)
    except Exception as e:  # noqa: BLE001 - any failure to compile or run means the device cannot
        return f"the Triton attention kernel does not run an FP8 KV cache here: {str(e).splitlines()[0]}"
    # the reference on the caches' float values (the same numbers; no float8 indexing needed)
    reference.paged_attention(q, k_cache.float(), v_cache.float(), tables, lens, starts, want, **args)
    if not torch.allclose(got.float(), want.float(), rtol=0.05, atol=0.05):
        return "the Triton attention kernel gave wrong results over an FP8 KV cache on a probe"
    return ""


def use_fp8_kv_cache(model: LlamaForCausalLM, model_dir: Path, text_ids: list[int]) -> KvScales:
    """Makes ``model`` keep its KV cache in float8_e4m3fn with the checkpoint's scales, else scales calibrated
    on ``text_ids`` (the tokens of ``CALIBRATION_TEXT``, ``calibration_ids``), and returns them, logged. Raises
    ModelLoadError, saying what to fix, where the device cannot run it or the checkpoint's scales are bad."""
    why = unsupported(model)
    if why:
        raise ModelLoadError(f"--kv-cache-dtype fp8 cannot run here: {why}; run without --kv-cache-dtype fp8")
    scales = (checkpoint_scales(model_dir, model.config.num_layers)
              or calibrate(model, calibration_ids(text_ids, model.config.vocab_size)))
    model.use_kv_cache(KV_FP8, (scales.k, scales.v))
    log.info("kv cache", extra=scales.describe())
    return scales

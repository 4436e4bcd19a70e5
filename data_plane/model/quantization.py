"""FP8 (e4m3) base weights: the checkpoint layouts a pod reads, on-the-fly quantization, and the matmul a
quantized projection runs.

Layouts read as published, detected from config.json's ``quantization_config``:

- ``compressed-tensors`` (llm-compressor; the FP8 Llama/Qwen checkpoints on the Hub), format
  ``float-quantized``: every config group's weights 8-bit float, symmetric, ``tensor`` or ``channel``
  strategy; input activations none, dynamic per token, or static per tensor; ``ignore`` names (or
  ``re:`` patterns) the modules left unquantized;
- ``fp8`` (transformers' FineGrainedFP8 without ``weight_block_size``) and ``fbgemm_fp8``: e4m3 weights
  with a ``weight_scale`` each, ``modules_to_not_convert``/``ignored_layers`` left unquantized.

Each quantized weight ``W`` [out, in] is stored as float8_e4m3fn with ``W ≈ W8 · scale``, scale per
tensor (shape () or (1,)) or per output channel ((out,) or (out, 1)). A packed projection (q/k/v,
gate/up) gathers slices that each carry their own scale, so its scale is always per output row (a
per-tensor scale is repeated over its slice's rows). ``--quantization fp8`` quantizes a bf16/fp32
checkpoint's projection weights per output channel at load: scale = max|row| / 448, W8 = W / scale
rounded to e4m3. A checkpoint's static input scales are not used: activations are scaled per token at
run time (a row's scale is its own, so a row's result does not depend on the other rows of its step); its
KV-cache scales serve an FP8 KV cache where the pod is given ``--kv-cache-dtype fp8`` (``kv_scales``), and a
compressed-tensors checkpoint that quantizes only its KV cache (a ``kv_cache_scheme``, no config groups) has
unquantized weights.

How a quantized projection computes (``Fp8Compute``, chosen once at start-up for the device):

- ``DEQUANTIZED`` (CPU): the weights are dequantized once at load, ``W8.float() · scale`` rounded to the
  pod's dtype, and run through the pod's own linear path (cpu_linear's fixed row tiles): the numbers of
  the FP8 weights with the batch invariance of every other CPU precision;
- ``W8A8`` (CUDA, sm_89+ where ``torch._scaled_mm`` runs row-wise scales): FP8 weights in device memory,
  each token's activations quantized to e4m3 by its own absmax, one FP8 tensor-core matmul scaled by
  token × channel, accumulated in float32;
- ``WEIGHT_ONLY`` (other GPUs): FP8 weights in device memory, converted to the activations' dtype in the
  matmul's input and the output scaled per channel: the FP8 weights' numbers, bf16 tensor cores.
"""

from __future__ import annotations

import enum
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from data_plane.errors import ModelLoadError

log = logging.getLogger("lorafleet.model")

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
QUANTIZATION_CHOICES = ("auto", "fp8")  # what --quantization accepts
SUPPORTED = ("compressed-tensors FP8 (format float-quantized, per-tensor or per-channel e4m3 weights), "
             "quant_method fp8 or fbgemm_fp8 with per-tensor or per-channel weight_scale; "
             "or an unquantized checkpoint, with --quantization fp8 to quantize it at load")
_PLAIN_FP8 = ("fp8", "fbgemm_fp8")


class Fp8Compute(enum.Enum):
    """How a quantized projection computes on this pod (see the module docstring)."""

    DEQUANTIZED = "dequantized"
    W8A8 = "w8a8"
    WEIGHT_ONLY = "weight-only"


@dataclass(frozen=True)
class Fp8Scheme:
    """An FP8 base: where it comes from and which modules stay unquantized."""

    source: str  # "compressed-tensors", "fp8", "fbgemm_fp8", or "--quantization fp8" (quantized at load)
    activations: str  # what the checkpoint says of its input activations, for the log
    ignore: tuple[str, ...] = ()  # module names, or "re:" patterns, of the modules left unquantized

    @property
    def prequantized(self) -> bool:
        return not self.source.startswith("--")

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint keeps ``module`` (its HF name, e.g. ``model.layers.0.mlp.down_proj``)
        unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry) or entry.endswith("." + module):
                return True
        return False


def scheme_of(model_dir: Path, setting: str = "auto") -> Fp8Scheme | None:
    """The FP8 scheme of the checkpoint in ``model_dir`` with ``--quantization setting``, or None for an
    unquantized base. Raises ModelLoadError, naming the scheme and what is supported, for a quantization
    this pod does not read."""
    if setting not in QUANTIZATION_CHOICES:
        raise ModelLoadError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, not {setting!r}")
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raw = {}  # ModelConfig.from_dir reports a missing or malformed config.json
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not quant:
        return Fp8Scheme("--quantization fp8", "dynamic per token") if setting == "fp8" else None
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{model_dir}/config.json: quantization_config is not an object")
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        scheme = _compressed_tensors(quant, model_dir)
        return scheme or (Fp8Scheme("--quantization fp8", "dynamic per token") if setting == "fp8" else None)
    if method in _PLAIN_FP8:
        return _plain_fp8(quant, method, model_dir)
    raise ModelLoadError(f"{model_dir}: the checkpoint is quantized with quant_method {method!r}, which this pod "
                         f"does not read; supported: {SUPPORTED}")


def _refuse(model_dir: Path, what: str) -> ModelLoadError:
    return ModelLoadError(f"{model_dir}/config.json: {what}; supported: {SUPPORTED}")


def _compressed_tensors(quant: dict, model_dir: Path) -> Fp8Scheme | None:
    sparsity = (quant.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense":
        raise _refuse(model_dir, f"compressed-tensors sparsity format {sparsity!r} is not read")
    groups = quant.get("config_groups") or {}
    if not groups and quant.get("kv_cache_scheme"):
        return None  # the KV cache's scales only (kv_scales.py): the weights are unquantized
        raise _refuse(model_dir, "compressed-tensors quantization_config has no config_groups")
    activations = set()
    for name, group in groups.items():
        fmt = group.get("format") or quant.get("format")  # per group where the top level says mixed-precision
        if fmt != "float-quantized":
            raise _refuse(model_dir, f"compressed-tensors format {fmt!r} is not read (only float-quantized)")
        w = group.get("weights") or {}
        scheme = f"group {name!r}: weights {w.get('type')} {w.get('num_bits')}-bit, strategy {w.get('strategy')!r}"
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise _refuse(model_dir, f"compressed-tensors {scheme} is not FP8")
        if w.get("strategy") not in ("tensor", "channel"):
            raise _refuse(model_dir, f"compressed-tensors {scheme}: block-wise and group-wise FP8 scales are not "
                                     "read (per-tensor or per-channel only)")
        if w.get("symmetric") is False or w.get("dynamic"):
            raise _refuse(model_dir, f"compressed-tensors {scheme}: asymmetric or dynamic weights are not read")
        a = group.get("input_activations")
        if a is not None and (a.get("type") != "float" or a.get("num_bits") != 8
                              or a.get("strategy") not in ("token", "tensor")):
            raise _refuse(model_dir, f"compressed-tensors group {name!r}: input activations {a.get('type')} "
                                     f"{a.get('num_bits')}-bit by {a.get('strategy')!r} are not read")
        if group.get("output_activations") is not None:
            raise _refuse(model_dir, f"compressed-tensors group {name!r}: quantized output activations are not read")
        activations.add("none (weight-only)" if a is None else "dynamic per token" if a.get("dynamic")
                        else "static per tensor (scaled per token here)")
    return Fp8Scheme("compressed-tensors", ", ".join(sorted(activations)), tuple(quant.get("ignore") or ()))


def _plain_fp8(quant: dict, method: str, model_dir: Path) -> Fp8Scheme:
    block = quant.get("weight_block_size")
    if block:
        raise _refuse(model_dir, f"quant_method {method} with block-wise scales (weight_block_size {block}) is not "
                                 "read (per-tensor or per-channel weight_scale only)")
    ignore = tuple(quant.get("modules_to_not_convert") or ()) + tuple(quant.get("ignored_layers") or ())
    scheme = quant.get("activation_scheme", "dynamic")
    return Fp8Scheme(method, "dynamic per token" if scheme == "dynamic" else f"{scheme} (scaled per token here)",
                     ignore)


def choose_compute(device: torch.device | str, dtype: torch.dtype) -> tuple[Fp8Compute, str]:
    """How quantized projections compute on ``device`` for activations in ``dtype``, and why (for the log):
    dequantized on CPU; W8A8 on a GPU of compute capability 8.9+ where a row-wise scaled ``torch._scaled_mm``
    runs and agrees with weight-only on small matmuls of 1 and 17 rows (tried here once); weight-only elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return Fp8Compute.DEQUANTIZED, ("CPU: weights dequantized once at load to the pod's dtype, run through the "
                                        "fixed-tile linear path (batch-invariant)")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return Fp8Compute.WEIGHT_ONLY, f"compute capability {capability[0]}.{capability[1]} has no FP8 tensor cores"
    failure = w8a8_failure(device, dtype)
    if failure:
        return Fp8Compute.WEIGHT_ONLY, failure
    return Fp8Compute.W8A8, f"compute capability {capability[0]}.{capability[1]}: FP8 tensor cores"


def w8a8_failure(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why ``w8a8`` cannot serve activations in ``dtype`` on ``device``, or None: it must run and agree with
    ``weight_only`` (up to the activations' e4m3 rounding) on matmuls of 1 and 17 rows."""
    gen = torch.Generator(device=device).manual_seed(0)
    w8, scale = quantize(torch.randn(32, 64, device=device, generator=gen))
    for rows in (1, 17):  # a decode row and an odd count: the kernel must take any step's rows
        x = torch.randn(rows, 64, device=device, generator=gen).to(dtype)
        try:
            got = w8a8(x, w8, scale, None).float()
        except (RuntimeError, NotImplementedError) as e:
            return f"row-wise scaled torch._scaled_mm does not run here: {str(e).splitlines()[0]}"
        expected = weight_only(x.float(), w8, scale, None)
        if not torch.allclose(got, expected, rtol=0.1, atol=0.1 * float(expected.abs().max())):
            return f"row-wise scaled torch._scaled_mm gave wrong results on a {rows}-row probe"
    return None


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] quantized per output channel: (e4m3 [out, in], float32 scale [out]) with
    ``weight ≈ w8.float() * scale[:, None]``; an all-zero row gets scale 1."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w8.float() * scale[:, None]`` rounded once to ``dtype``."""
    return (w8.float() * scale.float()[:, None]).to(dtype)


def w8a8(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (w8 · scale)ᵀ + bias`` in ``x``'s dtype with FP8 activations: each row of ``x`` [..., in] is
    scaled by its own absmax / 448 and rounded to e4m3, the products of e4m3 operands summed in float32 and
    scaled by row × channel (``torch._scaled_mm``, row-wise scales). ``w8`` [out, in] e4m3, ``scale`` [out]
    float32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [rows, 1]
    xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    y = torch._scaled_mm(xq, w8.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], y.shape[-1])


def weight_only(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (w8 · scale)ᵀ + bias`` in ``x``'s dtype: ``w8`` converted to ``x``'s dtype (exact: e4m3 values are
    bfloat16 and float16 values) as the matmul's operand, the output scaled per channel."""
    y = F.linear(x, w8.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias


@dataclass(frozen=True)
class Fp8Matmul:
    """A projection's FP8 weight on the device: its per-output-row scale and the matmul chosen at start-up.
    ``Projection.forward`` calls it with the e4m3 weight it holds."""

    scale: torch.Tensor  # [out] float32
    dtype: torch.dtype  # of the activations it takes and returns
    compute: Fp8Compute

    def __call__(self, x: torch.Tensor, w8: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        matmul = w8a8 if self.compute is Fp8Compute.W8A8 else weight_only
        return matmul(x, w8, self.scale, bias)


def slice_scale(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A checkpoint's ``weight_scale`` for a weight of ``rows`` output rows, as one float32 scale per row.
    Raises ModelLoadError, naming the tensor, for a shape that is neither per tensor nor per channel, or a
    scale that is not finite and positive."""
    shape = tuple(scale.shape)
    if shape in ((), (1,), (1, 1)):
        per_row = scale.reshape(1).float().expand(rows)
    elif shape in ((rows,), (rows, 1)):
        per_row = scale.reshape(rows).float()
    else:
        raise ModelLoadError(f"scale {name} has shape {shape}; a weight of {rows} rows takes a per-tensor scale "
                             f"(shape () or (1,)) or a per-channel one (({rows},) or ({rows}, 1)); block-wise "
                             "scales are not read")
    if not bool(torch.isfinite(per_row).all() and (per_row > 0).all()):
        raise ModelLoadError(f"scale {name} holds NaN, infinite, zero or negative values: the checkpoint is "
                             "damaged; download it again")
    return per_row.contiguous()


def describe(scheme: Fp8Scheme, compute: Fp8Compute, reason: str) -> dict:
    """The fields of the pod's "quantization" log line."""
    return {"quantization": "fp8", "source": scheme.source, "activations": scheme.activations,
            "ignored": list(scheme.ignore), "compute": compute.value, "reason": reason}

"""FP8 checkpoints made in the tests from an unquantized one, in the layouts published checkpoints use, and the
dequantized checkpoint (``w = w_fp8.float() * scale``) that transformers runs as the reference.

The quantization here is written independently of the pod's (``data_plane.model.quantization``): per output
channel or per tensor, absmax / 448, rounded to float8_e4m3fn by torch.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
PROJECTION = re.compile(r".*\.(q|k|v|o|gate|up|down|qkv|gate_up)_proj\.weight$")


def compressed_tensors_config(strategy: str = "channel", ignore: tuple[str, ...] = ("lm_head",),
                              activations: dict | None = None) -> dict:
    """A compressed-tensors FP8 quantization_config as llm-compressor writes it (FP8_DYNAMIC by default)."""
    if activations is None:
        activations = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": list(ignore), "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None, "input_activations": activations,
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False, "group_size": None, "block_structure": None, "observer": "minmax"}}}}


def plain_fp8_config(**extra) -> dict:
    """transformers' ``quant_method: fp8`` quantization_config, per-tensor or per-channel (no blocks)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", **extra}


def _quantize(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    amax = w.abs().max() if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / torch.finfo(FP8).max).clamp(min=1e-12)
    return (w / scale).to(FP8), scale


def write_fp8(src: Path, dst: Path, quantization_config: dict, per_tensor: bool = False,
              scale_shape: tuple[int, ...] | None = None, keep: str | None = None, static: bool = False) -> Path:
    """``src``'s checkpoint with every projection weight (except names matching ``keep``) stored in e4m3 with a
    float32 ``weight_scale`` (per tensor: shape ``scale_shape`` or (1,); per channel: [out, 1]), its config.json
    carrying ``quantization_config``, its other files copied. ``static``: each quantized projection also gets a
    static ``input_scale`` and each attention layer the KV-cache scales ``k_scale`` and ``v_scale``, as static
    FP8 checkpoints carry them."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    out = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if PROJECTION.fullmatch(name) and not (keep and re.search(keep, name)):
            w8, scale = _quantize(tensor, per_tensor)
            out[name] = w8
            out[name.removesuffix("weight") + "weight_scale"] = scale.reshape(scale_shape or (
                (1,) if per_tensor else (-1, 1))).contiguous()
            if static:
                out[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.05])
                if ".k_proj." in name:
                    attention = name.removesuffix("k_proj.weight")
                    out[attention + "k_scale"], out[attention + "v_scale"] = torch.tensor(0.1), torch.tensor(0.1)
        else:
            out[name] = tensor
    save_file(out, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))
    return dst


def write_dequantized(fp8_dir: Path, dst: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The unquantized checkpoint holding what ``fp8_dir``'s FP8 weights stand for, ``w8.float() * scale``
    (in ``dtype``), with a config.json without quantization_config: what transformers runs as the reference."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in fp8_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    tensors = load_file(fp8_dir / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale", ".input_scale", "k_scale", "v_scale")):
            continue
        if tensor.dtype == FP8:
            scale = tensors[name.removesuffix("weight") + "weight_scale"].float()
            scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
            tensor = tensor.float() * scale
        out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    save_file(out, dst / "model.safetensors")
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    return dst

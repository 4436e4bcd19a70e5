"""Reads and validates a PEFT LoRA directory into per-module deltas for our packed layers.

What ``peft``'s ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors`` with tensors named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``, A ``[r, in]``
and B ``[out, r]``. The scale (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) is folded into
B here, once. Every problem raises InvalidAdapter naming the adapter and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from data_plane.errors import InvalidAdapter
from data_plane.lora.sources import contained_file, resolve_adapter_dir

# PEFT module name -> (our packed projection, slice). Packed names adapt every slice at once.
MODULE_SLICES = {
    "q_proj": ("self_attn.qkv_proj", ("q",)),
    "k_proj": ("self_attn.qkv_proj", ("k",)),
    "v_proj": ("self_attn.qkv_proj", ("v",)),
    "qkv_proj": ("self_attn.qkv_proj", ("q", "k", "v")),
    "o_proj": ("self_attn.o_proj", ("o",)),
    "gate_proj": ("mlp.gate_up_proj", ("gate",)),
    "up_proj": ("mlp.gate_up_proj", ("up",)),
    "gate_up_proj": ("mlp.gate_up_proj", ("gate", "up")),
    "down_proj": ("mlp.down_proj", ("down",)),
}
# The language model of a vision-language base sits under `language_model` (Gemma 3: `model.language_model.`
# from transformers 5, `language_model.model.` before).
_TENSOR = re.compile(
    r"base_model\.model\.(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
    r"\.lora_(A|B)(?:\.default)?\.weight"
)
# An adapter of a vision-language base may adapt its vision side too; a pod serves text prompts only, which
# never reach it, so those tensors are left out (the text answers are peft's with or without them).
_VISION = re.compile(r"base_model\.model\.(?:model\.)?(?:vision_tower|multi_modal_projector)\..*")


@dataclass(frozen=True)
class AdapterLimits:
    max_rank: int
    max_bytes: int = 2 << 30
    allow_pickle: bool = False


@dataclass(frozen=True)
class SliceDelta:
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [slice_out, r], scale folded in


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter in host memory: deltas keyed by projection path and slice name."""

    name: str
    sha256: str
    rank: int  # the largest rank over its modules
    deltas: dict[str, dict[str, SliceDelta]]  # "layers.3.self_attn.qkv_proj" -> {"q": ..., "v": ...}
    nbytes: int

    def pin_memory(self) -> LoraAdapter:
        """The same adapter in page-locked host memory, for fast asynchronous copies to a GPU."""
        deltas = {path: {s: SliceDelta(d.a.pin_memory(), d.b.pin_memory()) for s, d in slices.items()}
                  for path, slices in self.deltas.items()}
        return LoraAdapter(self.name, self.sha256, self.rank, deltas, self.nbytes)


def load_peft_adapter(name: str, source: str, roots: tuple[Path, ...], expected_sha256: str,
                      projections: dict[str, dict[str, tuple[int, int]]], limits: AdapterLimits,
                      dtype: torch.dtype) -> LoraAdapter:
    """Loads and validates the adapter at ``source``.

    ``projections`` describes the model: projection path -> slice name -> (in_features, out_features).
    """
    adapter_dir = resolve_adapter_dir(name, source, roots)
    config = _read_config(name, adapter_dir, roots)
    raw, sha = _read_weights(name, adapter_dir, roots, limits)
    if expected_sha256 and sha != expected_sha256.lower():
        raise InvalidAdapter(f"adapter {name!r}: sha256 of its weights is {sha}, but {expected_sha256} was expected")
    tensors = _parse_tensors(name, raw, allow_pickle=limits.allow_pickle)
    pairs = _pair_tensors(name, tensors)
    deltas: dict[str, dict[str, SliceDelta]] = {}
    max_rank = 0
    nbytes = 0
    for (layer, block, module), (a, b) in sorted(pairs.items()):
        path_prefix = f"layers.{layer}.{MODULE_SLICES[module][0]}"
        if path_prefix not in projections:
            raise InvalidAdapter(
                f"adapter {name!r}: it adapts layer {layer}, but the base model has only "
                f"{_num_layers(projections)} layers; it was trained for another base model"
            )
        r = a.shape[0]
        _check_rank(name, config, layer, block, module, r, limits)
        slices = MODULE_SLICES[module][1]
        twice = sorted(set(slices) & set(deltas.get(path_prefix, {})))
        if twice:
            raise InvalidAdapter(
                f"adapter {name!r}: layers.{layer} adapts the {'/'.join(twice)} projection twice, through its packed "
                f"name and its own (e.g. qkv_proj and q_proj); keep one of them"
            )
        shapes = projections[path_prefix]
        in_features = shapes[slices[0]][0]
        out_features = sum(shapes[s][1] for s in slices)
        if tuple(a.shape) != (r, in_features) or tuple(b.shape) != (out_features, r):
            raise InvalidAdapter(
                f"adapter {name!r}: layers.{layer}.{module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"but the base model needs ({r}, {in_features}) and ({out_features}, {r}); "
                "it was trained for another base model"
            )
        for label, t in (("lora_A", a), ("lora_B", b)):
            if not torch.isfinite(t).all():
                raise InvalidAdapter(f"adapter {name!r}: layers.{layer}.{module}.{label} contains NaN or Inf")
        scale = _scale(config, f"model.layers.{layer}.{block}.{module}", r)
        b_scaled = (b.float() * scale).to(dtype)
        start = 0
        for s in slices:
            width = shapes[s][1]
            sd = SliceDelta(a.to(dtype).contiguous(), b_scaled[start : start + width].contiguous())
            deltas.setdefault(path_prefix, {})[s] = sd
            nbytes += sd.a.numel() * sd.a.element_size() + sd.b.numel() * sd.b.element_size()
            start += width
        max_rank = max(max_rank, r)
    if not deltas:
        raise InvalidAdapter(f"adapter {name!r}: it contains no LoRA weights")
    return LoraAdapter(name=name, sha256=sha, rank=max_rank, deltas=deltas, nbytes=nbytes)


def _num_layers(projections) -> int:
    return len({p.split(".")[1] for p in projections})


def _read_config(name: str, adapter_dir: Path, roots) -> dict:
    path = adapter_dir / "adapter_config.json"
    if not path.is_file():
        raise InvalidAdapter(f"adapter {name!r}: {path} is missing; a PEFT adapter needs adapter_config.json")
    try:
        config = json.loads(contained_file(name, adapter_dir, "adapter_config.json", roots).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidAdapter(f"adapter {name!r}: adapter_config.json is unreadable: {e}") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"adapter {name!r}: adapter_config.json must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapter(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise InvalidAdapter(f"adapter {name!r}: DoRA adapters (use_dora) are not supported; retrain without DoRA")
    if config.get("modules_to_save"):
        raise InvalidAdapter(
            f"adapter {name!r}: modules_to_save ({config['modules_to_save']}) would replace base weights per "
            "request, which is not supported; retrain without modules_to_save"
        )
    if config.get("bias", "none") != "none":
        raise InvalidAdapter(f"adapter {name!r}: bias={config['bias']!r} is not supported; only bias='none'")
    if config.get("fan_in_fan_out"):
        raise InvalidAdapter(f"adapter {name!r}: fan_in_fan_out adapters (Conv1D bases) do not fit a Llama model")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(MODULE_SLICES))
        if unknown:
            raise InvalidAdapter(
                f"adapter {name!r}: target modules {unknown} are not projections this model adapts "
                f"({', '.join(MODULE_SLICES)})"
            )
    return config


def _read_weights(name: str, adapter_dir: Path, roots, limits: AdapterLimits) -> tuple[tuple[str, bytes], str]:
    st, pickle = adapter_dir / "adapter_model.safetensors", adapter_dir / "adapter_model.bin"
    if st.exists():
        kind, path = "safetensors", contained_file(name, adapter_dir, st.name, roots)
    elif pickle.exists():
        if not limits.allow_pickle:
            raise InvalidAdapter(
                f"adapter {name!r}: only adapter_model.bin (a pickle) is present; pickles can run code, so they are "
                "refused unless the pod is started with --allow-pickle-adapters; convert it to safetensors"
            )
        kind, path = "pickle", contained_file(name, adapter_dir, pickle.name, roots)
    else:
        raise InvalidAdapter(f"adapter {name!r}: {adapter_dir} has no adapter_model.safetensors")
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise InvalidAdapter(
                f"adapter {name!r}: {path.name} is {size} bytes, over the pod's limit of {limits.max_bytes}"
            )
        data = path.read_bytes()
    except OSError as e:
        raise InvalidAdapter(f"adapter {name!r}: cannot read {path.name}: {e.strerror}") from None
    return (kind, data), hashlib.sha256(data).hexdigest()


def _parse_tensors(name: str, raw: tuple[str, bytes], allow_pickle: bool) -> dict[str, torch.Tensor]:
    kind, data = raw
    if kind == "safetensors":
        try:
            return load_safetensors(data)
        except (SafetensorError, ValueError, RuntimeError) as e:
            raise InvalidAdapter(f"adapter {name!r}: adapter_model.safetensors is truncated or corrupt: {e}") from None
    import io
    import pickle

    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise InvalidAdapter(f"adapter {name!r}: adapter_model.bin was refused by the safe loader: {e}") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise InvalidAdapter(f"adapter {name!r}: adapter_model.bin must hold a dict of tensors")
    return tensors


def _pair_tensors(name: str, tensors: dict[str, torch.Tensor]):
    pairs: dict[tuple[int, str, str], list] = {}
    for key, tensor in tensors.items():
        if _VISION.fullmatch(key):
            continue
        m = _TENSOR.fullmatch(key)
        if not m:
            raise InvalidAdapter(
                f"adapter {name!r}: unknown tensor {key!r}; expected "
                "base_model.model.model.layers.N.{self_attn|mlp}.<module>.lora_{A|B}.weight"
            )
        layer, block, module, which = m.groups()
        if module not in MODULE_SLICES or MODULE_SLICES[module][0].split(".")[0] != block:
            raise InvalidAdapter(f"adapter {name!r}: {block}.{module} is not a projection this model adapts")
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise InvalidAdapter(
                f"adapter {name!r}: {key} must be a 2-D floating-point tensor, "
                f"found {tensor.dtype} {tuple(tensor.shape)}"
            )
        pairs.setdefault((int(layer), block, module), [None, None])[0 if which == "A" else 1] = tensor
    for (layer, _, module), (a, b) in pairs.items():
        if a is None or b is None:
            missing = "lora_A" if a is None else "lora_B"
            raise InvalidAdapter(f"adapter {name!r}: layers.{layer}.{module} has {missing} missing")
    return pairs


def _pattern_value(patterns: dict, module_path: str, default):
    # PEFT matches a pattern key against the end of the module's full name.
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module_path):
            return value
    return default


def _check_rank(name, config, layer, block, module, r, limits: AdapterLimits) -> None:
    path = f"model.layers.{layer}.{block}.{module}"
    expected = _pattern_value(config.get("rank_pattern"), path, config.get("r", r))
    if r != expected:
        raise InvalidAdapter(f"adapter {name!r}: layers.{layer}.{module} has rank {r}, but its config says {expected}")
    if r > limits.max_rank:
        raise InvalidAdapter(
            f"adapter {name!r}: rank {r} (layers.{layer}.{module}) exceeds this pod's --max-lora-rank {limits.max_rank}"
        )
    if r == 0:
        raise InvalidAdapter(f"adapter {name!r}: layers.{layer}.{module} has rank 0")


def _scale(config: dict, module_path: str, r: int) -> float:
    alpha = float(_pattern_value(config.get("alpha_pattern"), module_path, config.get("lora_alpha", r)))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r

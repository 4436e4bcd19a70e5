"""Reads and validates a PEFT LoRA directory into staged slice groups for our packed layers.

What ``peft``'s ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors`` with tensors named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``, A ``[r, in]``
and B ``[out, r]``. The scale (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) is folded into
B here, once. Every problem raises InvalidAdapter naming the adapter and what is wrong.

The bytes are touched as few times as the work needs (``weights_file`` maps and hashes the file in
one pass): names, dtypes and shapes are checked from the header; the tensors of each slice group
are gathered, converted to the serving dtype and scaled in one operation per group into one
staging buffer (page-locked when the slots are on a GPU); finiteness is one reduction over that
buffer, and only a failing adapter is searched tensor by tensor for the culprit.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from data_plane.errors import InvalidAdapter
from data_plane.lora.lora_adapter import LoraAdapter, SliceDelta, SliceGroup
from data_plane.lora.sources import contained_file, resolve_adapter_dir
from data_plane.lora.weights_file import Entry, HashedFile, open_weights, pickle_entries, safetensors_entries

__all__ = ["AdapterLimits", "LoraAdapter", "SliceDelta", "SliceGroup", "load_peft_adapter"]

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


@dataclass
class _Gather:
    """The pieces of one slice group before staging, in layer order."""

    layers: list[int]
    a: list[torch.Tensor]  # [r * in] each, file dtype
    b: list[torch.Tensor]  # [rows * r] each, file dtype
    scales: list[float]


def load_peft_adapter(name: str, source: str, roots: tuple[Path, ...], expected_sha256: str,
                      projections: dict[str, dict[str, tuple[int, int]]], limits: AdapterLimits,
                      dtype: torch.dtype, pin_memory: bool = False) -> LoraAdapter:
    """Loads and validates the adapter at ``source``; nothing is returned unless the weights file's
    sha256 equals ``expected_sha256`` (when given).

    ``projections`` describes the model: projection path -> slice name -> (in_features, out_features).
    ``pin_memory``: stage the weights in page-locked memory (for slots on a GPU).
    """
    adapter_dir = resolve_adapter_dir(name, source, roots)
    config = _read_config(name, adapter_dir, roots)
    file, is_pickle = _open_weights(name, adapter_dir, roots, limits)
    try:
        entries = pickle_entries(name, file) if is_pickle else safetensors_entries(name, file.bytes)
        groups, buffer, max_rank = _stage(name, config, _pair_tensors(name, entries), projections, limits, dtype,
                                          pin_memory)
    except InvalidAdapter:
        _check_sha(name, file.sha256(), expected_sha256)  # other bytes than the registered ones: say that first
        raise
    sha = file.sha256()
    _check_sha(name, sha, expected_sha256)
    nbytes = buffer.numel() * buffer.element_size()
    return LoraAdapter(name=name, sha256=sha, rank=max_rank, groups=groups, nbytes=nbytes, buffer=buffer)


def _check_sha(name: str, sha: str, expected: str) -> None:
    if expected and sha != expected.lower():
        raise InvalidAdapter(f"adapter {name!r}: sha256 of its weights is {sha}, but {expected} was expected")


def _stage(name: str, config: dict, pairs: dict, projections, limits: AdapterLimits, dtype: torch.dtype,
           pin_memory: bool) -> tuple[tuple[SliceGroup, ...], torch.Tensor, int]:
    """Checks every pair against the model and the config, then stages each slice group with one
    gather, conversion and scaling into one buffer, and checks that buffer for NaN/Inf."""
    gathers: dict[tuple, _Gather] = defaultdict(lambda: _Gather([], [], [], []))
    max_rank = 0
    # Without rank or alpha patterns a module's rank check and scale do not depend on its layer.
    per_layer = bool(config.get("rank_pattern") or config.get("alpha_pattern"))
    scales: dict[tuple[str, int], float] = {}  # (module, rank) -> scale, once checked
    adapted: dict[tuple[int, str], set[str]] = {}  # (layer, projection kind) -> its slices adapted so far
    for (layer, block, module), (a, b) in sorted(pairs.items()):
        kind, slices = MODULE_SLICES[module]
        shapes = projections.get(f"layers.{layer}.{kind}")
        if shapes is None:
            raise InvalidAdapter(
                f"adapter {name!r}: it adapts layer {layer}, but the base model has only "
                f"{_num_layers(projections)} layers; it was trained for another base model"
            )
        r = a.shape[0]
        twice = sorted(adapted.setdefault((layer, kind), set()) & set(slices))
        if twice:
            raise InvalidAdapter(
                f"adapter {name!r}: layers.{layer} adapts the {'/'.join(twice)} projection twice, through its packed "
                f"name and its own (e.g. qkv_proj and q_proj); keep one of them"
            )
        adapted[(layer, kind)].update(slices)
        scale = None if per_layer else scales.get((module, r))
        if scale is None:
            _check_rank(name, config, layer, block, module, r, limits)
            scale = scales[(module, r)] = _scale(config, f"model.layers.{layer}.{block}.{module}", r)
        in_features = shapes[slices[0]][0]
        out_features = sum(shapes[s][1] for s in slices)
        if a.shape != (r, in_features) or b.shape != (out_features, r):
            raise InvalidAdapter(
                f"adapter {name!r}: layers.{layer}.{module} has lora_A {a.shape} and lora_B {b.shape}, "
                f"but the base model needs ({r}, {in_features}) and ({out_features}, {r}); "
                "it was trained for another base model"
            )
        row = 0
        for s in slices:
            width = shapes[s][1]
            g = gathers[(kind, s, module, r, a.dtype, b.dtype)]
            g.layers.append(layer)
            g.a.append(a.flat)
            g.b.append(b.flat if len(slices) == 1 else b.flat[row * r : (row + width) * r])  # a packed B's rows
            g.scales.append(scale)
            row += width
        max_rank = max(max_rank, r)
    if not gathers:
        raise InvalidAdapter(f"adapter {name!r}: it contains no LoRA weights")
    total = sum(len(g.layers) * (g.a[0].numel() + g.b[0].numel()) for g in gathers.values())
    buffer = torch.empty(total, dtype=dtype, pin_memory=pin_memory)  # [total] the adapter's one staging buffer
    groups, offset = [], 0
    for (kind, s, module, r, _, _), g in gathers.items():
        n, a_numel, b_numel = len(g.layers), g.a[0].numel(), g.b[0].numel()
        a = buffer[offset : offset + n * a_numel].view(n, a_numel)
        b = buffer[offset + n * a_numel : offset + n * (a_numel + b_numel)].view(n, b_numel)
        offset += n * (a_numel + b_numel)
        _gather_into(a, g.a)
        _gather_scaled_into(b, g.b, g.scales)
        group = SliceGroup(kind, s, module, tuple(g.layers), a.view(n, r, -1), b.view(n, -1, r))
        # One reduction per group, while its bytes are still in cache: a sum is finite only if every
        # element is (it accumulates in float32, rounded once to the dtype). A sum that overflows from
        # finite elements sends the search through the group's tensors, which then finds nothing.
        if not math.isfinite(buffer[offset - n * (a_numel + b_numel) : offset].sum().item()):
            _raise_non_finite(name, group)
        groups.append(group)
    return tuple(groups), buffer, max_rank


# Pieces at least this large are converted straight into their row of the staging buffer (one pass
# over the bytes, one call per piece); smaller ones are stacked first (two passes, one call per group),
# where the calls would cost more than the bytes.
_ROW_BY_ROW_BYTES = 64 << 10


def _gather_into(out: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """``out`` ([n, k]) = the pieces stacked, in ``out``'s dtype."""
    if pieces[0].dtype == out.dtype:
        torch.stack(pieces, out=out)
    elif pieces[0].nbytes >= _ROW_BY_ROW_BYTES:
        for row, piece in zip(out, pieces, strict=True):
            row.copy_(piece)
    else:
        out.copy_(torch.stack(pieces))


def _gather_scaled_into(out: torch.Tensor, pieces: list[torch.Tensor], scales: list[float]) -> None:
    """``out[i] = (pieces[i].float() * scales[i]).to(out.dtype)``, rounded once. ``mul`` computes a
    product of a float32, bfloat16 or float16 tensor and a Python scale in float32 and rounds once to
    ``out``; a piece in another dtype than ``out`` is made float32 first, as that formula does."""
    widen = pieces[0].dtype not in (out.dtype, torch.float32)
    if pieces[0].nbytes >= _ROW_BY_ROW_BYTES:
        for row, piece, scale in zip(out, pieces, scales, strict=True):
            torch.mul(piece.float() if widen else piece, scale, out=row)
        return
    stacked = torch.stack(pieces)  # [n, k]
    if len(set(scales)) == 1:
        torch.mul(stacked.float() if widen else stacked, scales[0], out=out)
    else:
        torch.mul(stacked.float(), torch.tensor(scales, dtype=torch.float32)[:, None], out=out)


def _raise_non_finite(name: str, g: SliceGroup) -> None:
    for j, layer in enumerate(g.layers):
        for label, t in (("lora_A", g.a[j]), ("lora_B", g.b[j])):
            if not torch.isfinite(t).all():
                raise InvalidAdapter(f"adapter {name!r}: layers.{layer}.{g.module}.{label} contains NaN or Inf")


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


def _open_weights(name: str, adapter_dir: Path, roots, limits: AdapterLimits) -> tuple[HashedFile, bool]:
    """The weights file, mapped and being hashed, and whether it is a pickle."""
    st, pickle = adapter_dir / "adapter_model.safetensors", adapter_dir / "adapter_model.bin"
    if st.exists():
        return open_weights(name, contained_file(name, adapter_dir, st.name, roots), limits.max_bytes), False
    if not pickle.exists():
        raise InvalidAdapter(f"adapter {name!r}: {adapter_dir} has no adapter_model.safetensors")
    if not limits.allow_pickle:
        raise InvalidAdapter(
            f"adapter {name!r}: only adapter_model.bin (a pickle) is present; pickles can run code, so they are "
            "refused unless the pod is started with --allow-pickle-adapters; convert it to safetensors"
        )
    return open_weights(name, contained_file(name, adapter_dir, pickle.name, roots), limits.max_bytes), True


def _pair_tensors(name: str, entries: dict[str, Entry]) -> dict[tuple[int, str, str], list[Entry]]:
    pairs: dict[tuple[int, str, str], list] = {}
    for key, entry in entries.items():
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
        if not entry.dtype.is_floating_point or len(entry.shape) != 2:
            raise InvalidAdapter(
                f"adapter {name!r}: {key} must be a 2-D floating-point tensor, "
                f"found {entry.dtype} {entry.shape}"
            )
        pairs.setdefault((int(layer), block, module), [None, None])[0 if which == "A" else 1] = entry
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

"""Reads and validates a PEFT LoRA directory into slice groups for our packed layers.

What ``peft``'s ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors`` with tensors named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``, A ``[r, in]``
and B ``[out, r]``. The scale (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) is folded into
B when B is written into a slot. Every problem raises InvalidAdapter naming the adapter and what is
wrong.

The bytes are touched as few times as the work needs: ``weights_file`` reads the file into one
buffer and hashes it as it arrives; names, dtypes and shapes are checked from the header; the
tensors stay where the read put them, as views grouped by slice and rank; finiteness (and that
every value fits the serving dtype) is one min/max reduction over the file's tensors, and only a
failing adapter is searched tensor by tensor for the culprit. A file in the serving dtype is not
staged: a slot write scales B on its way from the read buffer into the slot. A file in another
dtype is converted (and B scaled) once, into a buffer of its own (``_staged``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_plane.errors import InvalidAdapter
from data_plane.lora.lora_adapter import LayerRun, LoraAdapter, SliceDelta, SliceGroup, write_a, write_b
from data_plane.lora.sources import contained_file, resolve_adapter_dir
from data_plane.lora.weights_file import (
    Entry,
    HashedFile,
    open_weights,
    pickle_weights,
    safetensors_lead,
    safetensors_weights,
    wait_read,
)

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
_BLOCK = {module: kind.split(".")[0] for module, (kind, _) in MODULE_SLICES.items()}  # "q_proj" -> "self_attn"
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
    """The pieces of one slice group, in layer order: where each layer's A and B lie in the buffer."""

    a_shape: tuple[int, int]  # [r, in]
    b_shape: tuple[int, int]  # [rows, r]
    layers: list[int] = field(default_factory=list)
    a: list[Entry] = field(default_factory=list)  # each layer's lora_A
    b: list[tuple[Entry, int]] = field(default_factory=list)  # each layer's lora_B, and where its rows start
    scales: list[float] = field(default_factory=list)


def load_peft_adapter(name: str, source: str, roots: tuple[Path, ...], expected_sha256: str,
                      projections: dict[str, dict[str, tuple[int, int]]], limits: AdapterLimits,
                      dtype: torch.dtype, pin_memory: bool = False) -> LoraAdapter:
    """Loads and validates the adapter at ``source``; nothing is returned unless the weights file's
    sha256 equals ``expected_sha256`` (when given).

    ``projections`` describes the model: projection path -> slice name -> (in_features, out_features).
    ``dtype``: the serving dtype, which every weight must fit once converted (and B once scaled).
    ``pin_memory``: read the weights into page-locked memory (for slots on a GPU).
    """
    adapter_dir = resolve_adapter_dir(name, source, roots)
    config = _read_config(name, adapter_dir, roots)
    file, is_pickle = _open_weights(name, adapter_dir, roots, limits, pin_memory)
    try:
        # A safetensors file's data is still arriving here: its header is parsed and its entries paired,
        # checked against the model and grouped (views only) while the rest is read.
        weights = pickle_weights(name, file) if is_pickle else safetensors_weights(
            name, file.bytes, lambda: wait_read(name, file))
        groups, max_rank = _group(name, config, _pair_tensors(name, weights.entries), projections, limits)
        wait_read(name, file)
        _check_finite(name, groups, weights.runs, dtype)
    except InvalidAdapter:
        wait_read(name, file)  # the buffer is no longer written to, and a failed read says so first
        _check_sha(name, file.sha256(), expected_sha256)  # other bytes than the registered ones: say that next
        raise
    buffer = weights.buffer
    if any(t.dtype != dtype for g in groups for run in g.runs for t in (run.a, run.b)):
        groups, buffer = _staged(groups, dtype, pin_memory)
    sha = file.sha256()
    _check_sha(name, sha, expected_sha256)
    return LoraAdapter(name=name, sha256=sha, rank=max_rank, groups=groups, nbytes=buffer.numel(), dtype=dtype,
                       buffer=buffer)


def _check_sha(name: str, sha: str, expected: str) -> None:
    if expected and sha != expected.lower():
        raise InvalidAdapter(f"adapter {name!r}: sha256 of its weights is {sha}, but {expected} was expected")


def _group(name: str, config: dict, pairs: dict, projections,
           limits: AdapterLimits) -> tuple[tuple[SliceGroup, ...], int]:
    """Checks every pair against the model and the config, and groups them by slice and rank."""
    gathers: dict[tuple, _Gather] = {}
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
        done = adapted.setdefault((layer, kind), set())
        if not done.isdisjoint(slices):
            raise InvalidAdapter(
                f"adapter {name!r}: layers.{layer} adapts the {'/'.join(sorted(done.intersection(slices)))} "
                "projection twice, through its packed name and its own (e.g. qkv_proj and q_proj); keep one of them"
            )
        done.update(slices)
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
            g = gathers.get((kind, s, module, r)) or gathers.setdefault((kind, s, module, r),
                                                                      _Gather((r, in_features), (width, r)))
            g.layers.append(layer)
            g.a.append(a)
            g.b.append((b, row * r))  # a packed B's rows of this slice
            g.scales.append(scale)
            row += width
        max_rank = max(max_rank, r)
    if not gathers:
        raise InvalidAdapter(f"adapter {name!r}: it contains no LoRA weights")
    groups = tuple(SliceGroup(kind, s, module, _runs(g)) for (kind, s, module, _), g in gathers.items())
    return groups, max_rank


def _runs(g: _Gather) -> tuple[LayerRun, ...]:
    """``g``'s layers cut into runs of consecutive layers whose A and B each lie evenly spaced in
    the buffer (one dtype, a positive step), with one scale."""
    a_at = [e.data.storage_offset() + e.at for e in g.a]  # elements; every entry lies in one buffer
    b_at = [e.data.storage_offset() + e.at + row for e, row in g.b]
    runs, first = [], 0
    for j in range(1, len(g.layers) + 1):
        if j < len(g.layers) and g.layers[j] == g.layers[j - 1] + 1 and g.scales[j] == g.scales[first] and \
                g.a[j].dtype == g.a[first].dtype and g.b[j][0].dtype == g.b[first][0].dtype and \
                _evenly_spaced(a_at, first, j) and _evenly_spaced(b_at, first, j):
            continue
        (r, in_features), rows, n = g.a_shape, g.b_shape[0], j - first
        step_a, step_b = (a_at[first + 1] - a_at[first], b_at[first + 1] - b_at[first]) if n > 1 else (0, 0)
        runs.append(LayerRun(g.layers[first],
                             g.a[first].data.as_strided((n, r, in_features), (step_a, in_features, 1), a_at[first]),
                             g.b[first][0].data.as_strided((n, rows, r), (step_b, r, 1), b_at[first]),
                             g.scales[first]))
        first = j
    return tuple(runs)


def _evenly_spaced(at: list[int], first: int, j: int) -> bool:
    """Whether ``at[first : j + 1]`` are evenly spaced, a positive step apart."""
    step = at[first + 1] - at[first] if j > first + 1 else at[j] - at[first]
    return step > 0 and at[j] - at[j - 1] == step


def _staged(groups: tuple[SliceGroup, ...], dtype: torch.dtype,
            pin_memory: bool) -> tuple[tuple[SliceGroup, ...], torch.Tensor]:
    """``groups`` converted to ``dtype`` with B's scale folded in, in a new buffer of their own, each
    group's layers in order (one run per stretch of consecutive layers), and that buffer.

    For a file in another dtype than the serving one (the demo adapters are bfloat16, served in
    float32 on CPU): converting once here makes every later slot write a plain copy, where converting
    on each write into a slot's narrow rank columns took twice as long (1.9 ms against 1.0 ms for
    the rank-4 demo adapter on a 2-core EPYC)."""
    shapes = [(sum(len(run.layers) for run in g.runs), *g.runs[0].a.shape[1:], g.runs[0].b.shape[1]) for g in groups]
    total = sum(n * r * (in_features + rows) for n, r, in_features, rows in shapes)
    buffer = torch.empty(total * dtype.itemsize, dtype=torch.uint8, pin_memory=pin_memory)  # [bytes]
    elements, offset, staged = buffer.view(dtype), 0, []
    for g, (n, r, in_features, rows) in zip(groups, shapes, strict=True):
        a = elements[offset : offset + n * r * in_features].view(n, r, in_features)
        offset += n * r * in_features
        b = elements[offset : offset + n * rows * r].view(n, rows, r)
        offset += n * rows * r
        runs: list[LayerRun] = []
        j = 0
        for run in g.runs:
            k = j + len(run.layers)
            write_a(a[j:k], run.a)
            write_b(b[j:k], run.b, run.scale)
            if runs and runs[-1].layers.stop == run.first:  # consecutive layers, now side by side
                start = j - len(runs[-1].layers)
                runs[-1] = LayerRun(runs[-1].first, a[start:k], b[start:k], 1.0)
            else:
                runs.append(LayerRun(run.first, a[j:k], b[j:k], 1.0))
            j = k
        staged.append(SliceGroup(g.kind, g.slice, g.module, tuple(runs)))
    return tuple(staged), buffer


def _check_finite(name: str, groups: tuple[SliceGroup, ...], runs: tuple[torch.Tensor, ...],
                  dtype: torch.dtype) -> None:
    """Raises InvalidAdapter naming the first tensor that holds NaN or Inf, or a value that becomes
    Inf in ``dtype`` (A converted, B converted and scaled as ``lora_adapter.write_b`` does).

    One min/max reduction over the file's tensors (one for a one-dtype file) bounds every value;
    when that bound times the largest scale stays clear of ``dtype``'s largest value, nothing can
    overflow and no tensor is looked at one by one. Otherwise (NaN or Inf in the file, or values
    near the top of the range) each tensor is converted as its slot write would and checked; a NaN
    in a tensor the adapter does not use (a vision tower's) is then found in none of them."""
    bound = 0.0
    for run in runs:
        if run.dtype in _REDUCIBLE and run.numel():
            low, high = (v.item() for v in torch.aminmax(run))
            # Python's max drops a NaN that is not its first argument: NaN must become inf here.
            bound = max(bound, -low, high) if math.isfinite(low) and math.isfinite(high) else math.inf
        elif run.dtype.is_floating_point:
            bound = math.inf  # float8: checked tensor by tensor
    largest_scale = max(1.0, *(run.scale for g in groups for run in g.runs))
    # 0.99: room for the rounding of the conversion and of the product (2^-8 relative at most).
    if bound * largest_scale < 0.99 * torch.finfo(dtype).max:  # False for NaN and Inf too
        return
    for g in groups:
        for layer, a, b, scale in g.layers():
            for label, t in (("lora_A", a), ("lora_B", b)):
                converted = torch.empty(t.shape, dtype=dtype)
                if label == "lora_A":
                    write_a(converted, t)
                else:
                    write_b(converted, t, scale)
                if not torch.isfinite(converted).all():
                    raise InvalidAdapter(f"adapter {name!r}: layers.{layer}.{g.module}.{label} contains NaN or Inf")


_REDUCIBLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


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


def _open_weights(name: str, adapter_dir: Path, roots, limits: AdapterLimits,
                  pin_memory: bool) -> tuple[HashedFile, bool]:
    """The weights file, read and being hashed, and whether it is a pickle."""
    st, pickle = adapter_dir / "adapter_model.safetensors", adapter_dir / "adapter_model.bin"
    if st.exists():
        path = contained_file(name, adapter_dir, st.name, roots)
        return open_weights(name, path, limits.max_bytes, pin_memory, safetensors_lead), False
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
        m = _TENSOR.fullmatch(key)
        if not m and _VISION.fullmatch(key):
            continue
        if not m:
            raise InvalidAdapter(
                f"adapter {name!r}: unknown tensor {key!r}; expected "
                "base_model.model.model.layers.N.{self_attn|mlp}.<module>.lora_{A|B}.weight"
            )
        layer, block, module, which = m.groups()
        if _BLOCK.get(module) != block:
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

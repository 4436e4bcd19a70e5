"""Loads a Hugging Face checkpoint directory (single or sharded safetensors) into our model."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from data_plane.errors import ModelLoadError
from data_plane.model.config import ModelConfig
from data_plane.model.llama import LlamaForCausalLM, Projection
from data_plane.model.quantization import (
    FP8,
    Fp8Compute,
    Fp8Matmul,
    Fp8Scheme,
    choose_compute,
    dequantize,
    describe,
    quantize,
    scheme_of,
    slice_scale,
)

log = logging.getLogger("lorafleet.model")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# HF tensor name (after the leading "model.") -> (our parameter, packed slice or None). Checkpoints that
# store the packed projections themselves (Phi-3's qkv_proj and gate_up_proj) fill every slice at once.
_PACKED = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|gate|up)_proj\.(weight|bias)")
_PACKED_TARGET = {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj", "gate": "gate_up_proj", "up": "gate_up_proj"}
# The vision side of a vision-language checkpoint is not served (see config.TEXT_MODELS).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|(model\.)?(vision_tower|multi_modal_projector)\..*")
# Where a checkpoint keeps the text model: its own top level, or a vision-language model's language model
# (`language_model.model.` as the Hub stores Gemma 3, `model.language_model.` as transformers 5 names it).
_TEXT_PREFIX = re.compile(r"^(language_model\.model\.|model\.language_model\.|language_model\.|model\.)")
# A projection's module and what an FP8 checkpoint stores of it besides its weight.
_PROJECTION = re.compile(r"(layers\.\d+\.(?:self_attn|mlp)\.)(q|k|v|o|gate|up|down|qkv|gate_up)_proj\."
                         r"(weight|weight_scale)")
# Scales an FP8 checkpoint carries that the weights do not use: static input scales (activations are scaled per
# token at run time) and KV-cache scales (read by kv_scales.py under --kv-cache-dtype fp8, which any checkpoint,
# quantized weights or not, may carry).
_UNUSED_SCALES = re.compile(r".*\.(input_scale|q_scale)$")
_KV_SCALES = re.compile(r".*\.(k_scale|v_scale|output_scale)$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when it is sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is malformed: {e}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = [model_dir / "model.safetensors"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(
            f"missing weight files {', '.join(missing)}: a model directory needs model.safetensors "
            "or model.safetensors.index.json with its shards"
        )
    return files


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", quantization: str = "auto",
               fp8_compute: Fp8Compute | None = None) -> LlamaForCausalLM:
    """Builds the model from ``model_dir`` and loads its weights in ``dtype`` on ``device``. An FP8
    checkpoint (detected from its config.json), or any checkpoint with ``quantization`` "fp8", gets FP8
    projection weights computing as ``fp8_compute`` says (default: ``quantization.choose_compute`` for the
    device), logged.

    Raises ModelLoadError when a file is missing, the architecture or the quantization is unsupported,
    or a tensor (an FP8 weight's scale included) is missing, unexpected, or shaped differently from what
    the config implies.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    scheme = scheme_of(model_dir, quantization)
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    files = checkpoint_files(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch_dtype)
    fp8 = None
    if scheme is not None:
        compute, reason = (fp8_compute, "named by the caller") if fp8_compute else choose_compute(device, torch_dtype)
        fp8 = _Fp8Weights(model, scheme, compute, torch_dtype)
        log.info("quantization", extra=describe(scheme, compute, reason))
    model = model.to_empty(device=device)
    if fp8 is not None:
        fp8.allocate_scales(device)
    params = dict(model.named_parameters())
    pending = {(name, None) for name in params}
    for name, module in model.named_modules():
        if isinstance(module, Projection) and len(module.slices) > 1:
            for pname in ("weight", "bias"):
                if getattr(module, pname) is not None:
                    pending.discard((f"{name}.{pname}", None))
                    pending |= {(f"{name}.{pname}", s) for s in module.slices}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for hf_name in f.keys():
                    if (_IGNORED.match(hf_name) or _KV_SCALES.match(hf_name)
                            or (fp8 is not None and _UNUSED_SCALES.match(hf_name))):
                        continue
                    tensor = f.get_tensor(hf_name)
                    if fp8 is not None and fp8.takes(hf_name):
                        pending -= fp8.add(hf_name, tensor, path)
                        continue
                    if tensor.dtype == FP8:
                        raise ModelLoadError(f"{path.name}: tensor {hf_name} is FP8, but only the projections' weights "
                                             "may be, in a checkpoint whose config.json says how it is quantized")
                    pending -= _copy_tensor(model, params, hf_name, tensor, path)
        except SafetensorError as e:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {e}") from None
    if fp8 is not None:
        fp8.check_complete(model_dir)
        model.quantization = "fp8"
    if pending:
        names = sorted(f"{n}[{s}]" if s else n for n, s in pending)
        raise ModelLoadError(f"{model_dir} lacks weights for {len(names)} tensors, e.g. {', '.join(names[:5])}")
    model.use_device(device)
    model.prepack_cpu_weights()
    return model.eval()


def _copy_tensor(model, params, hf_name: str, tensor: torch.Tensor, path: Path) -> set:
    """Copies one checkpoint tensor into the model; returns the (parameter, slice) keys it filled."""
    name = _TEXT_PREFIX.sub("", hf_name)
    if name == "lm_head.weight":
        name = "lm_head"
    if name == "lm_head" and model.lm_head is None:
        return set()  # tied checkpoints may still carry a copy of the embedding
    packed = _PACKED.fullmatch(name)
    if packed:
        layer, block, part, kind = packed.groups()
        target = f"layers.{layer}.{block}.{_PACKED_TARGET[part]}"
        module = model.get_submodule(target)
        start, size = module.slice_offsets()[part]
        dest = getattr(module, kind)
        keys = {(f"{target}.{kind}", part)}
        if dest is None:
            raise ModelLoadError(f"{path.name}: unexpected tensor {hf_name} (the config says this layer has no {kind})")
        dest = dest[start : start + size]
    else:
        if name not in params:
            raise ModelLoadError(f"{path.name}: unexpected tensor {hf_name}; is this a {model.config.architecture}?")
        dest, keys = params[name], {(name, None)}
        module = model.get_submodule(name.rpartition(".")[0]) if "." in name else None
        if isinstance(module, Projection) and len(module.slices) > 1:  # a packed projection stored packed
            keys = {(name, s) for s in module.slices}
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ModelLoadError(
            f"{path.name}: tensor {hf_name} has shape {tuple(tensor.shape)} but config.json implies "
            f"{tuple(dest.shape)}; the weights do not match the config"
        )
    dest.copy_(tensor)
    return keys


class _Fp8Weights:
    """The projections' weights of an FP8 base, gathered per projection as the checkpoint's tensors arrive
    (each slice's weight and, for an e4m3 weight, its ``weight_scale``) and written into the model once a
    projection is complete: as e4m3 weights with one scale per output row where they compute in FP8
    (W8A8, weight-only), else dequantized into the weights' dtype. A slice stored unquantized (a module the
    checkpoint ignores) is quantized per channel into an FP8 projection, copied into a dequantized one
    (quantized first under ``--quantization fp8``)."""

    def __init__(self, model: LlamaForCausalLM, scheme: Fp8Scheme, compute: Fp8Compute, dtype: torch.dtype) -> None:
        self.model, self.scheme, self.compute, self.dtype = model, scheme, compute, dtype
        self.staged: dict[str, dict[str | None, dict[str, tuple[str, torch.Tensor]]]] = {}  # target -> part -> kind
        self.resident: list[Projection] = []  # the projections whose weights stay e4m3 on the device
        if compute is Fp8Compute.DEQUANTIZED:
            return
        for name, module in model.named_modules():
            if isinstance(module, Projection) and not self._ignored(name, module):
                module.weight = torch.nn.Parameter(torch.empty_like(module.weight, dtype=FP8), requires_grad=False)
                self.resident.append(module)

    def _ignored(self, target: str, module: Projection) -> bool:
        if not self.scheme.prequantized:
            return False
        prefix, _, _ = target.rpartition(".")  # its checkpoint names: each slice's, or the packed one's (Phi-3)
        return (self.scheme.ignores(f"model.{target}")
                or all(self.scheme.ignores(f"model.{prefix}.{part}_proj") for part in module.slices))

    def allocate_scales(self, device: torch.device | str) -> None:
        """Gives each e4m3 projection its scales and matmul (after the model's tensors are allocated)."""
        for module in self.resident:
            module.quantized = Fp8Matmul(torch.ones(module.out_features, device=device), self.dtype, self.compute)

    def takes(self, hf_name: str) -> bool:
        """Whether ``hf_name`` is a projection's weight or weight scale."""
        return _PROJECTION.fullmatch(_TEXT_PREFIX.sub("", hf_name)) is not None

    def add(self, hf_name: str, tensor: torch.Tensor, path: Path) -> set:
        """Gathers one tensor; returns the (parameter, slice) keys of the projection it completed, if any."""
        prefix, part, kind = _PROJECTION.fullmatch(_TEXT_PREFIX.sub("", hf_name)).groups()
        packed = _PACKED_TARGET.get(part)
        target = prefix + (packed or f"{part}_proj")
        module = self.model.get_submodule(target)
        if not isinstance(module, Projection):
            raise ModelLoadError(f"{path.name}: unexpected tensor {hf_name}; is this a "
                                 f"{self.model.config.architecture}?")
        key = part if packed else None
        parts = self.staged.setdefault(target, {})
        if kind in parts.setdefault(key, {}):
            raise ModelLoadError(f"{path.name}: tensor {hf_name} appears twice in the checkpoint")
        parts[key][kind] = (hf_name, tensor)
        if not self._complete(module, parts):
            return set()
        self._write(module, parts, path)
        del self.staged[target]
        slices = module.slices if len(module.slices) > 1 else [None]
        return {(f"{target}.weight", s) for s in slices}

    @staticmethod
    def _complete(module: Projection, parts: dict) -> bool:
        keys = [None] if None in parts and "weight" in parts[None] else list(module.slices)
        for key in keys:
            got = parts.get(key, {})
            if "weight" not in got or (got["weight"][1].dtype == FP8 and "weight_scale" not in got):
                return False
        return True

    def _write(self, module: Projection, parts: dict, path: Path) -> None:
        offsets = module.slice_offsets()
        spans = [(None, 0, module.out_features)] if None in parts else [(p, *offsets[p]) for p in module.slices]
        for key, start, size in spans:
            hf_name, weight = parts[key]["weight"]
            if tuple(weight.shape) != (size, module.in_features):
                raise ModelLoadError(f"{path.name}: tensor {hf_name} has shape {tuple(weight.shape)} but config.json "
                                     f"implies {(size, module.in_features)}; the weights do not match the config")
            scale_name, scale = parts[key].get("weight_scale", (None, None))
            if weight.dtype == FP8:
                w8, per_row = weight, slice_scale(scale, size, scale_name)
            elif scale is not None:
                raise ModelLoadError(f"{path.name}: {scale_name} scales {hf_name}, which is stored in {weight.dtype}, "
                                     "not FP8: the checkpoint's weights and scales do not belong together")
            elif module.quantized is not None or not self.scheme.prequantized:
                w8, per_row = quantize(weight.to(module.weight.device))  # on the GPU where it will compute
            else:  # a module the checkpoint keeps unquantized, computing unquantized
                module.weight[start : start + size].copy_(weight)
                continue
            if module.quantized is not None:
                module.weight[start : start + size].copy_(w8)
                module.quantized.scale[start : start + size].copy_(per_row)
            else:
                module.weight[start : start + size].copy_(dequantize(w8, per_row, module.weight.dtype))

    def check_complete(self, model_dir: Path) -> None:
        """Raises ModelLoadError, naming the tensor, for an FP8 weight whose scale the checkpoint lacks, or a
        scale whose weight is not an FP8 weight of it."""
        for parts in self.staged.values():
            for got in parts.values():
                if "weight" not in got and "weight_scale" in got:
                    name = got["weight_scale"][0]
                    raise ModelLoadError(f"{model_dir}: {name} scales no FP8 weight (the weight it scales is missing "
                                         "or stored unquantized): the checkpoint's weights and scales do not belong "
                                         "together")
                if "weight" in got and got["weight"][1].dtype == FP8 and "weight_scale" not in got:
                    name = got["weight"][0]
                    raise ModelLoadError(f"{model_dir} lacks {name.removesuffix('.weight')}.weight_scale, the scale of "
                                         f"the FP8 weight {name}: the checkpoint is incomplete; download or export it "
                                         "again")

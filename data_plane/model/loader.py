"""Loads a Hugging Face checkpoint directory (single or sharded safetensors) into our model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from data_plane.errors import ModelLoadError
from data_plane.model.config import ModelConfig
from data_plane.model.llama import LlamaForCausalLM, Projection

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
               device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Builds the model from ``model_dir`` and loads its weights in ``dtype`` on ``device``.

    Raises ModelLoadError when a file is missing, the architecture is unsupported, or a tensor
    is missing, unexpected, or shaped differently from what the config implies.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    files = checkpoint_files(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch_dtype)
    model = model.to_empty(device=device)
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
                    if _IGNORED.match(hf_name):
                        continue
                    pending -= _copy_tensor(model, params, hf_name, f.get_tensor(hf_name), path)
        except SafetensorError as e:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {e}") from None
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

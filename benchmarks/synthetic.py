"""Random-weight models and adapters of a real model's shape, written in Hugging Face / peft layout.

Benchmarks at a production model's size need its shapes, not its weights: a checkpoint of
Llama-3-8B's shape with random weights costs the same to serve. ``write_random_model`` writes one
(config, sharded safetensors, a tokenizer) that both our loader and transformers read;
``write_random_adapter`` writes a peft LoRA on all seven projections. By default the tokenizer and
vocabulary are the demo model's (49,152 entries), so that prompts are real text; the output head is
then smaller than Llama-3's 128,256 rows and everything else is the named shape. benchmarks/gpu.py
passes its own byte-level tokenizer and the full vocabulary instead (benchmarks/gpu_checkpoint.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from data_plane.model.demo_model import ensure_demo_model

DEMO_VOCAB = 49152
# Llama-3-8B's shape; ``vocab_size`` is its own, for stand-ins that never tokenize (adapter_load.py).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
}
# A few-million-parameter model of the same structure, for checking a benchmark end to end on a CPU.
TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": DEMO_VOCAB, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}
PRESETS = {"llama3-8b": LLAMA3_8B, "tiny": TINY}
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
SHARD_BYTES = 4 << 30
INIT_STD = 0.02  # transformers' default initializer_range for Llama


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Module name -> (in_features, out_features) of the seven projections of one layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _block(module: str) -> str:
    return "self_attn" if module in ALL_PROJECTIONS[:4] else "mlp"


def write_random_model(target: Path, preset: dict, dtype: torch.dtype, seed: int = 0, device: str = "cpu",
                       shard_bytes: int = SHARD_BYTES, tokenizer_dir: Path | None = None,
                       vocab_size: int = DEMO_VOCAB) -> Path:
    """A checkpoint of ``preset``'s shape with a ``vocab_size`` vocabulary (default: the demo
    tokenizer's), N(0, 0.02) weights, unit norms and an untied head, in ``dtype``, in shards of at
    most ``shard_bytes`` (or one tensor); random numbers are drawn on ``device`` (a GPU draws 8B of
    them in seconds). Returns ``target``. ``tokenizer_dir``: where the tokenizer files and a
    config.json with its special token ids are (default: the installed demo model's)."""
    demo = tokenizer_dir or ensure_demo_model(quiet=True)
    demo_config = json.loads((demo / "config.json").read_text())
    config = {**preset, "model_type": "llama", "vocab_size": vocab_size, "hidden_act": "silu", "rope_scaling": None,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
              "bos_token_id": demo_config["bos_token_id"], "eos_token_id": demo_config["eos_token_id"],
              "pad_token_id": demo_config["pad_token_id"], "torch_dtype": str(dtype).removeprefix("torch.")}
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(demo / name, target / name)

    hidden = config["hidden_size"]
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device=device).normal_(0.0, INIT_STD, generator=g).to(dtype).cpu()

    def tensors():  # drawn one at a time, so that only one shard is in memory
        yield "model.embed_tokens.weight", normal(vocab_size, hidden)
        for layer in range(config["num_hidden_layers"]):
            prefix = f"model.layers.{layer}"
            yield f"{prefix}.input_layernorm.weight", torch.ones(hidden, dtype=dtype)
            yield f"{prefix}.post_attention_layernorm.weight", torch.ones(hidden, dtype=dtype)
            for module, (n_in, n_out) in projection_shapes(config).items():
                yield f"{prefix}.{_block(module)}.{module}.weight", normal(n_out, n_in)
        yield "model.norm.weight", torch.ones(hidden, dtype=dtype)
        yield "lm_head.weight", normal(vocab_size, hidden)

    shards: list[list[str]] = []  # tensor names of each written shard
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        save_file(current, target / f"shard-{len(shards)}.tmp", metadata={"format": "pt"})
        shards.append(list(current))
        current.clear()

    for key, tensor in tensors():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            flush()
            size = 0
        current[key] = tensor
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for i, keys in enumerate(shards):  # Hugging Face's names need the shard count, known only now
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (target / f"shard-{i}.tmp").rename(target / name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return target


def write_random_adapter(target: Path, config: dict, rank: int, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16, b_std: float = 0.01, device: str = "cpu") -> Path:
    """A rank-``rank`` LoRA on all seven projections of every layer of a ``config``-shaped model, as
    peft saves it: A ~ N(0, 1/in_features), B ~ N(0, ``b_std``²) (nonzero, so the adapter changes the
    output), alpha = 2 × rank; random numbers drawn on ``device``. Returns ``target``."""
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.empty(rows, cols, device=device).normal_(0.0, std, generator=g).to(dtype).cpu()

    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (n_in, n_out) in projection_shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{_block(module)}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = normal(rank, n_in, n_in**-0.5)
            tensors[f"{prefix}.lora_B.weight"] = normal(n_out, rank, b_std)
    target.mkdir(parents=True)
    save_file(tensors, target / "adapter_model.safetensors")
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(ALL_PROJECTIONS),
                      "bias": "none", "task_type": "CAUSAL_LM"}
    (target / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return target

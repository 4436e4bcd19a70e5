"""The checkpoint benchmarks/gpu.py measures: a random-weight Llama of a named shape with a byte-level
tokenizer, and random PEFT adapters, each written once into the run's work directory.

The GPU machine has no network and no demo model, so the tokenizer is built here with the
``tokenizers`` package: one token per byte (ids 0-255, GPT-2's byte-to-character table), then BOS
and EOS. Our ``Tokenizer`` and transformers' ``AutoTokenizer`` read the same files and give the same
ids. The model keeps the preset's vocabulary (Llama-3's 128,256 rows for ``8b``): no prompt holds an
id past the tokenizer's, but the output head has its real size, which a decode step reads in full.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from synthetic import LLAMA3_8B, projection_shapes, write_random_adapter, write_random_model  # benchmarks/
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# Two layers of small width: the whole CPU run, transformers and peft included, takes well under a minute.
TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}
PRESETS = {"8b": LLAMA3_8B, "tiny": TINY}
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
BOS_ID, EOS_ID = 256, 257  # right after the 256 byte tokens
# B's spread: the adapter's product is ~30% of an 8B projection's output (2·b·sqrt(16) against 0.02·sqrt(4096)),
# so that it moves the logits far past the bfloat16 parity tolerance and a pod that dropped it fails the check.
ADAPTER_B_STD = 0.05


def _byte_characters() -> list[str]:
    """GPT-2's printable stand-in character of each byte 0..255 (what a ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def write_byte_tokenizer(target: Path) -> Path:
    """A byte-level tokenizer in ``target`` (token id = byte value, then BOS and EOS; BOS prepended to
    every encoded text), with the config.json entries that ``synthetic.write_random_model`` copies
    from a tokenizer directory. Returns ``target``."""
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_characters())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    target.mkdir(parents=True)
    tok.save(str(target / "tokenizer.json"))
    files = {
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                                  "add_bos_token": True, "model_max_length": 8192},
        "special_tokens_map.json": {"bos_token": BOS, "eos_token": EOS},
        "generation_config.json": {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID},
        "config.json": {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID},
    }
    for name, content in files.items():
        (target / name).write_text(json.dumps(content, indent=2))
    return target


def write_checkpoint(root: Path, preset: dict, dtype: torch.dtype, device: str) -> Path:
    """The model directory ``root/model``: ``preset``'s shape and vocabulary, random weights in
    ``dtype`` drawn on ``device``, the byte-level tokenizer."""
    tokenizer = write_byte_tokenizer(root / "tokenizer")
    return write_random_model(root / "model", preset, dtype, device=device, tokenizer_dir=tokenizer,
                              vocab_size=preset["vocab_size"])


def write_adapters(root: Path, config: dict, ranks: dict[str, int], dtype: torch.dtype, device: str) -> Path:
    """One random adapter ``root/<name>`` of each rank in ``ranks`` (name -> rank), distinct seeds;
    returns ``root``, the pods' adapter root."""
    for seed, (name, rank) in enumerate(ranks.items(), 1):
        write_random_adapter(root / name, config, rank, seed=seed, dtype=dtype, b_std=ADAPTER_B_STD, device=device)
    return root


def decode_weight_bytes(config: dict, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step must read: every projection and norm of every layer, the
    final norm and the output head (the embedding only gives one row per token: left out)."""
    hidden = config["hidden_size"]
    per_layer = sum(n_in * n_out for n_in, n_out in projection_shapes(config).values()) + 2 * hidden
    count = config["num_hidden_layers"] * per_layer + hidden + config["vocab_size"] * hidden
    return count * dtype.itemsize


def adapter_bytes(config: dict, rank: int, dtype: torch.dtype) -> int:
    """Bytes of one rank-``rank`` adapter on all seven projections of every layer (A and B)."""
    per_layer = sum(rank * (n_in + n_out) for n_in, n_out in projection_shapes(config).values())
    return config["num_hidden_layers"] * per_layer * dtype.itemsize

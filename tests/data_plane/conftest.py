"""A real pod process on the demo model, with the demo adapters and random adapters of other shapes."""

from __future__ import annotations

import pytest
import torch

from benchmarks.processes import PodProcess
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir

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
    (named, as a user who compares it with transformers + peft in float32 would)."""
    workdir = tmp_path_factory.mktemp("pod")
    process = PodProcess(workdir, "--dtype", "float32", "--max-loras", "4", "--max-cpu-loras", "8",
                         "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--num-kv-blocks", "192",
                         "--max-lora-rank", "64",
                         "--adapter-root", str(demo_adapter_dir(DEMO_ADAPTERS[0]).parent),
                         "--adapter-root", str(random_adapter_root))
    try:
        yield process.start()
    finally:
        process.stop()

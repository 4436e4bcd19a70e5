"""A tiny random Llama and PEFT adapters of varied shapes, saved by transformers and peft."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_plane.lora.runtime import LoraRuntime
from data_plane.model.llama import ForwardBatch
from tests.steps import SeqSlice, attention_inputs

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

WEIGHTS = "adapter_model.safetensors"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> LoraConfig kwargs: ranks 1/8/16/64, alpha != r, rsLoRA, rank_pattern, partial targets.
ADAPTERS = {
    "r1": dict(r=1, lora_alpha=2, target_modules=["q_proj", "v_proj"]),
    "r8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "r16rs": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "down_proj"]),
    "r64pat": dict(r=64, lora_alpha=32, target_modules=ALL, rank_pattern={"down_proj": 4, "q_proj": 12},
                   alpha_pattern={"up_proj": 3}),
}


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).eval()
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="session")
def tiny_adapters(tiny_base, tmp_path_factory):
    """Root directory holding one PEFT directory per entry of ADAPTERS."""
    root = tmp_path_factory.mktemp("adapters")
    save_random_adapters(tiny_base[1], ADAPTERS, root)
    return root


def save_random_adapters(model, specs: dict, root: Path) -> None:
    """Saves ``root/<name>``: peft's adapter of ``model`` for each name -> LoraConfig kwargs of ``specs``,
    its A and B drawn from N(0, 0.3²) (large enough that every adapter moves the logits)."""
    from peft import LoraConfig, get_peft_model

    for i, (name, kwargs) in enumerate(specs.items()):
        torch.manual_seed(100 + i)
        peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **kwargs))
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                torch.nn.init.normal_(p, std=0.3)
        peft_model.save_pretrained(root / name)


def forward_rows(model, runtime, rows: list[tuple[str | None, list[int]]]) -> list[torch.Tensor]:
    """Logits of every position of every row, all rows in ONE step; row = (adapter or None, ids)."""
    block = 16
    seqs, ids, positions, token_slots, start_block = [], [], [], [], 0
    for adapter, row_ids in rows:
        n_blocks = -(-len(row_ids) // block)
        seqs.append(SeqSlice(list(range(start_block, start_block + n_blocks)), 0, len(row_ids)))
        start_block += n_blocks
        slot = -1 if adapter is None else runtime.cache.slot_of(adapter)
        ids += row_ids
        positions += list(range(len(row_ids)))
        token_slots += [slot] * len(row_ids)
    cache = model.new_kv_cache(start_block, block)
    attn = attention_inputs(seqs, block)
    batch = ForwardBatch(torch.tensor(ids), torch.tensor(positions), attn, cache,
                         lora=runtime.step_metadata(token_slots))
    with torch.inference_mode():
        logits = model.logits(model(batch))
    return list(logits.split([len(r) for _, r in rows]))


def runtime_with_adapters(model, root: Path, names, max_loras: int, max_rank: int = 64) -> LoraRuntime:
    """Wraps ``model`` (in place) with LoRA slots and puts each adapter ``root/<name>`` in a slot."""
    runtime = LoraRuntime(model, max_loras=max_loras, max_cpu_loras=max_loras, max_rank=max_rank, max_tokens=512,
                          adapter_roots=(root,))
    for name in names:
        runtime.load(name, name)
        runtime.cache.acquire(name)
    return runtime


def peft_row_logits(hf_model, root: Path, names):
    """``logits(adapter or None, ids)``: peft's logits for one row, on a copy of ``hf_model`` holding
    every adapter ``root/<name>`` (None runs with the adapters disabled)."""
    from peft import PeftModel

    names = list(names)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf_model), root / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(root / name, adapter_name=name)
    peft_model.eval()

    def logits(adapter: str | None, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            if adapter is None:
                with peft_model.disable_adapter():
                    return peft_model(torch.tensor([ids])).logits[0]
            peft_model.set_adapter(adapter)
            return peft_model(torch.tensor([ids])).logits[0]

    return logits


# Breaking a valid PEFT directory in place: the malformed-adapter tests build their corpus with these.
def edit_config(path: Path, **changes) -> None:
    """Rewrites ``adapter_config.json`` with ``changes``."""
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
    """Rewrites the weights after ``fn(tensors)`` changed the dict of tensors in place."""
    tensors = load_file(path / WEIGHTS)
    fn(tensors)
    save_file(tensors, path / WEIGHTS)


class RunsCode:
    """Pickled, runs a shell command when unpickled by an unsafe loader (it creates a marker file)."""

    MARKER = "/tmp/lorafleet-pickle-ran"

    def __reduce__(self):
        return (os.system, (f"touch {self.MARKER}",))

"""PEFT adapters of every served family give, row by row in one mixed batch, the logits peft gives on
transformers' model: Qwen3, Gemma 2 and Gemma 3 with the split projection names, Phi-3 with its packed
``qkv_proj`` / ``gate_up_proj`` and with the split names that adapters trained on a Llama-layout copy of
Phi-3 carry (peft cannot put those on transformers' Phi-3, so their reference is that Llama copy)."""

from __future__ import annotations

import pytest
import torch

from data_plane.model import load_model
from tests.lora.conftest import ALL, forward_rows, peft_row_logits, runtime_with_adapters, save_random_adapters
from tests.model.conftest import gemma3_vision_language_config
from tests.tolerances import logits_atol, longest_sum, magnitude

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
GEMMA = dict(COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
             layer_types=["sliding_attention", "full_attention"])
SPLIT = {"r8": dict(r=8, lora_alpha=16, target_modules=ALL),
         "r4rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "v_proj", "up_proj"])}
PACKED = {"r8": dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
          "r4rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["qkv_proj", "down_proj"])}


def _config(family: str):
    import transformers as tf

    return {
        "qwen3": lambda: tf.Qwen3Config(**COMMON, head_dim=32),
        "gemma2": lambda: tf.Gemma2Config(**GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
        "gemma3": lambda: tf.Gemma3TextConfig(**GEMMA, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        "phi3": lambda: tf.Phi3Config(**COMMON, pad_token_id=0, eos_token_id=2),
        # q/k/v of its SigLIP tower are adapted too: left out, as text prompts never reach them
        "gemma3-vision-language": lambda: gemma3_vision_language_config(GEMMA),
    }[family]()


def _random_model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def _llama_layout(phi3):
    """transformers' Llama with ``phi3``'s weights, q/k/v and gate/up split: what split-name Phi-3
    adapters were trained on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = phi3.config
    llama = LlamaForCausalLM(LlamaConfig(**COMMON, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).eval()
    state = {}
    q, kv, ffn = c.num_attention_heads * 16, c.num_key_value_heads * 16, c.intermediate_size
    for name, tensor in phi3.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            for part, t in zip("qkv", tensor.split([q, kv, kv]), strict=True):
                state[f"{stem}{part}_proj.weight"] = t
        elif name.endswith("gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            state[f"{stem}gate_proj.weight"], state[f"{stem}up_proj.weight"] = tensor.split([ffn, ffn])
        else:
            state[name] = tensor
    llama.load_state_dict(state, strict=True)
    return llama


@pytest.mark.parametrize(("family", "layout"), [("qwen3", "split"), ("gemma2", "split"), ("gemma3", "split"),
                                                ("gemma3-vision-language", "split"), ("phi3", "packed"),
                                                ("phi3", "split")])
def test_family_adapters_in_one_batch_match_peft(tmp_path, family, layout):
    hf = _random_model(_config(family))
    hf.save_pretrained(tmp_path / "base")
    reference_base = _llama_layout(hf) if (family, layout) == ("phi3", "split") else hf
    specs = SPLIT if layout == "split" else PACKED
    save_random_adapters(reference_base, specs, tmp_path)
    peft_logits = peft_row_logits(reference_base, tmp_path, specs)
    model = load_model(tmp_path / "base", "float32")
    runtime = runtime_with_adapters(model, tmp_path, specs, max_loras=2, max_rank=8)
    g = torch.Generator().manual_seed(7)
    rows = [(a, torch.randint(0, 256, (9 + 4 * i,), generator=g).tolist()) for i, a in enumerate([None, *specs])]
    rows.append(("r8", rows[1][1]))  # an adapter twice in one step
    got = forward_rows(model, runtime, rows)
    atol = logits_atol(longest_sum(model.config, rank=8, tokens=21), magnitude(torch.cat(got)))
    for (adapter, ids), logits in zip(rows, got, strict=True):
        assert (logits - peft_logits(adapter, ids)).abs().max().item() < atol, adapter
    assert (got[1] - forward_rows(model, runtime, [(None, rows[1][1])])[0]).abs().max().item() > 100 * atol

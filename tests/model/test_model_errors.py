"""A model directory that cannot be served is refused with a message that says why."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_plane.errors import ModelLoadError
from data_plane.model import load_model


@pytest.fixture
def tiny_llama(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return tmp_path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_tiny_llama_loads(tiny_llama):
    assert load_model(tiny_llama).config.num_layers == 1


def test_unsupported_architecture_is_named(tiny_llama):
    _edit_config(tiny_llama, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tiny_llama)


def test_missing_config_is_reported(tmp_path):
    with pytest.raises(ModelLoadError, match="needs config.json"):
        load_model(tmp_path)


def test_missing_weights_are_reported(tiny_llama):
    (tiny_llama / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing weight files"):
        load_model(tiny_llama)


def test_shape_mismatch_names_the_tensor(tiny_llama):
    _edit_config(tiny_llama, intermediate_size=64)
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight has shape \(\d+, \d+\) but config.json implies"):
        load_model(tiny_llama)


def test_missing_tensor_is_reported(tiny_llama):
    path = tiny_llama / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"lacks weights .*qkv_proj\.weight\[v\]"):
        load_model(tiny_llama)


def test_unexpected_tensor_is_reported(tiny_llama):
    path = tiny_llama / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match="unexpected tensor model.layers.0.self_attn.q_norm.weight"):
        load_model(tiny_llama)


def test_corrupt_safetensors_is_reported(tiny_llama):
    (tiny_llama / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_model(tiny_llama)


def test_unsupported_rope_scaling_is_named(tiny_llama):
    _edit_config(tiny_llama, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'yarn'"):
        load_model(tiny_llama)


def test_other_vision_language_models_are_refused_by_name(tiny_llama):
    # Gemma 3's is served (its text model); other vision-language architectures are not.
    _edit_config(tiny_llama, architectures=["LlavaForConditionalGeneration"])
    with pytest.raises(ModelLoadError,
                       match="unsupported architecture 'LlavaForConditionalGeneration'.*Gemma3ForCondition"):
        load_model(tiny_llama)


def test_unsupported_activation_is_named(tiny_llama):
    _edit_config(tiny_llama, hidden_act="relu")
    with pytest.raises(ModelLoadError, match="unsupported activation 'relu'"):
        load_model(tiny_llama)


@pytest.mark.parametrize(("changes", "message"), [
    (dict(partial_rotary_factor=0.375), "partial_rotary_factor gives 3 rotary dimensions of a head of 8"),
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3},
          original_max_position_embeddings=64),
     "longrope short_factor has 3 entries, but the 8 rotary dimensions need 4"),
])
def test_rope_settings_that_do_not_fit_the_head_are_named(tiny_llama, changes, message):
    _edit_config(tiny_llama, architectures=["Phi3ForCausalLM"], rope_parameters=None, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model(tiny_llama)


def test_a_family_config_over_weights_without_its_tensors_is_refused(tiny_llama):
    # Qwen3 over Llama weights: the q/k norms it needs are not in the checkpoint.
    _edit_config(tiny_llama, architectures=["Qwen3ForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"lacks weights for 2 tensors.*self_attn\.k_norm\.weight"):
        load_model(tiny_llama)

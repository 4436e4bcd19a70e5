"""config.json files as the Hub holds them (written before transformers 5 named every layer's type and
each layer type's RoPE) give each family's layout."""

from __future__ import annotations

import math

from data_plane.model.config import ModelConfig

SIZES = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
             num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6)


def test_gemma3_hub_config_without_layer_types():
    # gemma-3-1b-it's fields: every sixth layer global, the others sliding with their own RoPE base.
    config = ModelConfig.from_dict(dict(
        SIZES, architectures=["Gemma3ForCausalLM"], num_hidden_layers=26, sliding_window=512,
        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
        query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
        attn_logit_softcapping=None))
    globals_ = [i for i, w in enumerate(config.sliding_windows) if w is None]
    assert globals_ == [5, 11, 17, 23]
    assert set(config.sliding_windows) == {None, 512}
    assert (config.rope.theta, config.local_rope.theta) == (1000000.0, 10000.0)
    assert config.qk_norm and config.sandwich_norms and config.norm_offset == 1.0
    assert config.embed_scale == math.sqrt(1152) and config.attn_scale == 256**-0.5
    assert config.attn_softcap is None and config.final_softcap is None


def test_gemma3_linear_rope_scaling_applies_to_global_layers_only():
    # The 4B-27B text configs scale the global RoPE by 8; the sliding layers keep theirs.
    config = ModelConfig.from_dict(dict(
        SIZES, architectures=["Gemma3ForCausalLM"], num_hidden_layers=6, sliding_window=1024,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert (config.rope.rope_type, config.rope.factor) == ("linear", 8.0)
    assert (config.local_rope.rope_type, config.local_rope.theta) == ("default", 10000.0)


def test_gemma2_hub_config_alternates_sliding_and_global_layers():
    config = ModelConfig.from_dict(dict(
        SIZES, architectures=["Gemma2ForCausalLM"], num_hidden_layers=4, sliding_window=4096, rope_theta=10000.0,
        query_pre_attn_scalar=224, attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    assert config.sliding_windows == (4096, None, 4096, None)
    assert (config.attn_softcap, config.final_softcap, config.attn_scale) == (50.0, 30.0, 224**-0.5)
    assert config.local_rope is None and not config.qk_norm


def test_phi4_mini_hub_config():
    # Phi-4-mini's fields: longrope in the old `rope_scaling`, partial rotary at the top level.
    config = ModelConfig.from_dict(dict(
        architectures=["Phi3ForCausalLM"], vocab_size=200064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
        original_max_position_embeddings=4096, partial_rotary_factor=0.75, rope_theta=10000.0,
        sliding_window=262144, rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                                             "long_factor": [2.0] * 48}))
    assert config.rotary_dim == 96 and config.max_position_embeddings == 4096
    assert config.rope.attention_factor == math.sqrt(1 + math.log(32) / math.log(4096))


def test_qwen3_sliding_window_only_when_enabled():
    raw = dict(SIZES, architectures=["Qwen3ForCausalLM"], num_hidden_layers=2, sliding_window=4096)
    assert ModelConfig.from_dict(raw).sliding_windows == (None, None)
    assert ModelConfig.from_dict(raw | {"use_sliding_window": True}).sliding_windows == (4096, 4096)
    # transformers slides from layer max_window_layers on
    enabled = raw | {"use_sliding_window": True, "max_window_layers": 1}
    assert ModelConfig.from_dict(enabled).sliding_windows == (None, 4096)


def test_gemma3_vision_language_hub_config_reads_its_sparse_text_config():
    # gemma-3-4b-it's config.json: the text_config leaves heads, head_dim, vocabulary and RoPE bases to
    # transformers' defaults.
    config = ModelConfig.from_dict(dict(
        architectures=["Gemma3ForConditionalGeneration"], eos_token_id=[1, 106],
        text_config=dict(hidden_size=2560, intermediate_size=10240, model_type="gemma3_text", num_hidden_layers=34,
                         rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024),
        vision_config=dict(hidden_size=1152, model_type="siglip_vision_model")))
    assert config.architecture == "Gemma3ForCausalLM" and config.eos_token_ids == (1, 106)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (8, 4, 256, 262208)
    assert (config.rope.theta, config.rope.factor, config.local_rope.theta) == (1000000.0, 8.0, 10000.0)
    assert config.sliding_windows[:6] == (1024,) * 5 + (None,) and config.tie_word_embeddings

"""Random-weight Llama, Mistral and Qwen2 checkpoints saved by transformers load and match it."""

from __future__ import annotations

import pytest
import torch

from data_plane.model import load_model
from tests.model.conftest import gemma3_vision_language_config, run_chunks
from tests.tolerances import logits_atol, longest_sum, magnitude

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _save(tmp_path, config, shard: bool = False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    for p in model.parameters():  # biases are zero-initialised; make them matter
        torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "10GB")
    return model


def _check(tmp_path, hf_model, length=40, chunks=None):
    ids = torch.randint(0, COMMON["vocab_size"], (length,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = run_chunks(load_model(tmp_path, "float32"), ids, chunks or [length])
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0]
    config = getattr(hf_model.config, "text_config", hf_model.config)  # a vision-language model: its text model
    atol = logits_atol(longest_sum(config, tokens=length), magnitude(ref))
    assert (ours - ref).abs().max().item() < atol


def test_qwen2_with_qkv_bias_matches_transformers(tmp_path):
    from transformers import Qwen2Config

    hf = _save(tmp_path, Qwen2Config(**COMMON, tie_word_embeddings=False))
    assert hf.model.layers[0].self_attn.q_proj.bias is not None
    _check(tmp_path, hf)


def test_mistral_with_sliding_window_matches_transformers(tmp_path):
    from transformers import MistralConfig

    hf = _save(tmp_path, MistralConfig(**COMMON, sliding_window=8, head_dim=24))
    _check(tmp_path, hf, length=30, chunks=[10, 1, 19])


def test_sharded_llama3_rope_scaling_untied_matches_transformers(tmp_path):
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf = _save(tmp_path, LlamaConfig(**COMMON, rope_parameters=rope, tie_word_embeddings=False), shard=True)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _check(tmp_path, hf, length=100)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stays_close_to_float32(tmp_path, dtype):
    from transformers import LlamaConfig

    _save(tmp_path, LlamaConfig(**COMMON))
    ids = list(range(1, 30))
    full = run_chunks(load_model(tmp_path, "float32"), ids, [len(ids)])
    half = run_chunks(load_model(tmp_path, dtype), ids, [len(ids)])
    assert load_model(tmp_path, dtype).embed_tokens.weight.dtype == getattr(torch, dtype)
    assert (full - half).abs().max().item() < 0.1 * full.abs().max().item()


def test_qwen3_with_qk_norm_matches_transformers(tmp_path):
    from transformers import Qwen3Config

    hf = _save(tmp_path, Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False))
    assert hf.model.layers[0].self_attn.q_norm.weight.shape == (32,)
    _check(tmp_path, hf, length=30, chunks=[10, 1, 19])


def test_phi3_fused_checkpoint_with_partial_rotary_and_window_matches_transformers(tmp_path):
    from transformers import Phi3Config

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    hf = _save(tmp_path, Phi3Config(**COMMON, rope_parameters=rope, sliding_window=12, pad_token_id=0,
                                    eos_token_id=2))
    assert hf.model.layers[0].self_attn.qkv_proj.weight.shape == (64 + 2 * 32, 64)
    _check(tmp_path, hf, length=30, chunks=[10, 1, 19])


def test_phi4_mini_longrope_and_partial_rotary_match_transformers_within_the_original_context(tmp_path):
    from transformers import Phi3Config

    # Phi-4-mini's shape of config: longrope, 3/4 of each head rotated, a context 8x the original one.
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.3 * i for i in range(6)], "long_factor": [5.0 + i for i in range(6)]}
    config = Phi3Config(**COMMON | {"max_position_embeddings": 512}, original_max_position_embeddings=64,
                        rope_parameters=rope, pad_token_id=0, eos_token_id=2)
    hf = _save(tmp_path, config)
    _check(tmp_path, hf, length=40, chunks=[20, 1, 19])
    # transformers switches every position to the long factors past the original context; served: that context
    assert load_model(tmp_path).config.max_position_embeddings == 64


GEMMA = dict(COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"])


def test_gemma2_soft_capping_and_sandwich_norms_match_transformers(tmp_path):
    from transformers import Gemma2Config

    # Caps near the scores' and logits' size, so that tanh bends them.
    hf = _save(tmp_path, Gemma2Config(**GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0))
    _check(tmp_path, hf, length=30, chunks=[10, 1, 19])


def test_gemma3_local_rope_and_qk_norm_match_transformers(tmp_path):
    from transformers import Gemma3TextConfig

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
    hf = _save(tmp_path, Gemma3TextConfig(**GEMMA, rope_parameters=rope))
    _check(tmp_path, hf, length=30, chunks=[10, 1, 19])


def test_gemma3_vision_language_checkpoint_serves_its_text_model(tmp_path):
    # Gemma 3 4B-27B are saved as Gemma3ForConditionalGeneration: the language model is read, the vision side
    # left out; a text prompt's logits are transformers' for that checkpoint.
    hf = _save(tmp_path, gemma3_vision_language_config(GEMMA))
    _check(tmp_path, hf, length=30, chunks=[10, 1, 19])
    assert load_model(tmp_path).config.architecture == "Gemma3ForCausalLM"


@pytest.mark.parametrize("family", ["Qwen3Config", "Phi3Config", "Gemma2Config", "Gemma3TextConfig"])
def test_each_family_in_bfloat16_stays_close_to_float32(tmp_path, family):
    import transformers

    extra = dict(GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0) if "Gemma" in family else {}
    _save(tmp_path, getattr(transformers, family)(**COMMON | extra | {"pad_token_id": 0, "eos_token_id": 2}))
    ids = list(range(1, 30))
    full = run_chunks(load_model(tmp_path, "float32"), ids, [len(ids)])
    half = run_chunks(load_model(tmp_path, "bfloat16"), ids, [20, 1, 8])
    assert (full - half).abs().max().item() < 0.1 * full.abs().max().item()

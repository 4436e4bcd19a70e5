from __future__ import annotations

import pytest
import torch

from data_plane.model.llama import ForwardBatch
from tests.steps import SeqSlice, attention_inputs

BLOCK = 16


def run_chunks(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids``, fed to the model in chunks of the given sizes
    through one paged KV cache (a single chunk is a plain prefill)."""
    assert sum(chunks) == len(ids)
    num_blocks = -(-len(ids) // BLOCK) + 1
    # Blocks in reverse order: attention must follow the block table, not slot order.
    blocks = list(reversed(range(num_blocks)))
    cache = model.new_kv_cache(num_blocks, BLOCK)
    out, done = [], 0
    with torch.inference_mode():
        for n in chunks:
            attn = attention_inputs([SeqSlice(blocks, done, n)], BLOCK)
            batch = ForwardBatch(torch.tensor(ids[done : done + n]), torch.arange(done, done + n), attn, cache)
            out.append(model.logits(model(batch)))
            done += n
    return torch.cat(out)


def gemma3_vision_language_config(text: dict):
    """transformers' Gemma 3 vision-language config around the text model ``text``, with a tiny SigLIP tower."""
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    return Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                        boi_token_index=text["vocab_size"] - 3, eoi_token_index=text["vocab_size"] - 2,
                        image_token_index=text["vocab_size"] - 1)


@pytest.fixture
def chunked():
    return run_chunks


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama (GQA, untied head) saved by transformers in float32, weights large enough that its logits
    are far from flat: the unquantized base of the FP8 tests (weights, KV cache)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(43)
    path = tmp_path_factory.mktemp("fp8-base")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path

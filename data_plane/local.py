"""Generation in this process, without any server: ``lorafleet generate --local``."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from data_plane.detokenizer import IncrementalDetokenizer
from data_plane.model.attention import SeqSlice, build_attention_metadata
from data_plane.model.llama import ForwardBatch, LlamaForCausalLM
from data_plane.model.tokenizer import Tokenizer

_BLOCK_SIZE = 16


@torch.inference_mode()
def greedy_stream(model: LlamaForCausalLM, tokenizer: Tokenizer, prompt_ids: list[int],
                  max_tokens: int) -> Iterator[str]:
    """Yields the text of a greedy continuation of ``prompt_ids`` as it is produced."""
    total = min(len(prompt_ids) + max_tokens, model.config.max_position_embeddings)
    num_blocks = -(-total // _BLOCK_SIZE)
    cache = model.new_kv_cache(num_blocks, _BLOCK_SIZE)
    blocks = list(range(num_blocks))
    detok = IncrementalDetokenizer(tokenizer)
    device = model.embed_tokens.weight.device
    cached, new = 0, list(prompt_ids)
    while cached + len(new) < total:
        attn = build_attention_metadata([SeqSlice(blocks, cached, len(new))], _BLOCK_SIZE, model.windows, device)
        batch = ForwardBatch(torch.tensor(new, device=device),
                             torch.arange(cached, cached + len(new), device=device), attn, cache)
        token = int(model.logits(model(batch)[-1:]).argmax())
        if token in tokenizer.eos_token_ids:
            break
        cached, new = cached + len(new), [token]
        yield detok.add(token)
    yield detok.flush()

"""Attention over a paged KV cache.

The cache stores keys and values in fixed-size blocks; a sequence owns a list of blocks (its
block table). Each step writes the new tokens' keys and values into their slots, then every
sequence attends over its whole context gathered through its block table. The batch is
padded to [num_seqs, max_new_tokens] queries × [num_seqs, max_context] keys, which serves
prefill, decode and a mix of both with one call to scaled-dot-product attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step: ``num_new`` tokens whose first position is
    ``num_cached`` (the tokens before it are already in the cache)."""

    block_table: Sequence[int]
    num_cached: int
    num_new: int


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot that receives each new token
    query_index: torch.Tensor  # [num_seqs, max_new] token index of each padded query (pad -> 0)
    key_index: torch.Tensor  # [num_seqs, max_context] cache slot of each padded key (pad -> 0)
    out_index: torch.Tensor  # [num_tokens] row of each token in the flattened padded queries
    masks: dict[int | None, torch.Tensor]  # window -> [num_seqs, 1, max_new, max_context] bool


class KVCache:
    """Keys and values of every layer in one preallocated tensor each."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def build_attention_metadata(
    seqs: Sequence[SeqSlice],
    block_size: int,
    windows: set[int | None],
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Index tensors for one step over ``seqs``, whose new tokens are laid out one
    sequence after another in the step's token dimension."""
    num_seqs = len(seqs)
    max_new = max(s.num_new for s in seqs)
    max_ctx = max(s.num_cached + s.num_new for s in seqs)
    slot_mapping, out_index = [], []
    query_index = torch.zeros(num_seqs, max_new, dtype=torch.long)
    key_index = torch.zeros(num_seqs, max_ctx, dtype=torch.long)
    query_pos = torch.full((num_seqs, max_new), -1, dtype=torch.long)  # -1 marks padding
    ctx_lens = torch.zeros(num_seqs, dtype=torch.long)
    token = 0
    for b, s in enumerate(seqs):
        ctx = s.num_cached + s.num_new
        if len(s.block_table) * block_size < ctx:
            raise ValueError(f"sequence {b} needs {ctx} slots but owns {len(s.block_table)} blocks")
        pos = torch.arange(ctx)
        blocks = torch.as_tensor(list(s.block_table), dtype=torch.long)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        key_index[b, :ctx] = slots
        slot_mapping.append(slots[s.num_cached:])
        query_index[b, : s.num_new] = torch.arange(token, token + s.num_new)
        query_pos[b, : s.num_new] = pos[s.num_cached:]
        out_index.append(torch.arange(s.num_new) + b * max_new)
        ctx_lens[b] = ctx
        token += s.num_new
    key_pos = torch.arange(max_ctx)
    base = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < ctx_lens[:, None, None])
    masks = {}
    for window in windows:
        mask = base if window is None else base & (key_pos[None, None, :] > query_pos[:, :, None] - window)
        # Padded query rows attend to key 0 so that softmax never sees an empty row.
        mask = mask | ((query_pos[:, :, None] < 0) & (key_pos[None, None, :] == 0))
        masks[window] = mask[:, None].to(device)
    return AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping).to(device),
        query_index=query_index.to(device),
        key_index=key_index.to(device),
        out_index=torch.cat(out_index).to(device),
        masks=masks,
    )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim] (one layer)
    v_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim] (one layer)
    meta: AttentionMetadata,
    window: int | None,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    # index_select over flat indices: ~3x faster on CPU than advanced indexing with a 2-D index.
    qp = _gather(q, meta.query_index).transpose(1, 2)  # [seqs, heads, max_new, head_dim]
    kp = _gather(k_cache, meta.key_index).transpose(1, 2)  # [seqs, kv_heads, max_ctx, head_dim]
    vp = _gather(v_cache, meta.key_index).transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.masks[window], scale=scale,
                                         enable_gqa=True)
    out = out.transpose(1, 2).reshape(-1, q.shape[1] * q.shape[2])  # [seqs * max_new, heads * head_dim]
    return out[meta.out_index]


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` for a 2-D ``index``: [a, b] + rows.shape[1:]."""
    return rows.index_select(0, index.reshape(-1)).view(*index.shape, *rows.shape[1:])

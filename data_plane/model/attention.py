"""Attention over a paged KV cache.

The cache stores keys and values in fixed-size blocks; a sequence owns a list of blocks (its
block table). Each step writes the new tokens' keys and values into their slots, then every
sequence attends over its whole context gathered through its block table, in fixed key tiles
(``tiled_attention``): a query's output depends on its own sequence alone, whatever shares the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from data_plane.model.tiled_attention import AttentionGroup, build_groups, tiled_attention


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
    groups: tuple[AttentionGroup, ...]  # the step's sequences, grouped by their number of new tokens


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
    slot_mapping = []
    for b, s in enumerate(seqs):
        if len(s.block_table) * block_size < s.num_cached + s.num_new:
            raise ValueError(f"sequence {b} needs {s.num_cached + s.num_new} slots but owns "
                             f"{len(s.block_table)} blocks")
        pos = torch.arange(s.num_cached, s.num_cached + s.num_new)
        blocks = torch.as_tensor(list(s.block_table), dtype=torch.long)
        slot_mapping.append(blocks[pos // block_size] * block_size + pos % block_size)
    return AttentionMetadata(torch.cat(slot_mapping).to(device), build_groups(seqs, block_size, windows, device))


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
    return tiled_attention(q, k_cache, v_cache, meta.groups, window, scale)

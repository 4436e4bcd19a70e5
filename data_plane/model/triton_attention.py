"""The CUDA attention backend: the Triton paged-attention kernels read keys and values in place
through the block tables (``kernels.paged_attention``); nothing is gathered or padded.

Everything here is capturable in a CUDA graph: the kernels' grids depend only on tensor shapes and
the step's host bounds, and the cache write is one ``index_copy_`` per layer. Under Triton's
interpreter the same code runs on CPU tensors (the tests do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.model.attention import AttentionInputs
from kernels.paged_attention import paged_attention


@dataclass(frozen=True)
class PagedAttention:
    inputs: AttentionInputs

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, window: int | None, scale: float, softcap: float | None = None) -> torch.Tensor:
        a = self.inputs
        k_cache.index_copy_(0, a.slot_mapping, k)
        v_cache.index_copy_(0, a.slot_mapping, v)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [num_tokens, heads, head_dim]
        paged_attention(q, k_cache, v_cache, a.block_tables, a.seq_lens, a.query_start, out,
                        block_size=a.block_size, scale=scale, window=window, max_query_len=a.max_query_len,
                        max_seq_len=a.max_seq_len, softcap=softcap)
        return out.view(q.shape[0], -1)


class TritonAttention:
    def prepare(self, inputs: AttentionInputs) -> PagedAttention:
        return PagedAttention(inputs)

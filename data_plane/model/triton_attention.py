"""The CUDA attention backend: the unified Triton paged-attention kernel reads keys and values in
place through the block tables (``kernels.paged_attention``), one launch per layer for decodes and
prefill chunks alike; nothing is gathered or padded.

Everything here is capturable in a CUDA graph: the kernel's grid depends only on tensor shapes and
whether the step may hold prefill chunks, the cache write is one ``index_copy_`` per layer, and the
decode splits' workspace is allocated once per step (its counters zeroed once) and reused by every
layer. Under Triton's interpreter the same code runs on CPU tensors (the tests do).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from data_plane.model.attention import AttentionInputs, write_kv
from kernels.attention_unified import AttentionWorkspace, default_tiles
from kernels.paged_attention import paged_attention


@dataclass(frozen=True)
class PagedAttention:
    inputs: AttentionInputs
    # The step's decode workspace by (num_heads, num_kv_heads, head_dim, dtype): filled by the first
    # layer of each shape, reused by the others.
    workspaces: dict[tuple, AttentionWorkspace] = field(default_factory=dict)

    def _workspace(self, q: torch.Tensor, k_cache: torch.Tensor) -> AttentionWorkspace:
        num_heads, head_dim = q.shape[1], q.shape[2]
        key = (num_heads, k_cache.shape[1], head_dim, q.dtype)
        if key not in self.workspaces:
            max_splits = default_tiles(head_dim, q.dtype).max_splits
            self.workspaces[key] = AttentionWorkspace.allocate(self.inputs.seq_lens.shape[0], num_heads,
                                                               k_cache.shape[1], head_dim, max_splits, q.device)
        return self.workspaces[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, window: int | None, scale: float, softcap: float | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        a = self.inputs
        write_kv(k_cache, a.slot_mapping, k, k_scale)
        write_kv(v_cache, a.slot_mapping, v, v_scale)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [num_tokens, heads, head_dim]
        paged_attention(q, k_cache, v_cache, a.block_tables, a.seq_lens, a.query_start, out,
                        block_size=a.block_size, scale=scale, window=window, max_query_len=a.max_query_len,
                        max_seq_len=a.max_seq_len, softcap=softcap, workspace=self._workspace(q, k_cache),
                        k_scale=k_scale, v_scale=v_scale)
        return out.view(q.shape[0], -1)


class TritonAttention:
    def prepare(self, inputs: AttentionInputs) -> PagedAttention:
        return PagedAttention(inputs)

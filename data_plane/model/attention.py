"""Attention over a paged KV cache: the cache, a step's attention inputs, and the backend seam.

The cache stores keys and values in fixed-size blocks; a sequence owns a list of blocks (its block
table). Each step writes the new tokens' keys and values into their slots, then every new token
attends to its sequence's context through the block table. How it attends is the backend's
business, chosen once per model by device (``attention_backends.attention_backend``): gathered context in fixed key
tiles on CPU (``torch_attention``), the Triton paged kernels on CUDA (``triton_attention``). The model calls
``backend.prepare(inputs)`` once per forward and the returned ``StepAttention`` in every layer, so
no layer branches on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionInputs:
    """What every backend reads for one step; built by tensor ops into preallocated buffers
    (``data_plane.engine.step_inputs``). Sequence ``b``'s new tokens are the step's tokens
    ``query_start[b]:query_start[b + 1]``; they sit at the last positions of its context of
    ``seq_lens[b]`` tokens. A sequence with ``seq_lens[b] == 0`` is padding (its rows come out zero)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot that receives each new token's key and value
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, block of each sequence's j-th block of context
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    query_start: torch.Tensor  # [num_seqs + 1] int32, first token of each sequence in the step
    max_query_len: int  # host bound on the new tokens of a sequence (1: a decode-only step)
    max_seq_len: int  # host bound on seq_lens
    block_size: int  # tokens per cache block


class KVCache:
    """Keys and values of every layer in one preallocated tensor each. One block past ``num_blocks``
    is never handed out: padding tokens of a fixed-size (CUDA-graph) step write there."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]

    @property
    def pad_slot(self) -> int:
        """The first slot of the block no sequence owns."""
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


class StepAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim] (one layer)
        v_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim] (one layer)
        window: int | None,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Writes ``k``, ``v`` to their slots, then returns each token's attention over its context
        (positions ``p - window + 1 ..= p`` with a window), scores ``scale·q·k`` soft-capped to
        ``softcap·tanh(scores / softcap)`` when ``softcap`` is set."""


class AttentionBackend(Protocol):
    def prepare(self, inputs: AttentionInputs) -> StepAttention:
        """What the layers of one step call; runs once per forward, without syncing with the host."""

"""Attention over a paged KV cache: the cache, a step's attention inputs, and the backend seam.

The cache stores keys and values in fixed-size blocks; a sequence owns a list of blocks (its block
table). Each step writes the new tokens' keys and values into their slots, then every new token
attends to its sequence's context through the block table. How it attends is the backend's
business, chosen once per model by device (``attention_backends.attention_backend``): gathered context in fixed key
tiles on CPU (``torch_attention``), the Triton paged kernels on CUDA (``triton_attention``). The model calls
``backend.prepare(inputs)`` once per forward and the returned ``StepAttention`` in every layer, so
no layer branches on the device.

With ``--kv-cache-dtype fp8`` the cache holds float8_e4m3fn: each layer's keys divided by its ``k_scale`` and
its values by its ``v_scale`` (``data_plane.model.kv_scales`` says where the scales come from), rounded to
e4m3 and saturated to ±448 (``write_kv``, the one write every backend makes); every backend reads a key back as
``e4m3.float() * k_scale`` before its usual float32 math (``kernels.reference.paged_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

KV_CACHE_DTYPES = ("auto", "fp8")  # what --kv-cache-dtype accepts: the model's dtype, or float8_e4m3fn
KV_FP8 = torch.float8_e4m3fn
KV_FP8_MAX = float(torch.finfo(KV_FP8).max)  # 448


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


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in float32, saturated to ±448 and rounded to e4m3 (nearest, ties to even)."""
    return (x.float() / scale).clamp_(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
    """``cache[slots] = x``: one layer's new keys (or values) [tokens, kv_heads, head_dim] into their slots,
    quantized by ``scale`` into an e4m3 cache (``quantize_kv``), as they are into any other. Capturable."""
    if cache.dtype == KV_FP8:  # torch has no index_copy_ for float8 on CPU: the bytes are copied
        cache.view(torch.uint8).index_copy_(0, slots, quantize_kv(x, scale).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, x)


class KVCache:
    """Keys and values of every layer in one preallocated tensor each. One block past ``num_blocks``
    is never handed out: padding tokens of a fixed-size (CUDA-graph) step write there. An e4m3 cache
    (``KV_FP8``) has each layer's scales in ``k_scales`` and ``v_scales``; any other has scales of 1."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]
        if dtype == KV_FP8 and scales is None:
            raise ValueError("an FP8 KV cache needs its layers' k and v scales")
        self.k_scales, self.v_scales = scales or ((1.0,) * num_layers, (1.0,) * num_layers)
        if len(self.k_scales) != num_layers or len(self.v_scales) != num_layers:
            raise ValueError(f"a KV cache of {num_layers} layers needs {num_layers} k and v scales each")

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
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Writes ``k``, ``v`` to their slots (``write_kv``, by ``k_scale`` and ``v_scale`` into an e4m3 cache),
        then returns each token's attention over its context (positions ``p - window + 1 ..= p`` with a window),
        scores ``scale·q·k`` soft-capped to ``softcap·tanh(scores / softcap)`` when ``softcap`` is set; an e4m3
        cache's keys and values are read as ``e4m3 · k_scale`` and ``e4m3 · v_scale``."""


class AttentionBackend(Protocol):
    def prepare(self, inputs: AttentionInputs) -> StepAttention:
        """What the layers of one step call; runs once per forward, without syncing with the host."""

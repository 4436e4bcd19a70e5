"""Paged attention on the GPU: the one entry the model's CUDA attention backend calls.

Every step, decode-only or mixed with prefill chunks, is one launch of ``kernels.attention_unified``:
a sequence with one query is split over its context by a rule on its own length, a sequence with
more queries is walked in query blocks, so a sequence's output never depends on its neighbours.
"""

from __future__ import annotations

import torch

from kernels.attention_unified import AttentionWorkspace, unified_attention


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]; may be a strided view (dense along head_dim)
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] one layer's keys, contiguous
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start: torch.Tensor,  # [num_seqs + 1] int32
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written (may be a view)
    *,
    block_size: int,
    scale: float,
    window: int | None,
    max_query_len: int,
    max_seq_len: int,
    softcap: float | None = None,
    workspace: AttentionWorkspace | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Causal attention of each sequence's new tokens over its paged context, in PyTorch terms::

        for b in range(num_seqs):
            qs, qe, L = query_start[b], query_start[b + 1], seq_lens[b]
            for i, t in enumerate(range(qs, qe)):
                p = L - (qe - qs) + i                                    # the query's position
                js = range(0 if window is None else max(0, p - window + 1), p + 1)
                slots = [block_tables[b, j // block_size] * block_size + j % block_size for j in js]
                for h in range(num_heads):
                    kv = h // (num_heads // num_kv_heads)
                    k, v = k_cache[slots, kv].float(), v_cache[slots, kv].float()   # [len(js), head_dim]
                k, v = k * k_scale, v * v_scale                          # an e4m3 cache (else scales of 1)
                    s = scale * k @ q[t, h].float()
                    if softcap is not None:
                        s = softcap * torch.tanh(s / softcap)            # Gemma 2's soft-capping
                    w = torch.softmax(s, dim=0)
                    out[t, h] = (w @ v).to(out.dtype)                   # zeros when L == 0

    The new tokens' keys and values are already in the cache. Dots run on tensor cores in the
    input dtype for float16/bfloat16 (the probabilities rounded to it before they weight the
    values), in float32 for float32; softmax and sums in float32, the output rounded once. Only
    the cache slots of attended positions are read (the rest may hold anything, NaN included);
    rows of ``q`` and ``out`` past ``query_start[num_seqs]`` are neither read nor written. An FP8 cache
    (float8_e4m3fn) is read as ``e4m3 · scale`` in float32, rounded to q's dtype for the dots.

    ``max_query_len`` and ``max_seq_len`` are host ints at least every sequence's query count
    and length (a CUDA graph passes the largest it allows); a step with ``max_query_len == 1``
    launches no prefill programs, and the grid is otherwise sized by the number of tokens and
    sequences only. ``workspace`` holds the decode splits' partials (``AttentionWorkspace``; one per
    step serves every layer); it is allocated when not given. Nothing depends on the tensors' values
    on the host and nothing waits on the device, so the call can be captured in a CUDA graph. A
    sequence's output does not depend on the other sequences of the step, nor on ``max_query_len``
    and ``max_seq_len``, bit for bit.
    """
    unified_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, out, block_size=block_size,
                      scale=scale, window=window, max_query_len=max_query_len, max_seq_len=max_seq_len,
                      softcap=softcap, workspace=workspace, k_scale=k_scale, v_scale=v_scale)  # fmt: skip

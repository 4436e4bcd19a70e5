"""Triton paged attention for sequences with several queries (prefill, chunked prefill, mixed steps).

Each sequence's queries attend to its cached context plus the causal part of its new tokens, which
is what chunked prefill and prefix caching need. Program ``(p, kv_head)`` takes the ``p``-th block
of a sequence's queries (walked over ``query_start`` as in ``kernels.segments``, so the grid depends
only on the number of tokens and sequences) for all query heads that share ``kv_head``: its rows are
``BLOCK_Q`` tokens x ``GROUP`` heads, so every key and value tile is read once for the group. It
walks the key tiles from the first one inside the window of its first query (tiles wholly before
the window are skipped) to its last query's position, with an online softmax in float32.

Sequences with exactly one query are left to ``kernels.attention_decode``: a decode token then
gets the same result whether its step is all decodes or mixed with prefill chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import attention_launch, segments
from kernels.attention_launch import PrefillTiles, scaled_scores
from kernels.segments import segment_walk


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM], strides (stride_qt, stride_qh, 1)
    k_ptr,  # [num_slots, NUM_KV_HEADS, HEAD_DIM] contiguous
    v_ptr,  # [num_slots, NUM_KV_HEADS, HEAD_DIM] contiguous
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM], strides (stride_ot, stride_oh, 1)
    block_tables_ptr,  # [num_seqs, max_blocks] int32, rows stride_bt apart
    seq_lens_ptr,  # [num_seqs] int32
    query_start_ptr,  # [num_seqs + 1] int32
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    qk_scale,  # scale * log2(e), or scale / cap when soft-capping (attention_launch.score_scales)
    cap,  # softcap * log2(e) when soft-capping
    window,
    num_seqs,
    SEQ_BLOCK: tl.constexpr,  # a power of two >= num_seqs
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (Phi-3's 96 -> 128); pad columns read as 0
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (any positive int)
    BLOCK_M: tl.constexpr,  # rows: BLOCK_Q tokens x GROUP heads, padded to a power of two
    BLOCK_Q: tl.constexpr,  # tokens per program
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,  # dots in float32 (the interpreter misreads fp16/bf16 operands)
):
    kv_head = tl.program_id(1)
    seq, first, end = segment_walk(query_start_ptr, num_seqs, tl.program_id(0), SEQ_BLOCK, BLOCK_Q)
    if seq < 0:
        return
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_len == 1:
        return  # a decode sequence: the decode kernel's
    seq_len = tl.load(seq_lens_ptr + seq)
    pos0 = seq_len - q_len - q_start  # position of query token t is pos0 + t

    rows = tl.arange(0, BLOCK_M)
    tokens = first + rows // GROUP  # [BLOCK_M]
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    m_mask = (rows < BLOCK_Q * GROUP) & (tokens < end)
    q_pos = pos0 + tokens  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d[None, :] < HEAD_DIM  # [1, HEAD_PAD]
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + tokens.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=m_mask[:, None] & d_mask, other=0.0)  # [BLOCK_M, HEAD_PAD]
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Keys [lo, hi): from the first key in the window of the block's first query to its last query.
    hi = pos0 + end
    lo = 0
    if WINDOWED:
        lo = tl.maximum(pos0 + first - window + 1, 0)
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: exp2(m_i - m_new) never sees -inf - -inf
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_PAD), dtype=tl.float32)
    # Tiles start at multiples of BLOCK_N: a query's tiles depend on its own sequence only.
    for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N] key positions
        # Only keys some query of the block attends are loaded: the cache past the length or
        # before the window (freed blocks, poison) is never read.
        n_mask = (pos >= lo) & (pos < hi)
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0)
        slots = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [BLOCK_N]
        kv_rows = (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_d[None, :]  # [BLOCK_N, HEAD_PAD]
        k = tl.load(k_ptr + kv_rows, mask=n_mask[:, None] & d_mask, other=0.0)
        v = tl.load(v_ptr + kv_rows, mask=n_mask[:, None] & d_mask, other=0.0)
        if UPCAST or k_ptr.dtype.element_ty == tl.float32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # tensor cores in the input dtype, float32 accumulator
        attend = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N] causal
        if WINDOWED:
            attend &= pos[None, :] > q_pos[:, None] - window
        s = tl.where(attend, scaled_scores(s, qk_scale, cap, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if v_ptr.dtype.element_ty == tl.float32:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        elif UPCAST:
            # The probabilities rounded to the cache's dtype, as on the GPU.
            acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    # A row with no key (a sequence of length 0: padding of a CUDA-graph batch) is written as zeros.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_rows = out_ptr + tokens.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(out_rows + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask)


def default_tiles(head_dim: int, dtype: torch.dtype) -> PrefillTiles:
    """Tiles for an H100-class GPU, chosen by reasoning, not yet tuned on hardware. Prefill is
    bound by the two dots: 128 rows x 64 keys keep the tensor cores busy while the float32
    accumulator (128 x head_dim) and scores (128 x 64) stay in registers, with 8 warps from
    head_dim 64 (at 4 warps, head_dim 64 needs all 255 registers on sm_80) and three stages of
    K and V in shared memory (96 KiB at head_dim 128 on sm_90). Head_dim 256 takes half the rows
    and keys. float32 has no tensor cores: both operands of each dot sit in registers, so it takes
    32 rows, 32 keys (16 at head_dim 256) and 8 warps, which compile without spills for sm_80 and
    sm_90 with and without a window (64 rows, or 4 warps, spill on sm_90 at some head_dims). A head_dim
    that is not a power of two (Phi-3's 96) runs in tiles of the next one with its columns masked, which
    costs registers: 128 rows spilled on sm_80 at head_dim 96, so it takes 64."""
    padded = head_dim != triton.next_power_of_2(head_dim)
    head_dim = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        return PrefillTiles(block_m=32, block_n=32 if head_dim <= 128 else 16, num_warps=8, num_stages=2)
    if head_dim > 128:
        return PrefillTiles(block_m=64, block_n=32, num_warps=8, num_stages=2)
    return PrefillTiles(block_m=64 if padded else 128, block_n=64, num_warps=8 if head_dim >= 64 else 4, num_stages=3)


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start: torch.Tensor,  # [num_seqs + 1] int32
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written
    *,
    block_size: int,
    scale: float,
    window: int | None,
    max_query_len: int,
    max_seq_len: int,
    softcap: float | None = None,
    tiles: PrefillTiles | None = None,
) -> None:
    """``kernels.paged_attention.paged_attention`` for the sequences with more than one query; the
    rows of sequences with one query are neither read nor written. Allocates nothing; the grid
    depends only on shapes, so the call can be captured in a CUDA graph. ``tiles`` overrides
    ``default_tiles`` (its ``block_m`` is rounded down to whole tokens of the query-head group,
    and up to hold one token's group)."""
    # Check.
    shape = attention_launch.check_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, query_start, out, block_size=block_size, window=window,
        max_query_len=max_query_len, max_seq_len=max_seq_len, softcap=softcap,
    )  # fmt: skip
    tiles = tiles or default_tiles(shape.head_dim, q.dtype)
    if shape.num_tokens == 0 or shape.num_seqs == 0 or max_query_len < 2:
        return

    # Grid: (query block of some sequence, kv head). Blocks vary fastest so that the programs of
    # one sequence, which read the same keys and values, run side by side and share them in L2.
    block_m = max(tiles.block_m, triton.next_power_of_2(shape.group))
    block_q = block_m // shape.group
    grid = (segments.segment_block_count(shape.num_tokens, shape.num_seqs, block_q), shape.num_kv_heads)

    # Launch. The interpreter's tl.dot misreads fp16/bf16, so off-GPU every dot runs in float32.
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *attention_launch.score_scales(scale, softcap), window or 0, shape.num_seqs,
        SEQ_BLOCK=triton.next_power_of_2(shape.num_seqs), NUM_KV_HEADS=shape.num_kv_heads, GROUP=shape.group,
        HEAD_DIM=shape.head_dim, HEAD_PAD=shape.head_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=tiles.block_n,
        WINDOWED=window is not None, SOFTCAP=softcap is not None, UPCAST=not q.is_cuda,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip

"""Triton paged attention for a whole step in one launch: decodes and prefill chunks side by side.

The grid is ``(work item, kv_head)`` and its size depends only on the number of tokens and sequences
(the shapes of a CUDA graph's buffers) and on whether any sequence may have more than one query; every
bound a program needs (query_start, seq_lens, block tables) is read on the device. Work items come in
two ranges:

- ``seq * max_splits + split`` for ``seq < num_seqs``: flash-decoding. A sequence with exactly one
  query has its attended keys cut into splits by ``decode_splits`` (a rule on its own context
  length, never on the batch); the program of split ``s`` takes the query for all query heads that
  share ``kv_head`` (padded to 16 rows for tl.dot, so the kv head's keys and values are read once for
  the group) and walks the split tile by tile with an online softmax. A sequence of one split writes
  its output at once; otherwise each split stores its running max, sum and unnormalised output, and
  the last split to arrive (an atomic counter per sequence and kv head) merges them in split order.
- then the blocks of ``BLOCK_Q`` queries of each sequence with more than one query (walked over
  ``query_start`` as in ``kernels.segments``): BLOCK_Q tokens x the GROUP heads of ``kv_head``,
  walking the keys from the first one inside the window of the block's first query to its last
  query's position, causally masked.

A program whose item has no work (a split past its sequence's count, a sequence of the other kind,
a block past the last) exits at once. A sequence's result depends on its own queries, length and
cache only: which program merges its splits varies from launch to launch, the order it merges them
in does not (batch invariance, bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import attention_launch, segments
from kernels.attention_launch import AttentionTiles, scaled_scores
from kernels.segments import segment_walk


@triton.jit
def _attend(q, m_i, l_i, acc, k_ptr, v_ptr, table, kv_head, pos, n_mask, attend, qk_scale, cap, k_scale, v_scale,
            NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr):  # fmt: skip
    """One key tile of the online softmax: ``pos`` [BLOCK_N] key positions, of which only ``n_mask``
    are loaded (the cache elsewhere, freed blocks or poison, is never read); ``attend`` [rows, BLOCK_N]
    says which scores count. Returns the updated (m_i, l_i, acc) of the rows of ``q``. An e4m3 cache's
    tile (``KV_FP8``) is dequantized first, ``e4m3 · k_scale`` and ``e4m3 · v_scale`` in float32 rounded to
    q's dtype (exact for the power-of-two scales a pod calibrates), then runs as a cache of q's dtype."""
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d[None, :] < HEAD_DIM  # [1, HEAD_PAD]
    block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0)
    slots = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [BLOCK_N]
    kv_rows = (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_d[None, :]  # [BLOCK_N, HEAD_PAD]
    k = tl.load(k_ptr + kv_rows, mask=n_mask[:, None] & d_mask, other=0.0)
    v = tl.load(v_ptr + kv_rows, mask=n_mask[:, None] & d_mask, other=0.0)
    if KV_FP8:
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    if UPCAST or k.dtype == tl.float32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # tensor cores in the input dtype, float32 accumulator
    s = tl.where(attend, scaled_scores(s, qk_scale, cap, SOFTCAP), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if v.dtype == tl.float32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    elif UPCAST:
        # The probabilities rounded to the cache's dtype, as on the GPU.
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def split_rule(span, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """(split size, split count) of a decode row whose attended keys span ``span`` positions from a
    multiple of BLOCK_N: ``attention_launch.decode_splits`` on the device."""
    count = tl.minimum(tl.maximum((span + MIN_SPLIT - 1) // MIN_SPLIT, 1), MAX_SPLITS)
    size = ((span + count - 1) // count + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    size = tl.maximum(size, BLOCK_N)
    return size, tl.maximum((span + size - 1) // size, 1)


@triton.jit
def _decode_item(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, part_max_ptr,
                 part_sum_ptr, part_acc_ptr, counters_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                 qk_scale, cap, k_scale, v_scale, window, seq, split, kv_head,
                 NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
                 MAX_SPLITS: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
                 UPCAST: tl.constexpr, KV_FP8: tl.constexpr):  # fmt: skip
    token = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - token
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0  # first key position the query attends
    if WINDOWED:
        lo = tl.maximum(seq_len - window, 0)
    first = lo // BLOCK_N * BLOCK_N  # tiles start at multiples of BLOCK_N: they depend on the row only
    split_size, num_splits = split_rule(seq_len - first, BLOCK_N, MIN_SPLIT, MAX_SPLITS)
    # A row of length 0 (padding of a CUDA-graph batch) has one empty split: it writes zeros.
    if (q_len == 1) & (split < num_splits):
        offs_g = tl.arange(0, GROUP_ROWS)
        heads = kv_head * GROUP + offs_g  # [GROUP_ROWS]
        g_mask = offs_g < GROUP
        offs_d = tl.arange(0, HEAD_PAD)
        d_mask = offs_d[None, :] < HEAD_DIM  # [1, HEAD_PAD]
        q_rows = q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
        q = tl.load(q_rows + offs_d[None, :], mask=g_mask[:, None] & d_mask, other=0.0)  # [GROUP_ROWS, HEAD_PAD]
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        split_lo = first + split * split_size
        split_hi = tl.minimum(split_lo + split_size, seq_len)

        m_i = tl.full((GROUP_ROWS,), -1.0e30, dtype=tl.float32)  # finite: exp2(m_i - m_new) never sees -inf - -inf
        l_i = tl.zeros((GROUP_ROWS,), dtype=tl.float32)
        acc = tl.zeros((GROUP_ROWS, HEAD_PAD), dtype=tl.float32)
        for n0 in range(split_lo, split_hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
            n_mask = (pos >= lo) & (pos < split_hi)
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, k_ptr, v_ptr, table, kv_head, pos, n_mask, n_mask[None, :],
                                    qk_scale, cap, k_scale, v_scale, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD, BLOCK_SIZE,
                                    SOFTCAP, UPCAST, KV_FP8)

        out_rows = out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        if num_splits == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask)
        else:
            parts = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * MAX_SPLITS  # [GROUP_ROWS]
            tl.store(part_max_ptr + parts + split, m_i, mask=g_mask)
            tl.store(part_sum_ptr + parts + split, l_i, mask=g_mask)
            acc_rows = part_acc_ptr + parts[:, None] * HEAD_DIM + offs_d[None, :]  # [GROUP_ROWS, HEAD_PAD] at split 0
            tl.store(acc_rows + split * HEAD_DIM, acc, mask=g_mask[:, None] & d_mask)
            tl.debug_barrier()  # every thread's store before the release below
            counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
                # The last split to arrive merges all of them, in split order, from L2 (past a stale L1).
                m_all = tl.full((GROUP_ROWS,), float("-inf"), dtype=tl.float32)
                for s in range(0, num_splits):
                    m_all = tl.maximum(m_all, tl.load(part_max_ptr + parts + s, mask=g_mask, other=0.0,
                                                      cache_modifier=".cg"))
                total = tl.zeros((GROUP_ROWS,), dtype=tl.float32)
                acc = tl.zeros((GROUP_ROWS, HEAD_PAD), dtype=tl.float32)
                for s in range(0, num_splits):
                    w = tl.exp2(tl.load(part_max_ptr + parts + s, mask=g_mask, other=0.0, cache_modifier=".cg")
                                - m_all)
                    total += w * tl.load(part_sum_ptr + parts + s, mask=g_mask, other=0.0, cache_modifier=".cg")
                    a = tl.load(acc_rows + s * HEAD_DIM, mask=g_mask[:, None] & d_mask, other=0.0,
                                cache_modifier=".cg")
                    acc += w[:, None] * a
                o = acc / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask)
                tl.atomic_xchg(counter, 0)  # zero for the next launch (the next layer, a graph's replay)


@triton.jit
def _prefill_item(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, stride_qt,
                  stride_qh, stride_ot, stride_oh, stride_bt, qk_scale, cap, k_scale, v_scale, window, num_seqs, item,
                  kv_head,
                  SEQ_BLOCK: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
                  UPCAST: tl.constexpr, KV_FP8: tl.constexpr):  # fmt: skip
    seq, first, end = segment_walk(query_start_ptr, num_seqs, item, SEQ_BLOCK, BLOCK_Q)
    q_start = tl.load(query_start_ptr + tl.maximum(seq, 0))
    q_len = tl.load(query_start_ptr + tl.maximum(seq, 0) + 1) - q_start
    if (seq >= 0) & (q_len > 1):  # one-query sequences are the decode items'
        seq_len = tl.load(seq_lens_ptr + seq)
        pos0 = seq_len - q_len - q_start  # position of query token t is pos0 + t
        rows = tl.arange(0, BLOCK_M)
        tokens = first + rows // GROUP  # [BLOCK_M]
        heads = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
        m_mask = (rows < BLOCK_Q * GROUP) & (tokens < end)
        q_pos = pos0 + tokens  # [BLOCK_M]
        offs_d = tl.arange(0, HEAD_PAD)
        d_mask = offs_d[None, :] < HEAD_DIM  # [1, HEAD_PAD]
        q_rows = q_ptr + tokens.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
        q = tl.load(q_rows + offs_d[None, :], mask=m_mask[:, None] & d_mask, other=0.0)  # [BLOCK_M, HEAD_PAD]
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt

        # Keys [lo, hi): from the first key in the window of the block's first query to its last query.
        hi = pos0 + end
        lo = 0
        if WINDOWED:
            lo = tl.maximum(pos0 + first - window + 1, 0)
        m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_PAD), dtype=tl.float32)
        # Tiles start at multiples of BLOCK_N: a query's tiles depend on its own sequence only.
        for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
            n_mask = (pos >= lo) & (pos < hi)
            attend = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N] causal
            if WINDOWED:
                attend &= pos[None, :] > q_pos[:, None] - window
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, k_ptr, v_ptr, table, kv_head, pos, n_mask, attend, qk_scale,
                                    cap, k_scale, v_scale, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, SOFTCAP,
                                    UPCAST, KV_FP8)

        # A row with no key (a sequence of length 0: padding of a CUDA-graph batch) is written as zeros.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_rows = out_ptr + tokens.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
        tl.store(out_rows + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask)


@triton.jit
def _unified_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM], strides (stride_qt, stride_qh, 1)
    k_ptr,  # [num_slots, NUM_KV_HEADS, HEAD_DIM] contiguous
    v_ptr,  # [num_slots, NUM_KV_HEADS, HEAD_DIM] contiguous
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM], strides (stride_ot, stride_oh, 1)
    block_tables_ptr,  # [num_seqs, max_blocks] int32, rows stride_bt apart
    seq_lens_ptr,  # [num_seqs] int32
    query_start_ptr,  # [num_seqs + 1] int32
    part_max_ptr,  # [num_seqs, num_heads, MAX_SPLITS] float32 (log2 domain)
    part_sum_ptr,  # [num_seqs, num_heads, MAX_SPLITS] float32
    part_acc_ptr,  # [num_seqs, num_heads, MAX_SPLITS, HEAD_DIM] float32
    counters_ptr,  # [num_seqs, NUM_KV_HEADS] int32, zero between launches
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    qk_scale,  # scale * log2(e), or scale / cap when soft-capping (attention_launch.score_scales)
    cap,  # softcap * log2(e) when soft-capping
    k_scale,  # an e4m3 cache's scales (KV_FP8): a key is e4m3 * k_scale, a value e4m3 * v_scale
    v_scale,
    window,
    num_seqs,
    SEQ_BLOCK: tl.constexpr,  # a power of two >= num_seqs
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_ROWS: tl.constexpr,  # a decode item's rows: a power of two >= max(GROUP, 16)
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (Phi-3's 96 -> 128); pad columns read as 0
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (any positive int)
    BLOCK_M: tl.constexpr,  # a prefill item's rows: BLOCK_Q tokens x GROUP heads, padded to a power of two
    BLOCK_Q: tl.constexpr,  # tokens per prefill item
    BLOCK_N: tl.constexpr,  # keys per tile of a prefill item
    DECODE_BLOCK_N: tl.constexpr,  # keys per tile of a decode item
    MIN_SPLIT: tl.constexpr,  # the split rule (attention_launch.decode_splits)
    MAX_SPLITS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,  # dots in float32 (the interpreter misreads fp16/bf16 operands)
    KV_FP8: tl.constexpr,  # the cache holds float8_e4m3fn
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    if item < num_seqs * MAX_SPLITS:
        _decode_item(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, part_max_ptr,
                     part_sum_ptr, part_acc_ptr, counters_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                     qk_scale, cap, k_scale, v_scale, window, item // MAX_SPLITS, item % MAX_SPLITS, kv_head,
                     NUM_KV_HEADS, GROUP, GROUP_ROWS, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, DECODE_BLOCK_N, MIN_SPLIT,
                     MAX_SPLITS, WINDOWED, SOFTCAP, UPCAST, KV_FP8)  # fmt: skip
    else:
        _prefill_item(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, stride_qt,
                      stride_qh, stride_ot, stride_oh, stride_bt, qk_scale, cap, k_scale, v_scale, window, num_seqs,
                      item - num_seqs * MAX_SPLITS, kv_head,
                      SEQ_BLOCK, NUM_KV_HEADS, GROUP, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_Q, BLOCK_N,
                      WINDOWED, SOFTCAP, UPCAST, KV_FP8)  # fmt: skip


def default_tiles(head_dim: int, dtype: torch.dtype) -> AttentionTiles:
    """Tiles for an H100-class GPU, chosen by reasoning, not yet tuned on hardware.

    Prefill items are bound by the two dots: 128 rows x 64 keys keep the tensor cores busy while the
    float32 accumulator (128 x head_dim) and scores (128 x 64) stay in registers, with 8 warps from
    head_dim 64 and three stages of K and V in shared memory. Head_dim 256 takes half the rows and
    keys; a head_dim that is not a power of two (Phi-3's 96) runs in tiles of the next one with its
    columns masked, which costs registers: 64 rows. Decode items read keys and values once, so their
    tile is sized for bytes in flight: 64 keys x head_dim 128 in 16 bits are 16 KiB each of K and V
    (32 keys at head_dim 256). float32 has no tensor cores (both operands of a dot sit in registers):
    prefill items of 32 rows x 16 keys and decode tiles of 32 keys, 8 warps, one stage (32-key prefill
    tiles beside the decode items spill on sm_90 at head_dim 128, two stages on sm_80 with a window).
    One launch has one warp count, so decode items run with the prefill items' warps.

    Splits: at least 128 keys each (with 4 query heads a kv head a split's partials are 2 KiB, written
    then read once, against 64 KiB of keys and values at head_dim 128 in 16 bits) and at most 16 a
    row, so a 2048-token context at batch 1 gives 16 programs per kv head (128 on Llama-3-8B) where
    512-key splits gave 4."""
    padded = head_dim != triton.next_power_of_2(head_dim)
    head_dim = triton.next_power_of_2(head_dim)
    split = dict(min_split=128, max_splits=16)
    if dtype == torch.float32:
        return AttentionTiles(block_m=32, block_n=16, decode_block_n=32, num_warps=8, num_stages=1, **split)
    if head_dim > 128:
        return AttentionTiles(block_m=64, block_n=32, decode_block_n=32, num_warps=8, num_stages=2, **split)
    return AttentionTiles(block_m=64 if padded else 128, block_n=64, decode_block_n=64,
                          num_warps=8 if head_dim >= 64 else 4, num_stages=3, **split)  # fmt: skip


@dataclass(frozen=True)
class AttentionWorkspace:
    """The decode splits' partials and arrival counters: one per step is enough, every layer reuses it
    (each launch leaves the counters at zero)."""

    part_max: torch.Tensor  # [num_seqs, num_heads, max_splits] float32
    part_sum: torch.Tensor  # [num_seqs, num_heads, max_splits] float32
    part_acc: torch.Tensor  # [num_seqs, num_heads, max_splits, head_dim] float32
    counters: torch.Tensor  # [num_seqs, num_kv_heads] int32

    @staticmethod
    def allocate(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_splits: int,
                 device: torch.device) -> AttentionWorkspace:  # fmt: skip
        part = (num_seqs, num_heads, max_splits)
        return AttentionWorkspace(
            part_max=torch.empty(part, dtype=torch.float32, device=device),
            part_sum=torch.empty(part, dtype=torch.float32, device=device),
            part_acc=torch.empty((*part, head_dim), dtype=torch.float32, device=device),
            counters=torch.zeros((num_seqs, num_kv_heads), dtype=torch.int32, device=device),
        )

    def fits(self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_splits: int) -> bool:
        return (self.part_acc.shape == (num_seqs, num_heads, max_splits, head_dim)
                and self.counters.shape == (num_seqs, num_kv_heads))  # fmt: skip


def unified_attention(
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
    tiles: AttentionTiles | None = None,
    workspace: AttentionWorkspace | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``kernels.paged_attention.paged_attention`` in one launch. ``workspace`` (from
    ``AttentionWorkspace.allocate`` for these shapes and the tiles' ``max_splits``; its counters zero)
    is allocated when not given. The grid depends on ``num_tokens``, ``num_seqs`` and whether
    ``max_query_len > 1``, never on ``max_seq_len`` or the tensors' values. ``tiles`` overrides
    ``default_tiles`` (its ``block_m`` is rounded down to whole tokens of the query-head group, and up
    to hold one token's group)."""
    # Check.
    shape = attention_launch.check_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, query_start, out, block_size=block_size, window=window,
        max_query_len=max_query_len, max_seq_len=max_seq_len, softcap=softcap,
    )  # fmt: skip
    tiles = tiles or default_tiles(shape.head_dim, q.dtype)
    sizes = (shape.num_seqs, shape.num_heads, shape.num_kv_heads, shape.head_dim, tiles.max_splits)
    if workspace is not None and not workspace.fits(*sizes):
        raise ValueError(f"workspace does not fit (num_seqs, num_heads, num_kv_heads, head_dim, max_splits) = {sizes}")
    if shape.num_tokens == 0 or shape.num_seqs == 0 or max_query_len == 0:
        return

    # Allocate.
    workspace = workspace or AttentionWorkspace.allocate(*sizes, q.device)

    # Grid: (work item, kv head); decode items first, then prefill blocks when any sequence may have
    # more than one query. Items vary fastest so that the programs of one sequence run side by side.
    block_m = max(tiles.block_m, triton.next_power_of_2(shape.group))
    block_q = block_m // shape.group
    items = shape.num_seqs * tiles.max_splits
    if max_query_len > 1:
        items += segments.segment_block_count(shape.num_tokens, shape.num_seqs, block_q)
    grid = (items, shape.num_kv_heads)

    # Launch. The interpreter's tl.dot misreads fp16/bf16, so off-GPU every dot runs in float32.
    _unified_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start,
        workspace.part_max, workspace.part_sum, workspace.part_acc, workspace.counters,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *attention_launch.score_scales(scale, softcap), float(k_scale), float(v_scale), window or 0, shape.num_seqs,
        SEQ_BLOCK=triton.next_power_of_2(shape.num_seqs), NUM_KV_HEADS=shape.num_kv_heads, GROUP=shape.group,
        GROUP_ROWS=attention_launch.group_rows(shape.group), HEAD_DIM=shape.head_dim, HEAD_PAD=shape.head_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=tiles.block_n,
        DECODE_BLOCK_N=tiles.decode_block_n, MIN_SPLIT=tiles.min_split, MAX_SPLITS=tiles.max_splits,
        WINDOWED=window is not None, SOFTCAP=softcap is not None, UPCAST=not q.is_cuda,
        KV_FP8=k_cache.dtype == attention_launch.KV_FP8,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip

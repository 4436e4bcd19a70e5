"""Triton paged attention for sequences with one query (decode), split over the context.

Flash-decoding: program ``(kv_head, seq, split)`` takes the one query of ``seq`` for all query
heads that share ``kv_head`` (padded to 16 rows for tl.dot, so the kv head's keys and values are
read once for the whole group), and attends over key positions ``split * SPLIT`` to
``(split + 1) * SPLIT`` read through the block table, tile by tile with an online softmax. It
writes that split's running max, sum and unnormalised output to a float32 workspace; a second
kernel, program ``(head, seq)``, merges the splits in order and writes the output row. Programs
whose split holds no key of their sequence (past its length, or wholly before its window) exit
at once, so the grid can be sized by the largest length a CUDA graph allows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import attention_launch
from kernels.attention_launch import DecodeTiles, scaled_scores

# Key positions per split. A constant, never derived from the batch (as flash-decoding heuristics
# that fill the GPU do): the splits a sequence's context is cut into, and so the order its sums
# are taken in, then depend only on its own length, and its output is bit-identical whatever else
# is in the batch (batch invariance). 512 keeps the partials' traffic (written and read once) under
# 2% of the keys' and values' at head_dim 128 with 4 query heads a kv head, and still gives
# 8k-token contexts 16 programs per kv head at batch 1.
SPLIT = 512
# Splits the merge kernel reads at a time.
MERGE_CHUNK = 16


# num_splits follows max_seq_len: not specialised (e.g. on == 1), so that every length compiles
# to one kernel and a sequence's result cannot change with the limit a step passes.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM], strides (stride_qt, stride_qh, 1)
    k_ptr,  # [num_slots, NUM_KV_HEADS, HEAD_DIM] contiguous
    v_ptr,  # [num_slots, NUM_KV_HEADS, HEAD_DIM] contiguous
    block_tables_ptr,  # [num_seqs, max_blocks] int32, rows stride_bt apart
    seq_lens_ptr,  # [num_seqs] int32
    query_start_ptr,  # [num_seqs + 1] int32
    part_max_ptr,  # [num_seqs, num_heads, num_splits] float32 (log2 domain)
    part_sum_ptr,  # [num_seqs, num_heads, num_splits] float32
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM] float32
    stride_qt,
    stride_qh,
    stride_bt,
    qk_scale,  # scale * log2(e), or scale / cap when soft-capping (attention_launch.score_scales)
    cap,  # softcap * log2(e) when soft-capping
    window,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_ROWS: tl.constexpr,  # a power of two >= max(GROUP, 16)
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (Phi-3's 96 -> 128); pad columns read as 0
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (any positive int)
    BLOCK_N: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,  # a multiple of BLOCK_N
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,  # dots in float32 (the interpreter misreads fp16/bf16 operands)
):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) - token != 1:
        return  # not a decode sequence: the prefill kernel's
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0  # first key position the query attends
    if WINDOWED:
        lo = tl.maximum(seq_len - window, 0)
    split_lo = split * SPLIT_SIZE
    split_hi = tl.minimum(split_lo + SPLIT_SIZE, seq_len)
    if (split_lo >= seq_len) | (split_lo + SPLIT_SIZE <= lo):
        return

    offs_g = tl.arange(0, GROUP_ROWS)
    heads = kv_head * GROUP + offs_g  # [GROUP_ROWS]
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d[None, :] < HEAD_DIM  # [1, HEAD_PAD]
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=g_mask[:, None] & d_mask, other=0.0)  # [GROUP_ROWS, HEAD_PAD]
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full((GROUP_ROWS,), -1.0e30, dtype=tl.float32)  # finite: exp2(m_i - m_new) never sees -inf - -inf
    l_i = tl.zeros((GROUP_ROWS,), dtype=tl.float32)
    acc = tl.zeros((GROUP_ROWS, HEAD_PAD), dtype=tl.float32)
    # Tiles start at multiples of BLOCK_N: a sequence's tiles depend on its own length only.
    for n0 in range(tl.maximum(split_lo, lo // BLOCK_N * BLOCK_N), split_hi, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N] key positions
        # Only keys the query attends are loaded: the cache past the length or before the window
        # (freed blocks, poison) is never read.
        n_mask = (pos >= lo) & (pos < split_hi)
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0)
        slots = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [BLOCK_N]
        kv_rows = (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_d[None, :]  # [BLOCK_N, HEAD_PAD]
        k = tl.load(k_ptr + kv_rows, mask=n_mask[:, None] & d_mask, other=0.0)
        v = tl.load(v_ptr + kv_rows, mask=n_mask[:, None] & d_mask, other=0.0)
        if UPCAST or k_ptr.dtype.element_ty == tl.float32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # tensor cores in the input dtype, float32 accumulator
        s = tl.where(n_mask[None, :], scaled_scores(s, qk_scale, cap, SOFTCAP), float("-inf"))
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

    part = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split  # [GROUP_ROWS]
    tl.store(part_max_ptr + part, m_i, mask=g_mask)
    tl.store(part_sum_ptr + part, l_i, mask=g_mask)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM], strides (stride_ot, stride_oh, 1)
    seq_lens_ptr,  # [num_seqs] int32
    query_start_ptr,  # [num_seqs + 1] int32
    part_max_ptr,  # [num_seqs, num_heads, num_splits] float32
    part_sum_ptr,  # [num_seqs, num_heads, num_splits] float32
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM] float32
    stride_ot,
    stride_oh,
    window,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,  # splits read at a time
    WINDOWED: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    token = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) - token != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0) // SPLIT_SIZE
    # Clamped so that a length past max_seq_len (a caller bug) cannot read past the workspace.
    last = tl.minimum((seq_len + SPLIT_SIZE - 1) // SPLIT_SIZE, num_splits)  # one past the last split
    base = (seq.to(tl.int64) * num_heads + head) * num_splits
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM  # [HEAD_PAD]

    m = tl.full((CHUNK,), float("-inf"), dtype=tl.float32)
    for c0 in range(first, last, CHUNK):
        c = c0 + offs_c
        m = tl.maximum(m, tl.load(part_max_ptr + base + c, mask=c < last, other=float("-inf")))
    m_all = tl.max(m, axis=0)
    total = tl.zeros((CHUNK,), dtype=tl.float32)
    acc = tl.zeros((HEAD_PAD,), dtype=tl.float32)
    for c0 in range(first, last, CHUNK):
        c = c0 + offs_c
        c_mask = c < last
        w = tl.where(c_mask, tl.exp2(tl.load(part_max_ptr + base + c, mask=c_mask, other=0.0) - m_all), 0.0)
        total += w * tl.load(part_sum_ptr + base + c, mask=c_mask, other=0.0)
        a = tl.load(part_acc_ptr + (base + c[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=c_mask[:, None] & d_mask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * a, axis=0)
    denom = tl.sum(total, axis=0)
    # A sequence of length 0 (a padding row of a CUDA-graph batch) has no split: zeros.
    o = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def default_tiles(head_dim: int, dtype: torch.dtype) -> DecodeTiles:
    """Tiles for an H100-class GPU, chosen by reasoning, not yet tuned on hardware: decode reads
    keys and values once, so a tile is sized for bytes in flight. 64 keys x head_dim 128 in 16 bits
    are 16 KiB each of K and V; the pipeline loads the next tile while one is in use (the block
    table read first makes the loads indirect), 38 KiB of shared memory in all, so several programs
    share an SM and keep its loads in flight. Head_dim 256 takes 32 keys. float32 (no tensor cores:
    the dots' operands sit in registers) takes 32 keys, with 8 warps above head_dim 64: the
    tiles that compile without spills for sm_80 and sm_90 at every head_dim, with and without a
    window (64 keys, or 4 warps at head_dim 128, spill at some). A head_dim that is not a power of two
    takes the next one's tiles."""
    head_dim = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        return DecodeTiles(split=SPLIT, block_n=32, num_warps=8 if head_dim > 64 else 4)
    return DecodeTiles(split=SPLIT, block_n=64 if head_dim <= 128 else 32)


def decode_attention(
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
    tiles: DecodeTiles | None = None,
) -> None:
    """``kernels.paged_attention.paged_attention`` for the sequences with exactly one query; the
    rows of every other sequence are neither read nor written. Allocates a float32 workspace of
    ``num_seqs x num_heads x cdiv(max_seq_len, split) x (head_dim + 2)`` (shapes and host ints
    only, so the call can be captured in a CUDA graph). ``tiles`` overrides ``default_tiles``; its
    ``split`` sets how a context is cut, and so the rounding of every result (keep it fixed)."""
    # Check.
    shape = attention_launch.check_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, query_start, out, block_size=block_size, window=window,
        max_query_len=max_query_len, max_seq_len=max_seq_len, softcap=softcap,
    )  # fmt: skip
    tiles = tiles or default_tiles(shape.head_dim, q.dtype)
    if shape.num_tokens == 0 or shape.num_seqs == 0 or max_query_len == 0:
        return

    # Allocate.
    num_splits = triton.cdiv(max(max_seq_len, 1), tiles.split)
    part_shape = (shape.num_seqs, shape.num_heads, num_splits)
    part_max = torch.empty(part_shape, dtype=torch.float32, device=q.device)  # [num_seqs, num_heads, num_splits]
    part_sum = torch.empty(part_shape, dtype=torch.float32, device=q.device)  # [num_seqs, num_heads, num_splits]
    part_acc = torch.empty((*part_shape, shape.head_dim), dtype=torch.float32, device=q.device)  # [.., head_dim]

    # Grid: (kv head, sequence, split) and (head, sequence); kv heads vary fastest so that the
    # programs of one sequence, which read one block table row, run side by side.
    split_grid = (shape.num_kv_heads, shape.num_seqs, num_splits)
    merge_grid = (shape.num_heads, shape.num_seqs)

    # Launch. The interpreter's tl.dot misreads fp16/bf16, so off-GPU every dot runs in float32.
    _decode_split_kernel[split_grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start, part_max, part_sum, part_acc,
        q.stride(0), q.stride(1), block_tables.stride(0), *attention_launch.score_scales(scale, softcap),
        window or 0, num_splits,
        NUM_KV_HEADS=shape.num_kv_heads, GROUP=shape.group, GROUP_ROWS=attention_launch.group_rows(shape.group),
        HEAD_DIM=shape.head_dim, HEAD_PAD=shape.head_pad, BLOCK_SIZE=block_size, BLOCK_N=tiles.block_n,
        SPLIT_SIZE=tiles.split,
        WINDOWED=window is not None, SOFTCAP=softcap is not None, UPCAST=not q.is_cuda,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    _decode_merge_kernel[merge_grid](
        out, seq_lens, query_start, part_max, part_sum, part_acc,
        out.stride(0), out.stride(1), window or 0, shape.num_heads, num_splits,
        HEAD_DIM=shape.head_dim, HEAD_PAD=shape.head_pad, SPLIT_SIZE=tiles.split, CHUNK=MERGE_CHUNK,
        WINDOWED=window is not None,
        num_warps=4,
    )  # fmt: skip

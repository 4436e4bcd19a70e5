"""Pure torch: multi-adapter LoRA and paged attention, the oracles the Triton kernels and the CPU LoRA path
(``kernels.cpu_lora``) are tested against.

Layouts shared with the kernels (S = packed output slices of the layer, e.g. 3 for qkv):
    lora_a:  [S, max_loras, max_rank, in_features]   A of every slot, per slice
    lora_b:  [max_loras, out_features, max_rank]     B of every slot, slices stacked on rows
    ranks:   [S, max_loras] int32                    real rank of each slot per slice (0 = empty)
    slice_offsets: [S + 1] int32                     slice s owns output rows offsets[s]:offsets[s+1]
    buf:     [S, num_tokens, max_rank] float32       shrink output, expand input

Only the first ``ranks[s, slot]`` rank columns of a slot are read, so padding costs nothing.
Tokens whose slot is -1 are never read or written.

Paged attention reads the layout of ``kernels.attention_launch``. The fused layer ops (``add_rms_norm``,
``rotary``, ``act_mul``) state in float32 what ``kernels.fused_norm``, ``kernels.fused_rotary`` and
``kernels.fused_activation`` compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.lora_meta import LoraMeta


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [S, max_loras, max_rank, in_features]
    ranks: torch.Tensor,  # [S, max_loras] int32
    meta: LoraMeta,
    buf: torch.Tensor,  # [S, num_tokens, max_rank] float32, written
    host_ranks: list[list[int]] | None = None,
) -> None:
    """``buf[s, t, :r] = x[t] @ lora_a[s, slot[t], :r].T`` with ``r = ranks[s, slot[t]]``,
    for every token with ``slot[t] >= 0``, accumulated in float32."""
    host_ranks = host_ranks if host_ranks is not None else ranks.tolist()
    num_slices = lora_a.shape[0]
    for slot, start, end, run in meta.host_segments:
        slot_ranks = [host_ranks[s][slot] for s in range(num_slices)]
        if not any(slot_ranks):
            continue
        rows = meta.segment_rows(start, end, run)
        xs = x[rows].float()  # [n, in]
        if len(set(slot_ranks)) == 1:  # one rank for every slice: all slices in one batched matmul
            r = slot_ranks[0]
            buf[:, rows, :r] = torch.matmul(xs, lora_a[:, slot, :r].float().transpose(1, 2))  # [S, n, r]
            continue
        for s, r in enumerate(slot_ranks):
            if r:
                buf[s, rows, :r] = xs @ lora_a[s, slot, :r].float().T


def lora_expand(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    buf: torch.Tensor,  # [S, num_tokens, max_rank] float32
    lora_b: torch.Tensor,  # [max_loras, out_features, max_rank]
    ranks: torch.Tensor,  # [S, max_loras] int32
    slice_offsets: list[int],  # S + 1 row offsets
    meta: LoraMeta,
    host_ranks: list[list[int]] | None = None,
) -> None:
    """``y[t, off_s:off_s+n_s] += buf[s, t, :r] @ lora_b[slot[t], off_s:off_s+n_s, :r].T``,
    accumulated in float32, added to ``y`` in float32 and rounded once to ``y``'s dtype;
    rows with slot -1 untouched."""
    host_ranks = host_ranks if host_ranks is not None else ranks.tolist()
    for slot, start, end, run in meta.host_segments:
        slot_ranks = [host_ranks[s][slot] for s in range(len(slice_offsets) - 1)]
        if not any(slot_ranks):
            continue
        rows = meta.segment_rows(start, end, run)
        in_place = isinstance(rows, slice) and y.dtype == torch.float32  # y[rows] is then a view of y
        acc = y[rows].float()  # [n, out]
        for s, r in enumerate(slot_ranks):
            if r:
                lo, hi = slice_offsets[s], slice_offsets[s + 1]
                acc[:, lo:hi].addmm_(buf[s, rows, :r], lora_b[slot, lo:hi, :r].float().T)
        if not in_place:
            y[rows] = acc.to(y.dtype)


def paged_attention(
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """For sequence b with ``qlen = query_start[b+1] - query_start[b]`` and ``L = seq_lens[b]``,
    its query i sits at position ``p = L - qlen + i`` and attends the key positions j with
    ``max(0, p - window + 1) <= j <= p`` (no lower bound when window is None), reading key/value j
    at cache slot ``block_tables[b, j // block_size] * block_size + j % block_size`` (the new
    tokens' keys/values are already in the cache). ``out = softmax(s) v`` with ``s = scale * q k^T``,
    soft-capped to ``softcap * tanh(s / softcap)`` when ``softcap`` is set, with
    grouped-query heads (query head h uses kv head ``h // (num_heads // num_kv_heads)``), float32
    math, rounded once to q's dtype. A sequence with L == 0 writes zeros to its query rows; rows
    of q past ``query_start[num_seqs]`` are neither read nor written, and neither are cache slots
    of positions no query attends. ``max_query_len`` and ``max_seq_len`` bound the per-sequence
    values (unused here: the loop reads the lengths). An FP8 cache (float8_e4m3fn, ``--kv-cache-dtype fp8``)
    is dequantized first: keys ``k_cache.float() * k_scale``, values ``v_cache.float() * v_scale`` (each
    rounded once in float32); then the same math.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        qs, qe = starts[b], starts[b + 1]
        if qe == qs:
            continue
        pos = torch.arange(seq_len - (qe - qs), seq_len, device=q.device)  # [qlen] query positions
        # Keys from the first one any query of the sequence attends.
        lo = 0 if window is None else max(0, seq_len - (qe - qs) - window + 1)
        keys = torch.arange(lo, seq_len, device=q.device)  # [n] key positions
        if keys.numel() == 0:
            out[qs:qe] = 0
            continue
        blocks = block_tables[b, keys // block_size].long()
        slots = blocks * block_size + keys % block_size  # [n]
        k = (k_cache[slots].float() * k_scale).repeat_interleave(group, dim=1)  # [n, num_heads, head_dim]
        v = (v_cache[slots].float() * v_scale).repeat_interleave(group, dim=1)  # [n, num_heads, head_dim]
        scores = scale * torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k)  # [num_heads, qlen, n]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        attend = keys[None, :] <= pos[:, None]  # [qlen, n]
        if window is not None:
            attend &= keys[None, :] > pos[:, None] - window
        weights = torch.softmax(scores.masked_fill(~attend, float("-inf")), dim=-1)
        weights = torch.nan_to_num(weights, nan=0.0)  # a query with no key (position < 0): zeros
        out[qs:qe] = torch.einsum("hqk,khd->qhd", weights, v).to(out.dtype)


def add_rms_norm(
    x: torch.Tensor,  # [rows, hidden]
    residual: torch.Tensor | None,  # [rows, hidden], updated in place; None: no residual add
    weight: torch.Tensor,  # [hidden]
    eps: float,
    offset: float = 0.0,
) -> torch.Tensor:  # [rows, hidden] in x's dtype
    """``residual += x`` (rounded to its dtype), then RMSNorm of the sum in float32: scaled by ``offset +
    weight`` in float32 and rounded once where ``offset`` is set (Gemma), else rounded, then scaled by
    ``weight`` and rounded again (Llama)."""
    if residual is not None:
        residual.copy_(residual + x)
        x = residual
    n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (n * (weight.float() + offset)).to(x.dtype)
    return (n.to(x.dtype).float() * weight.float()).to(x.dtype)


def rotary(
    qk: torch.Tensor,  # [tokens, heads, head_dim], rotated in place
    cos: torch.Tensor,  # [tokens, 1, rotary_dim]
    sin: torch.Tensor,  # [tokens, 1, rotary_dim], the first half negated
) -> torch.Tensor:  # qk
    """RoPE in the half-split layout on the first ``rotary_dim`` of every head, in float32, rounded once:
    ``x * cos + x.roll(rotary_dim // 2) * sin``; the rest of each head untouched."""
    rotary_dim = cos.shape[-1]
    x = qk[..., :rotary_dim].float()
    qk[..., :rotary_dim] = (x * cos.float() + x.roll(rotary_dim // 2, dims=-1) * sin.float()).to(qk.dtype)
    return qk


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:  # [tokens, width]
    """``act(gate) * up`` of a packed ``[tokens, 2 * width]`` gate/up output, in float32: the activation
    (``silu`` or ``gelu_pytorch_tanh``) rounded to the dtype, then the product."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return (act.to(gate_up.dtype).float() * up).to(gate_up.dtype)

"""Attention over a paged KV cache whose result for a query depends on that query alone.

Each query's output must be the same bits whatever else shares its step (other sequences, their
lengths, a prefill chunk beside it) and however its own prompt was cut into chunks. A fused
attention kernel does not promise that: PyTorch's CPU flash attention sizes its query and key
blocks by the longest sequence of the call, and a padded batch changes how each row's sums are
split. A BLAS matmul does not promise it either: it picks its kernel by the shape of the call, and
which shapes share a kernel differs by CPU. Measured with torch 2.13 / MKL: on a 2-core Xeon only a
lone row took another kernel; on a 2-core AMD EPYC calls of 1-3, 5-7 and 9-11 rows summed a row
differently from a call of 150, while every multiple of 8 rows (8 to 776, any offset of the rows, 64
to 2048 keys) gave each row the bits an 8-row call gives it. So:

- each matmul computes a multiple of ``ROW_MULTIPLE`` query rows (padded with zero rows whose output
  is dropped): a row's scores ``q @ kᵀ`` (a reduction over the head dimension) and its sums
  ``p @ v`` are then the same bits whether it is a decode, one token of a chunk, or one of a long
  prefill;
- softmax over the keys, padded with -inf to the longest context of the group: PyTorch's row
  softmax sums each key into the same lane whatever the row's length, and padding adds exact zeros;
- ``p @ v``, whose reduction is over keys, runs in fixed tiles of ``KEY_TILE`` keys (a reduction
  over the whole context changes its blocking with the number of keys), one small matmul per tile,
  and the tiles' partial sums are added in tile order; tiles past a query's context add exact zeros.

Sequences are grouped by their number of new tokens (rounded up to a power of two) and each group
is padded to its own longest, so that a decode batch is not padded to a prefill chunk's length; a
long prefill's queries go ``QUERY_BLOCK`` at a time, each block over the keys its last query sees.
Every key/value head of every sequence in a group is one matrix of the same batched matmuls (keys and
values are gathered head-major, each head's keys one contiguous matrix), so a group of short queries
costs a few calls per layer whatever its heads (a long prompt's blocks, or heads whose scores would
pass ``ATTENTION_BYTES``, take more); each matrix has one head's shape and layout in every call, and
with them its sums. Batching the heads makes CPU steps shorter than a call per head, a prompt's
chunk beside decodes the most (benchmarks/RESULTS.md, "Attention and LoRA per step").
Scores, probabilities and sums are float32 whatever the model's dtype (a bfloat16 matmul would
switch kernels with the shape as the projections' do).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from data_plane.model.attention import KV_FP8

KEY_TILE = 64
# Every matmul computes a multiple of this many query rows (query heads of a key/value head, times
# queries); a decode's rows (its query heads per key/value head) are padded to it. 8 held on a 2-core AMD
# EPYC (above); a pod takes the first of ROW_MULTIPLES, the cheapest first, that keeps a row's bits on its
# own CPU (``row_rule``): on a 2-core Xeon with AMX any count of rows did, so nothing is padded there.
ROW_MULTIPLE = 8
ROW_MULTIPLES = (1, 2, 4, 8, 16, 32)
# A long prefill's queries are taken this many at a time, each block over the keys its last query sees
# (causal: the first of four blocks reads a quarter of the keys). Tiles a block skips would add zeros.
QUERY_BLOCK = 128
# Working memory one call's heads may take (scores, probabilities, tile sums; float32): past it a group's
# heads go a few at a time. All heads at once for a 128-query block of an 8-head model at 8k keys would
# take about 0.7 GB.
ATTENTION_BYTES = 64 << 20


class SeqShare(Protocol):
    """One sequence's share of a step: its block table, cached and new tokens."""

    block_table: Sequence[int] | torch.Tensor
    num_cached: int
    num_new: int


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences of one step whose queries are computed together, padded to the group's longest."""

    query_index: torch.Tensor  # [seqs, max_new] step token of each query (pad -> 0)
    key_index: torch.Tensor  # [seqs, keys] cache slot of each key, keys a multiple of KEY_TILE (pad -> 0)
    hidden: dict[int | None, torch.Tensor]  # window -> [seqs, max_new, keys] bool, True where a query may not see a key
    rows: torch.Tensor  # [group tokens] row of each real query in the flattened [seqs * max_new] queries
    tokens: torch.Tensor  # [group tokens] its step token
    # keys that queries QUERY_BLOCK * i onwards (the next QUERY_BLOCK) may see, a multiple of KEY_TILE
    block_keys: tuple[int, ...]
    _head_major: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def head_major(self, num_kv: int) -> torch.Tensor:
        """[num_kv * seqs * keys]: the row of each (key/value head, key) in a cache viewed as [slots * num_kv,
        head_dim], head by head; the same for every layer of the step, so made once."""
        index = self._head_major.get(num_kv)
        if index is None:
            heads = torch.arange(num_kv, device=self.key_index.device)[:, None]
            index = self._head_major[num_kv] = (self.key_index.reshape(1, -1) * num_kv + heads).reshape(-1)
        return index


def build_groups(seqs: Sequence[SeqShare], block_size: int, windows: set[int | None],
                 device: torch.device | str = "cpu") -> tuple[AttentionGroup, ...]:
    """The groups of a step over ``seqs``, whose new tokens lie one sequence after another in the step's
    token dimension. Raises ValueError for a sequence whose block table is too short for its context."""
    starts, token = [], 0
    for s in seqs:
        starts.append(token)
        token += s.num_new
    by_bucket: dict[int, list[int]] = {}
    for b, s in enumerate(seqs):
        by_bucket.setdefault(1 << max(0, s.num_new - 1).bit_length(), []).append(b)
    return tuple(_group([seqs[b] for b in members], [starts[b] for b in members], block_size, windows, device)
                 for _, members in sorted(by_bucket.items()))


def _group(seqs: Sequence[SeqShare], starts: list[int], block_size: int, windows: set[int | None],
           device: torch.device | str) -> AttentionGroup:
    n = len(seqs)
    max_new = max(s.num_new for s in seqs)
    keys = _tiles(max(s.num_cached + s.num_new for s in seqs))
    query_index = torch.zeros(n, max_new, dtype=torch.long)
    key_index = torch.zeros(n, keys, dtype=torch.long)
    query_pos = torch.full((n, max_new), -1, dtype=torch.long)  # -1 marks padding
    ctx_lens = torch.zeros(n, dtype=torch.long)
    rows, tokens = [], []
    for b, (s, start) in enumerate(zip(seqs, starts, strict=True)):
        ctx = s.num_cached + s.num_new
        if len(s.block_table) * block_size < ctx:
            raise ValueError(f"a sequence needs {ctx} slots but owns {len(s.block_table)} blocks")
        pos = torch.arange(ctx)
        blocks = torch.as_tensor(s.block_table).long()
        key_index[b, :ctx] = blocks[pos // block_size] * block_size + pos % block_size
        query_index[b, : s.num_new] = torch.arange(start, start + s.num_new)
        query_pos[b, : s.num_new] = pos[s.num_cached:]
        ctx_lens[b] = ctx
        rows.append(torch.arange(s.num_new) + b * max_new)
        tokens.append(torch.arange(start, start + s.num_new))
    key_pos = torch.arange(keys)
    base = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < ctx_lens[:, None, None])
    hidden = {}
    for window in windows:
        mask = base if window is None else base & (key_pos[None, None, :] > query_pos[:, :, None] - window)
        # Padded query rows see key 0 so that softmax never sees an empty row; their output is dropped.
        hidden[window] = (~(mask | ((query_pos[:, :, None] < 0) & (key_pos[None, None, :] == 0)))).to(device)
    block_keys = tuple(_tiles(max(s.num_cached + min(q0 + QUERY_BLOCK, s.num_new) for s in seqs))
                       for q0 in range(0, max_new, QUERY_BLOCK))
    return AttentionGroup(query_index.to(device), key_index.to(device), hidden, torch.cat(rows).to(device),
                          torch.cat(tokens).to(device), block_keys)


def _tiles(keys: int) -> int:
    """``keys`` rounded up to whole key tiles."""
    return -(-keys // KEY_TILE) * KEY_TILE


def tiled_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim] (one layer), holding this step's keys
    v_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim] (one layer), holding this step's values
    groups: Sequence[AttentionGroup],
    window: int | None,
    scale: float,
    softcap: float | None = None,
    row_multiple: int = ROW_MULTIPLE,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim] in q's dtype
    """``softmax(q·scale kᵀ, masked causally and to ``window``) v`` for every token over its own
    sequence's keys, query head h reading key/value head h // (num_heads // num_kv_heads); with
    ``softcap``, the scores are ``softcap·tanh(scores / softcap)`` before the mask. Every matmul computes a
    multiple of ``row_multiple`` query rows. An e4m3 cache's keys are read as ``e4m3 · k_scale``, its values as
    ``e4m3 · v_scale`` (elementwise: a key's value is still its own)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    per_kv = num_heads // num_kv
    out = q.new_zeros(num_tokens, num_heads * head_dim)  # rows of no group (padding) stay zero
    # the caches as one row per (slot, key/value head), gathered head-major: each head's keys one matrix
    k_rows, v_rows = k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)  # [slots * num_kv_heads, head_dim]
    for g in groups:
        n, max_new = g.query_index.shape
        keys = g.key_index.shape[1]
        hidden = g.hidden[window]  # [n, max_new, keys]
        # rows of one key/value head: its (query, head) pairs, [kv_heads, n, max_new * per_kv, head_dim]
        qg = q.index_select(0, g.query_index.reshape(-1)).float().mul_(scale)
        qg = qg.view(n, max_new, num_kv, per_kv, head_dim).permute(2, 0, 1, 3, 4)
        rows = max_new * per_kv
        qg = qg.reshape(num_kv, n, rows, head_dim)
        # keys and values as gathered, [kv_heads, n, keys, head_dim]
        index = g.head_major(num_kv)
        k = k_rows.index_select(0, index).view(num_kv, n, keys, head_dim).float()
        v = v_rows.index_select(0, index).view(num_kv, n, keys, head_dim).float()
        if k_cache.dtype == KV_FP8:
            k, v = k.mul_(k_scale), v.mul_(v_scale)
        # A block over fewer keys than the group's is taken one sequence at a time.
        seqs = [slice(None)] if len(g.block_keys) == 1 else [slice(b, b + 1) for b in range(n)]
        attn = qg.new_empty(num_kv, n, rows, head_dim)
        for s, (i, block_keys) in itertools.product(seqs, enumerate(g.block_keys)):
            q0, q1 = i * QUERY_BLOCK, min((i + 1) * QUERY_BLOCK, max_new)
            together = _heads_per_call(num_kv, len(range(n)[s]), (q1 - q0) * per_kv, block_keys, head_dim,
                                       row_multiple)
            for h0 in range(0, num_kv, together):
                h = slice(h0, h0 + together)
                attn[h, s, q0 * per_kv : q1 * per_kv] = _attend(
                    qg[h, s, q0 * per_kv : q1 * per_kv], k[h, s, :block_keys], v[h, s, :block_keys],
                    hidden[s, q0:q1, :block_keys], per_kv, softcap, row_multiple)
        # [n, max_new, kv_heads, per_kv, head_dim]: query head h is kv head h // per_kv, place h % per_kv
        attn = attn.view(num_kv, n, max_new, per_kv, head_dim).permute(1, 2, 0, 3, 4)
        attn = attn.reshape(n * max_new, num_heads * head_dim)
        out.index_copy_(0, g.tokens, attn.index_select(0, g.rows).to(out.dtype))
    return out


def _heads_per_call(num_kv: int, n: int, rows: int, keys: int, head_dim: int, row_multiple: int) -> int:
    """How many key/value heads one ``_attend`` call takes: all of them, unless their float32 scores,
    probabilities and tile sums for ``n`` sequences' ``rows`` query rows over ``keys`` keys would pass
    ``ATTENTION_BYTES``; then as many as fit, at least one. A head's matrices are the same in any call."""
    padded = -(-rows // row_multiple) * row_multiple
    per_head = 4 * n * padded * (2 * keys + keys // KEY_TILE * head_dim)
    return max(1, min(num_kv, ATTENTION_BYTES // per_head))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
            per_kv: int, softcap: float | None, row_multiple: int) -> torch.Tensor:  # [kv_heads, n, rows, head_dim]
    """Attention for a block of queries of ``n`` sequences, every key/value head and sequence one
    matrix of one batch: ``q`` [kv_heads, n, queries * per_kv, head_dim] (scaled), ``k`` and ``v``
    [kv_heads, n, keys, head_dim], ``hidden`` [n, queries, keys]."""
    num_kv, n, rows, head_dim = q.shape
    keys, tiles, batch = k.shape[2], k.shape[2] // KEY_TILE, num_kv * n
    padded = -(-rows // row_multiple) * row_multiple
    q = q.reshape(batch, rows, head_dim)
    if padded != rows:  # zero rows, left unmasked (a finite softmax), dropped at the end
        q = torch.cat([q, q.new_zeros(batch, padded - rows, head_dim)], dim=1)
    scores = torch.bmm(q, k.reshape(batch, keys, head_dim).transpose(1, 2))  # [batch, padded, keys]
    if softcap is not None:  # elementwise: a score's value still depends on its own row alone
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    real = scores.view(num_kv, n, padded, keys)[:, :, :rows]
    real.view(num_kv, n, rows // per_kv, per_kv, keys).masked_fill_(hidden[None, :, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, padded, tiles, KEY_TILE).transpose(1, 2)
    probs = probs.reshape(num_kv, n * tiles, padded, KEY_TILE)
    # v's tiles as views, each [KEY_TILE, head_dim] with rows head_dim apart: one layout for every call
    parts = probs.new_empty(num_kv, n * tiles, padded, head_dim)
    if v.is_contiguous():
        torch.bmm(probs.reshape(batch * tiles, padded, KEY_TILE), v.view(batch * tiles, KEY_TILE, head_dim),
                  out=parts.view(batch * tiles, padded, head_dim))
    else:  # a block over fewer keys than were gathered (one sequence): a head's tiles are still a view
        for h in range(num_kv):
            torch.bmm(probs[h], v[h].view(n * tiles, KEY_TILE, head_dim), out=parts[h])
    sums = parts.view(batch, tiles, padded, head_dim).sum(dim=1)  # tile by tile
    return sums[:, :rows].reshape(num_kv, n, rows, head_dim)

"""What the paged-attention launchers share: the layout they read, argument checks and tile sizes.

Layout (one layer of ``data_plane.model.attention.KVCache``; see ``kernels.paged_attention`` for
the semantics)::

    q, out:           [num_tokens, num_heads, head_dim]      may be views, dense along head_dim
    k_cache, v_cache: [num_slots, num_kv_heads, head_dim]    contiguous; slot = block * block_size + offset;
                                                             q's dtype, or float8_e4m3fn with a scale each
    block_tables:     [num_seqs, max_blocks] int32           rows may be further apart than max_blocks
    seq_lens:         [num_seqs] int32                       context length after this step
    query_start:      [num_seqs + 1] int32                   sequence b's queries are rows query_start[b]:[b + 1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_FP8 = torch.float8_e4m3fn  # an FP8 KV cache's dtype (``data_plane.model.attention.KV_FP8``)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionShape:
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_seqs: int

    @property
    def head_pad(self) -> int:
        """head_dim rounded up to a power of two: the kernels' tile width along a head (tl.arange)."""
        return triton.next_power_of_2(self.head_dim)

    @property
    def group(self) -> int:
        """Query heads per kv head: query head h reads kv head h // group."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class AttentionTiles:
    """One launch's tiles (``kernels.attention_unified``). A prefill item owns ``block_m`` rows (query
    tokens x the query heads of one kv head) and walks the keys in tiles of ``block_n``; a decode item
    walks one split of its row in tiles of ``decode_block_n``, the split given by ``decode_splits``
    (``min_split``, a multiple of ``decode_block_n``, and ``max_splits``, the grid's items per sequence)."""

    block_m: int
    block_n: int
    decode_block_n: int
    min_split: int = 128
    max_splits: int = 16
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        _check_tile("AttentionTiles.block_m", self.block_m)
        _check_tile("AttentionTiles.block_n", self.block_n)
        _check_tile("AttentionTiles.decode_block_n", self.decode_block_n)
        if self.min_split < self.decode_block_n or self.min_split % self.decode_block_n:
            raise ValueError(f"AttentionTiles.min_split={self.min_split} must be a positive multiple of "
                             f"decode_block_n={self.decode_block_n}")
        if self.max_splits < 1:
            raise ValueError(f"AttentionTiles.max_splits={self.max_splits} must be at least 1")


def decode_splits(seq_len: int, window: int | None, tiles: AttentionTiles) -> tuple[int, int]:
    """(split size, split count) of a sequence with one query and ``seq_len`` tokens: a rule on its
    own length (and the model's window), never on the batch, so its sums are taken in one order
    whatever shares its step. Its attended keys, from the first one (``seq_len - window``, or 0) rounded
    down to a key tile, are cut into ``ceil(span / min_split)`` splits, at most ``max_splits``, of
    equal size rounded up to a key tile; a row shorter than ``min_split`` runs in one split (no merge),
    and so does a row of length 0 (padding), which writes zeros.
    The kernel evaluates the same rule (``attention_unified.split_rule``)."""
    lo = 0 if window is None else max(seq_len - window, 0)
    span = seq_len - lo // tiles.decode_block_n * tiles.decode_block_n
    count = min(max(-(-span // tiles.min_split), 1), tiles.max_splits)
    tile = tiles.decode_block_n
    per_split = -(-span // count)
    size = max((per_split + tile - 1) // tile * tile, tile)
    return size, max(-(-span // size), 1)


def _check_tile(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value}: tile sizes must be powers of two and at least 16 (tl.dot)")


def check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    out: torch.Tensor,
    *,
    block_size: int,
    window: int | None,
    max_query_len: int,
    max_seq_len: int,
    softcap: float | None = None,
) -> AttentionShape:
    """Raises ValueError, saying what to fix, unless the arguments follow the layout above; returns
    their sizes. Reads nothing on the device (the values of the int32 tensors are not checked)."""
    if q.dim() != 3 or q.dtype not in DTYPES:
        raise ValueError(
            f"q must be [num_tokens, num_heads, head_dim] in one of {DTYPES}, got {q.dtype} {tuple(q.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    if head_dim < 16 or head_dim > MAX_HEAD_DIM or head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 from 16 to {MAX_HEAD_DIM}, got {head_dim}")
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have stride 1 along head_dim, got strides {t.stride()}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must be {q.dtype} {tuple(q.shape)} on {q.device} like q, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 3 or t.shape[2] != head_dim or t.dtype not in (q.dtype, KV_FP8) or t.device != q.device:
            raise ValueError(
                f"{name} must be {q.dtype} (like q) or {KV_FP8} [num_slots, num_kv_heads, {head_dim}] on "
                f"{q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (one layer of the KV cache)")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must have one shape and dtype, got {k_cache.dtype} {tuple(k_cache.shape)} and "
            f"{v_cache.dtype} {tuple(v_cache.shape)}"
        )
    num_slots, num_kv_heads = k_cache.shape[0], k_cache.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not isinstance(block_size, int) or block_size < 1 or num_slots % block_size:
        raise ValueError(f"block_size must be a positive int dividing the cache's {num_slots} slots, got {block_size}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.device != q.device:
        raise ValueError(
            f"block_tables must be int32 [num_seqs, max_blocks] on {q.device}, got "
            f"{block_tables.dtype} {tuple(block_tables.shape)} on {block_tables.device}"
        )
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must have stride 1 along a row, got strides {block_tables.stride()}")
    num_seqs = block_tables.shape[0]
    for name, t, size in (("seq_lens", seq_lens, num_seqs), ("query_start", query_start, num_seqs + 1)):
        if t.shape != (size,) or t.dtype != torch.int32 or t.device != q.device or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous int32 tensor [{size}] on {q.device} (one entry per "
                f"block_tables row{' plus one' if size > num_seqs else ''}), got {t.dtype} "
                f"{tuple(t.shape)} on {t.device}"
            )
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be None or a positive number, got {softcap!r}")
    for name, value in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a host int >= 0 bounding every sequence's value, got {value!r}")
    return AttentionShape(num_tokens, num_heads, num_kv_heads, head_dim, num_seqs)


def group_rows(group: int) -> int:
    """Rows a decode program gives one kv head's query heads: tl.dot needs at least 16."""
    return max(16, triton.next_power_of_2(group))


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """The kernels' ``(qk_scale, cap)`` for ``scores``: they compute ``cap * tanh(qk_scale * q·k)``
    when soft-capping and ``qk_scale * q·k`` otherwise, in the log2 domain (for exp2): log2(e) is
    folded into the factor applied last."""
    if softcap is None:
        return scale * math.log2(math.e), 0.0
    return scale / softcap, softcap * math.log2(math.e)


@triton.jit
def scaled_scores(s, qk_scale, cap, SOFTCAP: tl.constexpr):
    """``s`` scaled into the log2 domain, soft-capped when ``SOFTCAP`` (see ``score_scales``)."""
    if SOFTCAP:
        # tanh(x) = 2·sigmoid(2x) - 1: tl has sigmoid on every Triton this runs on, and it saturates
        # to ±1 for large |x| without overflow.
        return cap * (2.0 * tl.sigmoid(2.0 * (s * qk_scale)) - 1.0)
    return s * qk_scale

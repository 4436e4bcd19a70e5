"""What the LoRA shrink and expand launchers share: the walk from a program id to its block of
tokens of one adapter slot, tile sizes, and argument checks.

The walk (``kernels.segments``) reads the segments of ``kernels.lora_meta``: segment ``i`` holds
the tokens ``sorted_tokens[seg_starts[i]:seg_starts[i + 1]]``, all on adapter slot
``seg_slots[i]``; its grid axis (``segments.segment_block_count``) depends only on the token count
and the number of segments, so a CUDA graph can replay it for any mix of adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora_meta import MIN_CHUNK, MIN_TILE, LoraMeta
from kernels.segments import segment_block_count, segment_walk

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def segment_block(
    seg_slots_ptr,  # [num_segments] int32
    seg_starts_ptr,  # [num_segments + 1] int32
    num_segments,
    pid,  # this program's index along the segment-block axis
    SEG_BLOCK: tl.constexpr,  # a power of two >= num_segments
    BLOCK_M: tl.constexpr,
):
    """(slot, first, end): the program's tokens are ``sorted_tokens[first:end]`` (at most
    ``BLOCK_M``), all on adapter ``slot``; ``slot`` is -1 when the program has no tokens."""
    segment, first, end = segment_walk(seg_starts_ptr, num_segments, pid, SEG_BLOCK, BLOCK_M)
    # Loaded beside the segment starts (no load waits on the walk), then picked like its bounds.
    offs_s = tl.arange(0, SEG_BLOCK)
    slots = tl.load(seg_slots_ptr + offs_s, mask=offs_s < num_segments, other=-1)  # [SEG_BLOCK]
    slot = tl.sum(tl.where(offs_s == segment, slots, 0), axis=0)
    return tl.where(segment >= 0, slot, -1), first, end


@triton.jit
def block_tokens(
    sorted_tokens_ptr,  # [num_tokens] int32
    seg_slots_ptr,
    seg_starts_ptr,
    num_segments,
    pid,
    SEG_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(slot, tokens, m_mask) of ``segment_block``'s block: ``tokens`` [BLOCK_M] int64 row indices, valid
    where ``m_mask``; nothing is loaded (and ``slot`` is -1) when the program has no tokens."""
    slot, first, end = segment_block(seg_slots_ptr, seg_starts_ptr, num_segments, pid, SEG_BLOCK, BLOCK_M)
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = (offs_m < end) & (slot >= 0)
    tokens = tl.load(sorted_tokens_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BLOCK_M]
    return slot, tokens, m_mask


@triton.jit
def dot_features(
    acc,  # [BLOCK_M, BLOCK_R] float32
    x_rows,  # [BLOCK_M, 1] pointers to the rows of x
    a_rows,  # [1, BLOCK_R] pointers to the rows of A
    m_mask,  # [BLOCK_M]
    r_mask,  # [BLOCK_R]: rows of A to load (past the rank: never)
    k_lo,
    k_hi,
    in_features,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``acc + x[:, k_lo:k_hi] @ A[:, k_lo:k_hi].T``, in ``BLOCK_K`` steps from ``k_lo``: the shrink's sum
    over in_features, the same instructions in the split shrink and the fused kernel."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_features
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_rows + k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        if UPCAST or x_rows.dtype.element_ty == tl.float32:
            acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)  # tensor cores in the input dtype, float32 accumulator
    return acc


@triton.jit
def add_to_rows(y_tile, acc, m_mask, n_mask, whole):
    """``y_tile += acc`` (float32, rounded once to y's dtype) at rows ``m_mask`` and columns ``n_mask``;
    ``whole``: every column of the tile is in ``n_mask``. Two copies of the read-add-write: a mask that
    varies along a row stops the common case, a whole tile, from using vector loads and stores."""
    if whole:
        y = tl.load(y_tile, mask=m_mask[:, None], other=0.0)
        tl.store(y_tile, (y.to(tl.float32) + acc).to(y.dtype), mask=m_mask[:, None])
    else:
        mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_tile, mask=mask, other=0.0)
        tl.store(y_tile, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def check_slice_offsets(slice_offsets: torch.Tensor, num_slices: int, device: torch.device) -> None:
    """An int32 tensor [num_slices + 1] on ``device`` (its values live there and are not checked)."""
    if (
        not isinstance(slice_offsets, torch.Tensor)
        or slice_offsets.shape != (num_slices + 1,)
        or slice_offsets.dtype != torch.int32
        or slice_offsets.device != device
    ):
        got = slice_offsets
        if isinstance(slice_offsets, torch.Tensor):
            got = f"{slice_offsets.dtype} {tuple(slice_offsets.shape)} on {slice_offsets.device}"
        raise ValueError(f"slice_offsets must be an int32 tensor [{num_slices + 1}] on {device}, got {got}")


def check_lora_b(lora_b: torch.Tensor, device: torch.device) -> None:
    if lora_b.dim() != 3 or not lora_b.is_contiguous():
        raise ValueError(f"lora_b must be contiguous [max_loras, out_features, max_rank], got {tuple(lora_b.shape)}")
    if lora_b.dtype not in DTYPES or lora_b.device != device:
        raise ValueError(f"lora_b must be one of {DTYPES} on {device}, got {lora_b.dtype} on {lora_b.device}")


def check_meta(meta: LoraMeta, num_tokens: int, device: torch.device) -> None:
    """Raises ValueError unless ``meta`` describes ``num_tokens`` tokens in int32 buffers on ``device``."""
    if meta.num_tokens != num_tokens:
        raise ValueError(f"meta was built for {meta.num_tokens} tokens but the inputs have {num_tokens}")
    num_segments = meta.seg_slots.shape[0]
    if meta.seg_starts.shape != (num_segments + 1,):
        raise ValueError(f"meta.seg_starts must be [{num_segments + 1}], got {tuple(meta.seg_starts.shape)}")
    for name in ("sorted_tokens", "seg_slots", "seg_starts"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or t.device != device or not t.is_contiguous():
            raise ValueError(f"meta.{name} must be a contiguous int32 tensor on {device}, got {t.dtype} on {t.device}")


def check_ranks(ranks: torch.Tensor, num_slices: int, num_slots: int, device: torch.device) -> None:
    if ranks.shape != (num_slices, num_slots) or ranks.dtype != torch.int32 or ranks.device != device:
        raise ValueError(
            f"ranks must be int32 [{num_slices}, {num_slots}] on {device}, "
            f"got {ranks.dtype} {tuple(ranks.shape)} on {ranks.device}"
        )
    if not ranks.is_contiguous():
        raise ValueError("ranks must be contiguous")


def check_buf(buf: torch.Tensor, num_slices: int, num_tokens: int, max_rank: int, device: torch.device) -> None:
    """``buf`` may be a view (the layers slice a larger scratch buffer); its rank axis must be dense."""
    if buf.shape != (num_slices, num_tokens, max_rank) or buf.dtype != torch.float32 or buf.device != device:
        raise ValueError(
            f"buf must be float32 [{num_slices}, {num_tokens}, {max_rank}] on {device}, "
            f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
        )
    if max_rank > 1 and buf.stride(2) != 1:
        raise ValueError(f"buf's rank axis must have stride 1, got strides {buf.stride()}")


def check_rows(name: str, t: torch.Tensor) -> None:
    """A [num_tokens, features] operand may skip between rows but must be dense along a row."""
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} must be one of {DTYPES}, got {t.dtype}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have stride 1 along its features, got strides {t.stride()}")


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one launch: each program computes a ``[m, n]`` output tile (shrink: tokens x
    rank columns; expand: tokens x output columns), looping over its reduction in steps of ``k``.
    The shrink sums its reduction (in_features) in ``chunk``s, each from zero, added in order: a
    multiple of ``k``, 0 for one chunk of everything. The expand's programs each walk ``col_tiles``
    column tiles of ``n``. ``num_stages`` 0 leaves Triton's default."""

    m: int
    n: int
    k: int
    num_warps: int = 4
    chunk: int = 0
    num_stages: int = 0
    col_tiles: int = 1

    def __post_init__(self) -> None:
        for name in ("m", "n", "k"):
            value = getattr(self, name)
            if value < MIN_TILE or value & (value - 1):
                raise ValueError(f"Tiles.{name}={value}: tile sizes must be powers of two and at least 16 (tl.dot)")
        if self.chunk and (self.chunk % self.k or self.chunk < MIN_CHUNK):
            raise ValueError(f"Tiles.chunk={self.chunk}: a chunk is a multiple of k={self.k} and at least {MIN_CHUNK}")
        if self.col_tiles < 1:
            raise ValueError(f"Tiles.col_tiles={self.col_tiles}: a program walks at least one column tile")

    def launch_options(self) -> dict[str, int]:
        """The launch's keyword options: warps, and stages where set."""
        return {"num_warps": self.num_warps} | ({"num_stages": self.num_stages} if self.num_stages else {})


def column_grid(num_tokens: int, out_features: int, num_segments: int, tiles: Tiles) -> tuple[int, int]:
    """The expand's and the fused kernel's grid: (column groups of ``tiles.n * tiles.col_tiles`` columns of
    the packed output, token blocks of the segments), one program each. Tiling the packed output rather
    than each slice keeps the grid independent of the (device-side) slice widths."""
    return (triton.cdiv(out_features, tiles.n * tiles.col_tiles),
            segment_block_count(num_tokens, num_segments, tiles.m))

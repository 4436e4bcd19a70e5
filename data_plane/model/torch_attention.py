"""The CPU attention backend: each step's sequences grouped by their number of new tokens, their
contexts gathered through their block tables, and attention computed in fixed key tiles with plain
matmuls (``tiled_attention``), so that a query's result depends on its own sequence alone, whatever
shares the step and however its prompt was chunked. The groups are built once per step from the
step's ``AttentionInputs`` and shared by every layer. On CUDA the Triton backend reads the cache in
place instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.model.attention import AttentionInputs, write_kv
from data_plane.model.tiled_attention import ROW_MULTIPLE, AttentionGroup, build_groups, tiled_attention


@dataclass(frozen=True)
class _Share:
    block_table: torch.Tensor  # [max_blocks] int32, its row of the step's block tables
    num_cached: int
    num_new: int


@dataclass(frozen=True)
class TiledAttention:
    """One step's attention groups; called by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot that receives each new token
    groups: tuple[AttentionGroup, ...]
    row_multiple: int  # every matmul computes a multiple of this many query rows

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, window: int | None, scale: float, softcap: float | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        write_kv(k_cache, self.slot_mapping, k, k_scale)
        write_kv(v_cache, self.slot_mapping, v, v_scale)
        return tiled_attention(q, k_cache, v_cache, self.groups, window, scale, softcap, self.row_multiple,
                               k_scale, v_scale)


class TorchAttention:
    """``windows`` are the sliding windows the model's layers use (None: full); every matmul computes a
    multiple of ``row_multiple`` query rows (``tiled_attention.ROW_MULTIPLES``)."""

    def __init__(self, windows: set[int | None], row_multiple: int = ROW_MULTIPLE) -> None:
        self.windows = set(windows)
        self.row_multiple = row_multiple

    def prepare(self, inputs: AttentionInputs) -> TiledAttention:
        starts, lens = inputs.query_start.tolist(), inputs.seq_lens.tolist()  # host tensors on a CPU pod
        # Padding sequences (no context) come last and are left out: their rows stay zero.
        shares = [_Share(inputs.block_tables[b], lens[b] - (starts[b + 1] - starts[b]), starts[b + 1] - starts[b])
                  for b in range(len(lens)) if lens[b] > 0]
        return TiledAttention(inputs.slot_mapping, build_groups(shares, inputs.block_size, self.windows),
                              self.row_multiple)

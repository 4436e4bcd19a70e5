"""The adapter slots of one projection kind (``self_attn.qkv_proj``, ...) across every layer, in
one buffer per role, allocated once at start-up.

Each layer's ``LoRAProjection`` owns a contiguous view of these buffers (``layer_buffers``), in the
layout the kernels read; the pool writes a whole adapter's groups of its kind into a slot
(``write``), straight from the buffer the adapter's file was read into. Only the first ``rank``
columns of a slot are ever read (``kernels.reference``, the Triton kernels, ``kernels.cpu_lora``),
so a write copies the adapter's ranks and no padding, and a clear sets the slot's ranks to 0 and leaves its
bytes: an empty slot is one of rank 0 everywhere, whatever its buffers hold.
"""

from __future__ import annotations

from typing import Protocol

import torch

from data_plane.lora.lora_adapter import SliceGroup, write_a, write_b


class SlotOwner(Protocol):
    """A layer whose slots live in a pool: told which ranks a slot of it now holds."""

    host_ranks: list[list[int]]  # [S][max_loras]

    def slot_written(self, slot: int, ranks: list[int]) -> None: ...


class SlotPool:
    def __init__(self, kind: str, num_layers: int, slices: dict[str, int], in_features: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.kind = kind
        self.slice_index = {name: s for s, name in enumerate(slices)}
        self.row_offsets = [0]
        for width in slices.values():
            self.row_offsets.append(self.row_offsets[-1] + width)
        num_slices, out_features = len(slices), self.row_offsets[-1]
        self.a = torch.zeros(  # [layers, S, max_loras, max_rank, in_features]
            num_layers, num_slices, max_loras, max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(  # [layers, max_loras, out_features, max_rank]
            num_layers, max_loras, out_features, max_rank, dtype=dtype, device=device)
        self.ranks = torch.zeros(num_layers, num_slices, max_loras, dtype=torch.int32, device=device)  # [layers, S, L]
        self.owners: list[SlotOwner | None] = [None] * num_layers

    def layer_buffers(self, layer: int, owner: SlotOwner) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``lora_a`` [S, max_loras, max_rank, in], ``lora_b`` [max_loras, out, max_rank]
        and ``ranks`` [S, max_loras], contiguous views of the pool; ``owner`` is told of every write."""
        self.owners[layer] = owner
        return self.a[layer], self.b[layer], self.ranks[layer]

    def write(self, slot: int, groups: list[SliceGroup]) -> None:
        """Puts ``groups`` (an adapter's groups of this kind) into ``slot`` of every layer, in the pool's
        dtype with B's scale folded in (``lora_adapter.write_b``); slices and layers they lack get
        rank 0. Copies are asynchronous from pinned memory on a GPU."""
        table = [[0] * len(self.slice_index) for _ in self.owners]  # [layers][S] the slot's new ranks
        for g in groups:
            s, r = self.slice_index[g.slice], g.rank
            lo, hi = self.row_offsets[s], self.row_offsets[s + 1]
            for run in g.runs:
                layers = slice(run.layers.start, run.layers.stop)
                write_a(self.a[layers, s, slot, :r], run.a)
                write_b(self.b[layers, slot, lo:hi, :r], run.b, run.scale)
                for layer in run.layers:
                    table[layer][s] = r
        self.ranks[:, :, slot].copy_(torch.tensor(table, dtype=torch.int32))
        self._tell_owners(slot, table)

    def clear(self, slot: int) -> None:
        """Empties ``slot`` in every layer: its ranks become 0 (its bytes are then never read)."""
        self.ranks[:, :, slot] = 0
        self._tell_owners(slot, [[0] * len(self.slice_index) for _ in self.owners])

    def _tell_owners(self, slot: int, table: list[list[int]]) -> None:
        for owner, ranks in zip(self.owners, table, strict=True):
            if owner is not None:
                owner.slot_written(slot, ranks)

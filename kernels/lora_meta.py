"""Per-step LoRA batch metadata: which adapter slot each token uses, grouped by slot.

Built once per step into buffers preallocated for the largest step, and read by every LoRA
layer of the model. Grouping tokens by slot lets one kernel launch serve prefill and decode
alike without reordering the requests: program ``(segment, block)`` processes the tokens
``sorted_tokens[seg_starts[segment] + block * BLOCK_M : ...]``, all of which use adapter slot
``seg_slots[segment]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraMeta:
    token_slots: torch.Tensor  # [num_tokens] int32, slot of each token, -1 = base model only
    sorted_tokens: torch.Tensor  # [num_tokens] int32, token indices grouped by slot (LoRA tokens first)
    seg_slots: torch.Tensor  # [max_loras] int32, slot of each segment, -1 = unused segment
    seg_starts: torch.Tensor  # [max_loras + 1] int32, segment s spans sorted_tokens[seg_starts[s]:seg_starts[s+1]]
    buffer: torch.Tensor  # [max_slices, max_tokens, max_rank] float32 scratch between shrink and expand
    num_tokens: int
    # Host copies for the CPU path, which loops over segments in Python.
    # (slot, start, end, run) of each used segment; run is the segment's first token when its tokens
    # are one contiguous run (an engine that orders its batch by adapter gets these), else -1: the CPU
    # path then slices instead of gathering.
    host_segments: tuple[tuple[int, int, int, int], ...]

    @property
    def has_lora(self) -> bool:
        return bool(self.host_segments)

    def segment_rows(self, start: int, end: int, run: int) -> slice | torch.Tensor:
        """The tokens of a segment of ``host_segments``: a slice when they are one contiguous run, else
        their indices."""
        return slice(run, run + end - start) if run >= 0 else self.sorted_tokens[start:end].long()


class LoraMetaBuilder:
    """Owns the preallocated metadata buffers and fills them for each step."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device | str, max_rank: int = 0,
                 max_slices: int = 3) -> None:
        self.max_tokens = max_tokens
        self.max_loras = max_loras
        self._buffer = torch.zeros(max_slices, max_tokens, max_rank, dtype=torch.float32, device=device)
        self._token_slots = torch.empty(max_tokens, dtype=torch.int32, device=device)  # [max_tokens]
        self._sorted_tokens = torch.empty(max_tokens, dtype=torch.int32, device=device)  # [max_tokens]
        self._seg_slots = torch.empty(max_loras, dtype=torch.int32, device=device)  # [max_loras]
        self._seg_starts = torch.empty(max_loras + 1, dtype=torch.int32, device=device)  # [max_loras + 1]

    def build(self, token_slots: Sequence[int]) -> LoraMeta:
        """Metadata for a step whose token ``t`` uses adapter slot ``token_slots[t]`` (-1 = none)."""
        n = len(token_slots)
        if n > self.max_tokens:
            raise ValueError(f"step has {n} tokens; the metadata buffers hold {self.max_tokens}")
        by_slot: dict[int, list[int]] = {}
        for t, slot in enumerate(token_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(t)
        if len(by_slot) > self.max_loras:
            raise ValueError(f"step uses {len(by_slot)} adapter slots; at most {self.max_loras} exist")
        order: list[int] = []
        seg_slots = [-1] * self.max_loras
        seg_starts = [0] * (self.max_loras + 1)
        segments = []
        for i, (slot, tokens) in enumerate(sorted(by_slot.items())):
            seg_slots[i] = slot
            run = tokens[0] if tokens[-1] - tokens[0] == len(tokens) - 1 else -1
            segments.append((slot, len(order), len(order) + len(tokens), run))
            order.extend(tokens)
        for i in range(len(by_slot), self.max_loras + 1):
            seg_starts[i] = len(order)
        for i, (_, start, _, _) in enumerate(segments):
            seg_starts[i] = start
        order.extend(t for t, slot in enumerate(token_slots) if slot < 0)
        # One host->device copy per buffer; non_blocking needs pinned memory to overlap on CUDA.
        self._token_slots[:n].copy_(torch.tensor(token_slots, dtype=torch.int32), non_blocking=True)
        self._sorted_tokens[:n].copy_(torch.tensor(order, dtype=torch.int32), non_blocking=True)
        self._seg_slots.copy_(torch.tensor(seg_slots, dtype=torch.int32), non_blocking=True)
        self._seg_starts.copy_(torch.tensor(seg_starts, dtype=torch.int32), non_blocking=True)
        return LoraMeta(
            token_slots=self._token_slots[:n],
            sorted_tokens=self._sorted_tokens[:n],
            seg_slots=self._seg_slots,
            seg_starts=self._seg_starts,
            buffer=self._buffer,
            num_tokens=n,
            host_segments=tuple(segments),
        )

"""Per-step LoRA batch metadata: which adapter slot each token uses, grouped by slot.

Built once per step by tensor ops into buffers preallocated for the largest step, and read by every
LoRA layer of the model. Grouping tokens by slot lets one kernel launch serve prefill and decode
alike without reordering the requests: program ``(segment, block)`` processes the tokens
``sorted_tokens[seg_starts[segment] + block * BLOCK_M : ...]``, all of which use adapter slot
``seg_slots[segment]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.step_buffer import StepBuffer


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
    # The split shrink's scratch (``kernels.lora_shrink``), None where the builder keeps none: one
    # float32 partial sum per (slice, chunk, token, rank column), and zeroed int32 arrival counters.
    partials: torch.Tensor | None = None  # [partial_rows * split_tokens * max_rank] float32
    counters: torch.Tensor | None = None  # [max_slices * rank tiles * token blocks] int32, zero between launches

    @property
    def has_lora(self) -> bool:
        return bool(self.host_segments)

    def segment_rows(self, start: int, end: int, run: int) -> slice | torch.Tensor:
        """The tokens of a segment of ``host_segments``: a slice when they are one contiguous run, else
        their indices."""
        return slice(run, run + end - start) if run >= 0 else self.sorted_tokens[start:end].long()


SECTIONS = ("token_slots", "sorted_tokens", "seg_slots", "seg_starts")
# The split shrink sums in_features in chunks of at least this many (``Tiles.chunk``), and splits a
# launch of at most SPLIT_TOKENS tokens (decode-sized steps) one program per chunk.
MIN_CHUNK = 64
SPLIT_TOKENS = 256
MIN_TILE = 16  # tl.dot's smallest tile side (``Tiles``)


def partial_rows(shapes: Sequence[tuple[int, int]]) -> int:
    """The partial rows a split shrink needs for projections of these (slices, in_features): the most
    (slice, chunk) pairs any of them has at the smallest chunk."""
    return max((s * -(-in_features // MIN_CHUNK) for s, in_features in shapes), default=0)


class LoraMetaBuilder:
    """Fills the metadata sections of a ``StepBuffer`` for each step: its own, or the step's shared
    one (``sections`` says what to reserve there), whose single upload then carries them."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device | str, max_rank: int = 0,
                 max_slices: int = 3, step_buffer: StepBuffer | None = None, partial_rows: int = 0) -> None:
        """``partial_rows`` (see ``partial_rows``): the split shrink's scratch, for GPU steps of up to
        SPLIT_TOKENS tokens; 0 keeps none, and every shrink walks its chunks in one program."""
        self.max_tokens = max_tokens
        self.max_loras = max_loras
        self._owns_buffer = step_buffer is None
        self._step = step_buffer or StepBuffer(self.sections(max_tokens, max_loras), device)
        self._buffer = torch.zeros(max_slices, max_tokens, max_rank, dtype=torch.float32, device=device)
        self._partials = self._counters = None
        if partial_rows and max_rank:
            split_tokens = min(max_tokens, SPLIT_TOKENS)
            self._partials = torch.empty(partial_rows * split_tokens * max_rank, dtype=torch.float32, device=device)
            rank_tiles = -(-max_rank // MIN_TILE)
            blocks = -(-split_tokens // MIN_TILE) + min(max_loras, split_tokens)  # token blocks (segments.py)
            self._counters = torch.zeros(max_slices * rank_tiles * blocks, dtype=torch.int32, device=device)

    @staticmethod
    def sections(max_tokens: int, max_loras: int) -> dict[str, int]:
        """The int32 sections a step buffer must hold for this builder."""
        return {"token_slots": max_tokens, "sorted_tokens": max_tokens, "seg_slots": max_loras,
                "seg_starts": max_loras + 1}

    def build(self, token_slots: Sequence[int] | torch.Tensor) -> LoraMeta:
        """Metadata for a step whose token ``t`` uses adapter slot ``token_slots[t]`` (-1 = none). With
        a shared step buffer, the caller uploads it."""
        slots = torch.as_tensor(token_slots, dtype=torch.int64).reshape(-1)  # [n] (host)
        n = slots.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"step has {n} tokens; the metadata buffers hold {self.max_tokens}")
        if n and int(slots.max()) >= self.max_loras:
            raise ValueError(f"slot {int(slots.max())} does not exist; there are {self.max_loras} adapter slots")
        key = torch.where(slots >= 0, slots, self.max_loras)  # base-model tokens sort last
        order = torch.sort(key, stable=True).indices  # [n]: tokens grouped by slot, in token order within a slot
        counts = torch.bincount(key, minlength=self.max_loras + 1)[: self.max_loras]  # [max_loras]
        used = torch.nonzero(counts).reshape(-1)  # [segments] slots in use, ascending (host)
        num_segments = used.shape[0]
        ends = counts[used].cumsum(0)  # [segments]
        starts = ends - counts[used]
        # A segment's tokens are one contiguous run when its last token is its first plus its length - 1.
        firsts, lasts = order[starts], order[(ends - 1).clamp(min=0)]
        runs = torch.where(lasts - firsts == ends - starts - 1, firsts, -1)
        if self._owns_buffer:
            self._step.wait_for_upload()
        host = {name: self._step.host_view(name) for name in SECTIONS}
        host["token_slots"][:n] = slots
        host["sorted_tokens"][:n] = order
        host["seg_slots"].fill_(-1)
        host["seg_slots"][:num_segments] = used
        host["seg_starts"].fill_(int(ends[-1]) if num_segments else 0)
        host["seg_starts"][:num_segments] = starts
        if self._owns_buffer:
            self._step.upload()
        device = {name: self._step.device_view(name) for name in SECTIONS}
        segments = tuple(zip(used.tolist(), starts.tolist(), ends.tolist(), runs.tolist(), strict=True))
        return LoraMeta(
            token_slots=device["token_slots"][:n],
            sorted_tokens=device["sorted_tokens"][:n],
            seg_slots=device["seg_slots"],
            seg_starts=device["seg_starts"],
            buffer=self._buffer,
            num_tokens=n,
            host_segments=segments,
            partials=self._partials,
            counters=self._counters,
        )

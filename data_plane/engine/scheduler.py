"""Decides which sequences run in the next step and how many of their tokens.

Running sequences go first (decodes, then unfinished prefill chunks); waiting ones are
admitted in arrival order while the token budget, KV blocks, sequence limit and adapter slots
allow. When blocks run out, the most recently admitted running sequence is preempted: its
blocks are freed and it is recomputed later from its prompt plus what it has generated.

Starvation bound: when the oldest admissible waiting request cannot get an adapter slot, no
later request that needs a slot is admitted until it does; running requests finish (bounded by
their max_tokens), their slots become evictable, and it is admitted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.sequence import Sequence, SequenceStatus
from data_plane.errors import CapacityExceeded
from data_plane.lora.adapter_cache import AdapterCache


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed for it this step

    @property
    def samples(self) -> bool:
        """True when this step completes the sequence's known tokens, so it gets a next token."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockManager, cache: AdapterCache | None,
                 adapter_ready: Callable[[str], bool]) -> None:
        self.limits = limits
        self.blocks = blocks
        self.cache = cache
        self._adapter_ready = adapter_ready  # False while the adapter is still being loaded
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.running) or any(self._admissible(s) for s in self.waiting)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.limits.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue
            num_new = min(seq.num_uncomputed, budget)
            if num_new <= 0:
                break
            while not self.blocks.can_allocate(seq, num_new):
                if self._preempt_latest(keep={seq, *(s.seq for s in batch)}) is None:
                    break
            if not self.blocks.can_allocate(seq, num_new):
                self._preempt(seq)
                continue
            self.blocks.allocate(seq, num_new)
            batch.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        slot_blocked = False
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            if not self._admissible(seq):
                continue
            needs_slot = seq.adapter is not None
            if needs_slot and slot_blocked:
                continue
            num_new = min(seq.num_uncomputed, budget)
            if not self.blocks.can_allocate(seq, num_new):
                break  # keep arrival order for KV blocks: later requests must not overtake
            if needs_slot:
                try:
                    seq.slot = self.cache.acquire(seq.adapter)
                except CapacityExceeded:
                    slot_blocked = True
                    continue
            self.waiting.remove(seq)
            self.blocks.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return batch

    def finish(self, seq: Sequence) -> None:
        """Frees everything ``seq`` holds; safe to call in any state, once or more."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def _admissible(self, seq: Sequence) -> bool:
        return seq.adapter is None or self._adapter_ready(seq.adapter)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.slot >= 0:
            self.cache.release(seq.adapter)
            seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _preempt_latest(self, keep: set[Sequence]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq not in keep:
                self._preempt(seq)
                return seq
        return None

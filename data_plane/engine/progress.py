"""A step's batch, and its one writer of each sequence's progress.

A step is a list of ``ScheduledSeq``: a sequence and how many of its tokens the step computes. What the
step did to each sequence (tokens computed, sampled tokens, blocks offered to the prefix cache, and a
preempted sequence's progress reset) is written in one place, ``Progress.record``, when the engine
records the step, and completed by ``Progress.settle`` as the device's sampled ids are read: a cache
hit, a preemption or a finished chunk changes a sequence's progress there, nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.sequence import PENDING, Sequence, SequenceStatus
from data_plane.engine.step_cost import StepShape


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed for it this step
    num_cached: int = 0  # tokens after its computed ones found in the prefix cache at admission (not computed)

    @property
    def samples(self) -> bool:
        """True when this step completes the sequence's known tokens, so it gets a next token."""
        return self.seq.num_computed + self.num_cached + self.num_new == self.seq.num_tokens


def step_shape(batch: list[ScheduledSeq]) -> StepShape:
    """What a step computes, as the step-time model reads it: a one-token entry is a decode row."""
    prefills = [item.num_new for item in batch if item.num_new > 1]
    slots = {item.seq.slot for item in batch}
    slots.discard(-1)
    return StepShape(len(batch) - len(prefills), sum(prefills), len(prefills), len(slots))


class Progress:
    def __init__(self, blocks: BlockManager) -> None:
        self._blocks = blocks
        self.preempted: list[Sequence] = []  # preempted since the last record, which resets their progress

    def record(self, batch: list[ScheduledSeq], token_ids: list[int | None], ran: bool = True) -> int:
        """Records what the step did to each sequence's progress: a sequence preempted since the last record
        holds no KV any more (it is recomputed from its first token); each scheduled chunk, and the cached
        tokens found for it at admission, is now in the cache; a sampled token (``token_ids``, one per item;
        None where the chunk samples nothing) joins its output, as PENDING where its id is still on the
        device. ``ran``: the step has run, so its full blocks whose ids are known are offered to the prefix
        cache; the engine records a step when it launches it (False) and settles it once its tokens are read
        (``settle``), so that a step that fails offers nothing it never computed. Sequences that ended while
        the step ran are left as they are. Returns how many preempted sequences it reset (they may be
        admitted again from the next step)."""
        preempted = len(self.preempted)
        for seq in self.preempted:
            seq.num_computed = 0
        self.preempted.clear()
        offer = self._blocks.cache_full_blocks if ran and self._blocks.prefix is not None else None
        finished = SequenceStatus.FINISHED
        for item, token in zip(batch, token_ids, strict=True):
            seq = item.seq
            if seq.status is finished:
                continue
            seq.num_computed += item.num_cached + item.num_new
            if token is not None:
                seq.output_ids.append(token)
                if token == PENDING:
                    seq.pending += 1
            if offer is not None:
                offer(seq)
        return preempted

    def settle(self, seq: Sequence, token_id: int | None) -> None:
        """The second half of a launched step's record for ``seq``, once the step has run: the id of its
        oldest pending token, read from the device, written in its place (None: the step sampled nothing for
        it), and its full blocks whose ids are known offered to the prefix cache."""
        if token_id is not None:
            seq.output_ids[len(seq.output_ids) - seq.pending] = token_id
            seq.pending -= 1
        if self._blocks.prefix is not None:
            self._blocks.cache_full_blocks(seq)

"""A step's per-sequence state kept between steps at each running sequence's block-table row.

A sequence holding KV blocks owns one row of the block table (``Sequence.kv_row``) from its first blocks
until it ends or is preempted. ``PersistentBatch`` keeps at that row of preallocated tensors what its
steps read:

- what stays fixed while it holds the row: its adapter slot and its sampling parameters
  (``sampler.row_fields``), its logit biases and its grammar matcher, written when a sequence is first
  seen on the row (or comes back on it with another adapter slot) and not again while it stays
  (``hold_all``: one identity check over the step's rows);
- its last sampled token, on the device (``token_ids``): each step's sampled ids are written in place at
  their rows by the step itself (``ModelRunner.execute``), and a step that decodes a token whose id the
  host has not read yet (asynchronous scheduling) reads it there, a gather by the step's rows on the
  device; the host keeps, per row, the position of that token (``sampled``), the check that the gather
  reads the token the sequence decodes.

A step's sampling inputs are one gather from these rows (``SamplingBatch.gather``). Per sequence the host
reads only what moves, its progress, in a few list comprehensions (``ModelRunner.prepare``); positions,
input ids and the rest are then built by a fixed number of tensor ops (``StepInputBuilder.build_columns``).
"""

from __future__ import annotations

from operator import eq, is_

import torch

from data_plane.engine.grammar import GrammarState
from data_plane.engine.sampler import ROW_FIELDS, SamplingBatch, row_fields
from data_plane.engine.sequence import Sequence


class PersistentBatch:
    def __init__(self, max_rows: int, device: torch.device | str = "cpu") -> None:
        """``max_rows``: the block table's rows (the block manager's ``max_seqs``); ``device``: the model's,
        where the sampled ids are kept."""
        self.fields = torch.zeros(max_rows, ROW_FIELDS, dtype=torch.int64)  # [rows, ROW_FIELDS]
        self._owner: list[Sequence | None] = [None] * max_rows
        self._slot = [-1] * max_rows  # the adapter slot the row was written with
        self._biases: dict[int, tuple[tuple[int, float], ...]] = {}  # row -> its owner's logit biases, if any
        self._grammars: dict[int, GrammarState] = {}  # row -> its owner's matcher, if constrained
        self.token_ids = torch.zeros(max_rows, dtype=torch.int32, device=device)  # [rows] each row's last sample
        # Per row, the position of the token its owner's last step sampled there (token_ids' entry once that step
        # has run); -1: none since the row was written.
        self.sampled = [-1] * max_rows
        self.writes = 0  # rows written since start-up (a test reads it)
        # The last step's sampling batch, its rows and the writes before it: a step over the same rows, none
        # written since, samples with it, only its counters sent again (SamplingBatch.recounted).
        self._last: tuple[list[int], int, SamplingBatch] | None = None

    def hold(self, seq: Sequence) -> int:
        """``seq``'s row, written first if another sequence (or ``seq`` with another adapter slot) had it."""
        row = seq.kv_row
        if self._owner[row] is not seq or self._slot[row] != seq.slot:
            self._write(row, seq)
        return row

    def hold_all(self, seqs: list[Sequence], rows: list[int], slots: list[int]) -> None:
        """``hold`` for each of a step's sequences, at ``rows`` with ``slots`` (theirs): one identity check
        over the rows where every sequence stays on its row with its slot."""
        if all(map(is_, map(self._owner.__getitem__, rows), seqs)) and \
                all(map(eq, map(self._slot.__getitem__, rows), slots)):
            return
        for seq in seqs:
            self.hold(seq)

    def fed(self, rows: list[int], positions: list[int]) -> bool:
        """Whether the last step at each of ``rows`` sampled the token at the matching position: the token
        ``token_ids`` holds there once that step has run."""
        return all(map(eq, map(self.sampled.__getitem__, rows), positions))

    def stepped(self, rows: list[int], positions: list[int], silent: list[int] = ()) -> None:
        """Records a step: the sequences at ``rows`` sample the tokens at ``positions`` (the step writes their
        ids into ``token_ids`` as it runs); those at ``silent`` rows compute without sampling, so their rows
        hold no token of theirs any more."""
        sampled = self.sampled
        for row in silent:
            sampled[row] = -1
        for row, position in zip(rows, positions, strict=True):
            sampled[row] = position

    def _write(self, row: int, seq: Sequence) -> None:
        self.fields[row] = torch.tensor(row_fields(seq), dtype=torch.int64)
        self._owner[row], self._slot[row] = seq, seq.slot
        self._biases.pop(row, None)
        self._grammars.pop(row, None)
        self.sampled[row] = -1
        if seq.params.logit_bias:
            self._biases[row] = seq.params.logit_bias
        if seq.grammar is not None:
            self._grammars[row] = seq.grammar
        self.writes += 1

    def sampling(self, rows: list[int], counters: list[int], device: torch.device | str) -> SamplingBatch:
        """The sampling batch of a step whose logits rows are the sequences at ``rows`` (held, in logits
        order), each sampling the token at position ``counters[i]``: what ``SamplingBatch.build`` gives for
        those sequences, gathered from the rows instead of read from each sequence."""
        last = self._last
        if last is not None and last[1] == self.writes and last[0] == rows:
            return last[2].recounted(counters)
        biases = [(i, t, b) for i, row in enumerate(rows) if row in self._biases for t, b in self._biases[row]] \
            if self._biases else []
        grammars = tuple((self._grammars[row], i) for i, row in enumerate(rows) if row in self._grammars) \
            if self._grammars else ()
        batch = SamplingBatch.gather(self.fields, rows, counters, biases, grammars, device)
        self._last = (rows, self.writes, batch)
        return batch

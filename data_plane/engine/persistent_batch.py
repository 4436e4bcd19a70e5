"""What a step reads of its sequences that does not change while they run, kept between steps.

A sequence holding KV blocks owns one row of the block table (``Sequence.kv_row``) from its first blocks
until it ends or is preempted. ``PersistentBatch`` keeps at that row of preallocated host tensors what
its steps read that stays fixed while it holds the row: its adapter slot and its sampling parameters
(``sampler.row_fields``), its logit biases and its grammar matcher. A row is written when a sequence is
first seen on it (or comes back on it with another adapter slot); the rows of sequences that stay are
not written again. A step's sampling inputs are then one gather from these rows
(``SamplingBatch.gather``), and per sequence the host reads only what moves: its progress and, for a
decode, its last token.
"""

from __future__ import annotations

import torch

from data_plane.engine.grammar import GrammarState
from data_plane.engine.sampler import ROW_FIELDS, SamplingBatch, row_fields
from data_plane.engine.sequence import Sequence


class PersistentBatch:
    def __init__(self, max_rows: int) -> None:
        """``max_rows``: the block table's rows (the block manager's ``max_seqs``)."""
        self.fields = torch.zeros(max_rows, ROW_FIELDS, dtype=torch.int64)  # [rows, ROW_FIELDS]
        self._owner: list[Sequence | None] = [None] * max_rows
        self._slot = [-1] * max_rows  # the adapter slot the row was written with
        self._biases: dict[int, tuple[tuple[int, float], ...]] = {}  # row -> its owner's logit biases, if any
        self._grammars: dict[int, GrammarState] = {}  # row -> its owner's matcher, if constrained
        self.writes = 0  # rows written since start-up (a test reads it)

    def hold(self, seq: Sequence) -> int:
        """``seq``'s row, written first if another sequence (or ``seq`` with another adapter slot) had it."""
        row = seq.kv_row
        if self._owner[row] is not seq or self._slot[row] != seq.slot:
            self._write(row, seq)
        return row

    def _write(self, row: int, seq: Sequence) -> None:
        self.fields[row] = torch.tensor(row_fields(seq), dtype=torch.int64)
        self._owner[row], self._slot[row] = seq, seq.slot
        self._biases.pop(row, None)
        self._grammars.pop(row, None)
        if seq.params.logit_bias:
            self._biases[row] = seq.params.logit_bias
        if seq.grammar is not None:
            self._grammars[row] = seq.grammar
        self.writes += 1

    def sampling(self, rows: list[int], counters: list[int], device: torch.device | str) -> SamplingBatch:
        """The sampling batch of a step whose logits rows are the sequences at ``rows`` (held, in logits
        order), each sampling the token at position ``counters[i]``: what ``SamplingBatch.build`` gives for
        those sequences, gathered from the rows instead of read from each sequence."""
        biases = [(i, t, b) for i, row in enumerate(rows) if row in self._biases for t, b in self._biases[row]] \
            if self._biases else []
        grammars = tuple((self._grammars[row], i) for i, row in enumerate(rows) if row in self._grammars) \
            if self._grammars else ()
        return SamplingBatch.gather(self.fields, rows, counters, biases, grammars, device)

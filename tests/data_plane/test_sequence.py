"""A sequence in three parts: its request (immutable: what was asked), its progress and place (written as it
runs), and its timing. The request's fields read through the sequence as the scheduler's modules read them;
setting one there replaces the request whole, and nothing that runs a sequence changes its request."""

from __future__ import annotations

import dataclasses

import pytest

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.progress import Progress, ScheduledSeq
from data_plane.engine.sequence import PENDING, Request, SamplingParams, Sequence, SequenceStatus, Timing


def test_the_request_is_immutable_and_read_through_the_sequence():
    seq = Sequence("r1", "ad", [5, 6, 7], SamplingParams(seed=9, max_tokens=4), 7, arrival=3.0, deadline=8.0,
                   tenant="t", request_salt="s")
    request = seq.request
    assert (seq.request_id, seq.adapter, seq.prompt_ids, seq.max_total, seq.arrival, seq.deadline, seq.tenant,
            seq.request_salt, seq.sampling_seed) == ("r1", "ad", [5, 6, 7], 7, 3.0, 8.0, "t", "s", 9)
    assert seq.params is request.params and isinstance(seq.timing, Timing)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.tenant = "other"
    seq.tenant = "other"  # through the sequence: a new request, the old one as it was
    assert seq.tenant == "other" and seq.request is not request and request.tenant == "t"
    assert dataclasses.replace(request, tenant="other") is not request  # (what the setter does)


def test_a_request_without_a_seed_draws_with_a_random_key_kept_for_its_life():
    a, b = (Sequence(f"r{i}", None, [1], SamplingParams(), 4) for i in range(2))
    assert a.sampling_seed != b.sampling_seed
    key = a.sampling_seed
    a.status = SequenceStatus.RUNNING  # its progress changes; its request, and so its key, do not
    assert a.sampling_seed == key


def test_running_a_sequence_changes_its_progress_and_never_its_request():
    blocks = BlockManager(16, 4, 4, 8)
    seq = Sequence("r", None, [1, 2, 3, 4, 5], SamplingParams(), 16)
    request = seq.request
    progress = Progress(blocks)
    blocks.allocate(seq, 5)
    progress.record([ScheduledSeq(seq, 5)], [PENDING], ran=False)
    progress.settle(seq, 42)
    blocks.allocate(seq, 1)
    progress.record([ScheduledSeq(seq, 1)], [43])
    assert seq.request is request and request.prompt_ids == [1, 2, 3, 4, 5]
    assert (seq.num_computed, seq.output_ids, seq.pending, seq.num_tokens) == (6, [42, 43], 0, 7)
    blocks.free(seq)
    assert seq.request is request


def test_sequences_of_one_request_share_it():
    request = Request.new("r", None, [1, 2], SamplingParams(), 8, arrival=1.0)
    a, b = Sequence.of(request), Sequence.of(request, slot=2)
    assert a.request is b.request and a.arrival == 1.0 and a.output_ids is not b.output_ids and b.slot == 2

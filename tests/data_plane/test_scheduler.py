"""Which requests run in each step and how many of their tokens: running ones first, then waiting
ones in arrival order within the token budget, the sequence limit, the free KV blocks and the
adapter slots; preemption when blocks run out; and the bound on waiting for an adapter slot."""

from __future__ import annotations

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.scheduler import Scheduler, SchedulerLimits
from data_plane.engine.sequence import SamplingParams, Sequence, SequenceStatus
from data_plane.lora.adapter_cache import AdapterCache
from data_plane.lora.peft_adapter import LoraAdapter


def scheduler(max_num_seqs: int = 8, budget: int = 64, num_blocks: int = 64, block_size: int = 4,
              max_loras: int = 2, ready=lambda adapter: True) -> Scheduler:
    """A scheduler over real KV blocks and a real adapter cache holding adapters ``x`` and ``y``."""
    cache = AdapterCache({}, max_loras=max_loras, max_cpu_loras=2)  # no layers: slots hold no weights
    for name in ("x", "y"):
        cache.insert(LoraAdapter(name, name * 64, 8, {}, 0))
    return Scheduler(SchedulerLimits(max_num_seqs, budget), BlockManager(num_blocks, block_size), cache, ready)


def request(s: Scheduler, name: str, prompt: int, adapter: str | None = None, max_tokens: int = 100) -> Sequence:
    seq = Sequence(name, adapter, list(range(prompt)), SamplingParams(max_tokens=max_tokens), prompt + max_tokens)
    s.add(seq)
    return seq


def step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedules one step and applies it as the engine does: the scheduled tokens are computed, a
    sequence whose known tokens are all computed gets a next token, and one at its length limit
    finishes. Returns (request, tokens computed) in batch order."""
    batch = s.schedule()
    for item in batch:
        samples = item.samples
        item.seq.num_computed += item.num_new
        if samples:
            item.seq.output_ids.append(0)
            if item.seq.num_tokens >= item.seq.max_total:
                s.finish(item.seq)
    return [(item.seq.request_id, item.num_new) for item in batch]


def test_waiting_requests_are_admitted_in_arrival_order():
    s = scheduler()
    for name in "abc":
        request(s, name, 3)
    assert step(s) == [("a", 3), ("b", 3), ("c", 3)]


def test_a_prompt_longer_than_the_token_budget_is_prefilled_in_chunks_and_samples_after_the_last():
    s = scheduler(budget=4)
    seq = request(s, "a", 10)
    assert step(s) == [("a", 4)]
    assert step(s) == [("a", 4)]
    assert seq.output_ids == []
    assert step(s) == [("a", 2)]
    assert seq.output_ids == [0]
    assert step(s) == [("a", 1)]  # then one token a step


def test_new_requests_share_the_token_budget_in_arrival_order():
    s = scheduler(budget=4)
    request(s, "a", 3)
    request(s, "b", 3)
    request(s, "c", 3)
    assert step(s) == [("a", 3), ("b", 1)]


def test_running_requests_go_first_and_new_ones_get_what_is_left_of_the_budget():
    s = scheduler(budget=4)
    request(s, "a", 3)
    assert step(s) == [("a", 3)]
    request(s, "b", 6)
    assert step(s) == [("a", 1), ("b", 3)]
    assert step(s) == [("a", 1), ("b", 3)]


def test_no_more_than_max_num_seqs_requests_run_at_once():
    s = scheduler(max_num_seqs=2)
    request(s, "a", 3, max_tokens=1)
    request(s, "b", 3)
    request(s, "c", 3)
    assert step(s) == [("a", 3), ("b", 3)]  # a ends with its one token
    assert step(s) == [("b", 1), ("c", 3)]


def test_a_request_whose_blocks_do_not_fit_waits_and_later_requests_do_not_overtake_it():
    s = scheduler(num_blocks=4, block_size=4)
    request(s, "a", 8, max_tokens=1)  # 2 blocks
    request(s, "big", 12)  # 3 blocks: only 2 are left
    request(s, "small", 2)  # would fit, but arrived later
    assert step(s) == [("a", 8)]
    assert step(s) == [("big", 12), ("small", 2)]  # a finished and gave its blocks back


def test_when_blocks_run_out_the_latest_admitted_request_is_preempted_and_queued_first():
    s = scheduler(num_blocks=6, block_size=4)
    a, b, c = request(s, "a", 8, max_tokens=2), request(s, "b", 8, max_tokens=2), request(s, "c", 8)
    request(s, "d", 4)
    assert step(s) == [("a", 8), ("b", 8), ("c", 8)]  # all 6 blocks held; each now has a 9th token
    assert step(s) == [("a", 1), ("b", 1)]  # their 9th tokens need a block each: c gives up its two
    assert (c.status, c.block_table, c.num_computed, s.num_preemptions) == (SequenceStatus.WAITING, [], 0, 1)
    assert [seq.request_id for seq in s.waiting] == ["c", "d"]
    assert a.is_finished and b.is_finished
    # c is recomputed from its prompt and the token it had generated, before d
    assert step(s) == [("c", 9), ("d", 4)]


def test_a_preempted_request_gives_back_its_adapter_slot():
    s = scheduler(num_blocks=4, block_size=4)
    request(s, "a", 8)
    b = request(s, "b", 8, adapter="x")
    step(s)
    assert s.cache.in_use("x") and b.slot >= 0
    step(s)
    assert b.status is SequenceStatus.WAITING and b.slot == -1 and not s.cache.in_use("x")


def test_a_request_for_an_adapter_still_loading_waits_without_holding_back_others():
    loaded: set[str] = set()
    s = scheduler(ready=lambda adapter: adapter in loaded)
    request(s, "a", 3, adapter="x")
    assert not s.has_work()
    request(s, "b", 3)
    assert step(s) == [("b", 3)]
    loaded.add("x")
    assert step(s) == [("b", 1), ("a", 3)]


def test_a_request_waiting_for_an_adapter_slot_is_not_overtaken_by_later_adapter_requests():
    s = scheduler(max_loras=1)
    first = request(s, "x-first", 3, adapter="x")
    assert step(s) == [("x-first", 3)]  # x holds the only slot
    request(s, "y", 3, adapter="y")  # needs the slot x is using
    request(s, "x-later", 3, adapter="x")  # could share x's slot at once, but y asked first
    request(s, "base", 3)  # needs no slot: runs meanwhile
    assert step(s) == [("x-first", 1), ("base", 3)]
    s.finish(first)
    assert step(s) == [("base", 1), ("y", 3)]
    assert [seq.request_id for seq in s.waiting] == ["x-later"]


def test_finish_frees_blocks_and_slot_and_may_be_called_again():
    s = scheduler()
    running = request(s, "running", 5, adapter="x")
    step(s)
    waiting = request(s, "waiting", 3)
    s.finish(running)
    assert (running.status, running.block_table, running.slot) == (SequenceStatus.FINISHED, [], -1)
    assert not s.cache.in_use("x") and s.blocks.usage == 0.0
    s.finish(running)  # a second end (an abort after the last token, say) changes nothing
    assert running not in s.running and running not in s.waiting
    s.finish(waiting)
    assert waiting.status is SequenceStatus.FINISHED and not s.waiting

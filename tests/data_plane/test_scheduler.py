"""Which requests run in each step and how many of their tokens: running decodes first, then prefill
work (prompts being chunked and waiting requests) by fair share across adapters (arrival order within
one) within the step's prefill budget and token budget, the sequence
limit, the free KV blocks and the adapter slots; preemption when blocks run out; the bound on
waiting for an adapter slot, and the refusal of a request no slot can ever serve; the FCFS
policy; where the plan of the queue lands a new request (for admission by deadline), and expired requests."""

from __future__ import annotations

import time

import pytest

from data_plane.engine.admission import Arrivals
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.floods import FLOOD_MEMORY_S
from data_plane.engine.scheduler import STARTED_QUANTUM, Policy, Scheduler, SchedulerLimits
from data_plane.engine.sequence import SamplingParams, Sequence, SequenceStatus
from data_plane.errors import CapacityExceeded
from data_plane.lora.adapter_cache import AdapterCache
from data_plane.lora.peft_adapter import LoraAdapter


def scheduler(max_num_seqs: int = 8, budget: int = 64, num_blocks: int = 64, block_size: int = 4,
              max_loras: int = 2, ready=lambda adapter: True, adapters: str = "xy", weights=None,
              policy: Policy = Policy.FAIR, prefill_budget=None, join_credit: float = STARTED_QUANTUM,
              step_time=None) -> Scheduler:
    """A scheduler over real KV blocks and a real adapter cache holding one adapter per letter of ``adapters``;
    ``join_credit``: as the pod's (a quantum), or 0 where a test counts shares without it."""
    cache = AdapterCache({}, max_loras=max_loras, max_cpu_loras=max(max_loras, len(adapters)))  # no layers
    for name in adapters:
        cache.insert(LoraAdapter(name, name * 64, 8, (), 0))
    return Scheduler(SchedulerLimits(max_num_seqs, budget), BlockManager(num_blocks, block_size), cache, ready,
                     weights, policy, prefill_budget=prefill_budget, join_credit=join_credit, step_time=step_time)


def request(s: Scheduler, name: str, prompt: int, adapter: str | None = None, max_tokens: int = 100,
            deadline: float | None = None, tenant: str | None = None) -> Sequence:
    seq = Sequence(name, adapter, list(range(prompt)), SamplingParams(max_tokens=max_tokens), prompt + max_tokens,
                   deadline=deadline, tenant=tenant)
    s.add(seq)
    return seq


def step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedules one step and applies it as the engine does: the scheduled tokens are computed, a
    sequence whose known tokens are all computed gets a next token, and one at its length limit
    finishes. Returns (request, tokens computed) in batch order."""
    batch = s.schedule()
    samples = [item.samples for item in batch]
    s.postprocess(batch, [0 if sampled else None for sampled in samples])
    for item, sampled in zip(batch, samples, strict=True):
        if sampled and item.seq.num_tokens >= item.seq.max_total:
            s.finish(item.seq)
    return [(item.seq.request_id, item.num_new) for item in batch]


def admission_order(s: Scheduler, steps: int = 1000) -> list[str]:
    """Steps until nothing is left (or ``steps`` ran); the requests in the order they first ran."""
    order: list[str] = []
    for _ in range(steps):
        if not s.has_work():
            break
        order += [name for name, _ in step(s) if name not in order]
    return order


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


def test_every_running_decode_gets_its_token_and_prefill_gets_only_the_step_budget():
    # the step-time model allows 2 prefill tokens a step beside decodes (and 64 with nothing decoding)
    s = scheduler(budget=64, prefill_budget=lambda decodes, adapters, rush, *_: 2 if decodes else 64)
    for name in "ab":
        request(s, name, 3)
    assert step(s) == [("a", 3), ("b", 3)]  # nothing decodes yet: both prompts whole
    request(s, "c", 5)
    assert step(s) == [("a", 1), ("b", 1), ("c", 2)]  # a and b decode; c's prompt in chunks of two
    assert step(s) == [("a", 1), ("b", 1), ("c", 2)]
    assert step(s) == [("a", 1), ("b", 1), ("c", 1)]


def test_the_budget_is_asked_for_each_prefilling_sequence_with_the_adapters_it_brings():
    asked = []
    s = scheduler(max_loras=3, adapters="xyz",
                  prefill_budget=lambda *question: asked.append(question) or 64)
    request(s, "a", 3, adapter="x", max_tokens=5)
    request(s, "b", 3, adapter="y", max_tokens=5)
    request(s, "c", 3, max_tokens=5)
    step(s)
    # (decodes, their adapters, rush, prefilling sequences, adapters the prefill brings)
    assert asked == [(0, 0, False, 1, 1), (0, 0, False, 2, 2), (0, 0, False, 3, 2)]
    asked.clear()
    step(s)  # three decodes, nothing to prefill: nothing asked
    assert asked == []
    request(s, "d", 3, adapter="x")
    request(s, "e", 3, adapter="z")
    step(s)  # beside the decodes of x, y and the base model: e first (z had less), bringing z; d brings none
    assert asked == [(3, 2, False, 1, 1), (3, 2, False, 2, 1)]


def test_a_further_prefilling_sequence_gets_what_its_own_budget_leaves_after_the_first():
    budgets = {1: 10, 2: 12}  # prefilling sequences -> the step's prompt tokens
    s = scheduler(prefill_budget=lambda decodes, adapters, rush, seqs, new: budgets.get(seqs, 0))
    request(s, "a", 6, adapter="x")
    request(s, "b", 20, adapter="y")
    request(s, "c", 20)
    assert step(s) == [("a", 6), ("b", 6)]  # b fits only what two sequences' budget leaves: 12 - 6
    budgets[2] = 5  # a second sequence's own cost leaves less than the first took: none is added
    assert step(s) == [("a", 1), ("b", 10)]


def one_running(max_num_seqs: int, prompt: int = 3) -> tuple[Scheduler, list[bool], float]:
    """A scheduler with one request running, its first step taken (64 prompt tokens a step, each step
    predicted at 0.1 s), the ``rush`` of every budget it asks for, and the time now."""
    asked: list[bool] = []
    s = scheduler(max_num_seqs=max_num_seqs,
                  prefill_budget=lambda decodes, adapters, rush, *_: asked.append(rush) or 64,
                  step_time=lambda shape: 0.1)
    request(s, "running", prompt, max_tokens=50)
    step(s)
    return s, asked, time.monotonic()


def promised(s: Scheduler, name: str, waited_s: float, promise_s: float, now: float, prompt: int = 3,
             adapter: str | None = None) -> Sequence:
    seq = request(s, name, prompt, adapter)
    seq.arrival, seq.timing.first_token_due = now - waited_s, now - waited_s + promise_s
    return seq


def rushed(s: Scheduler, asked: list[bool]) -> bool:
    """Whether the next step asked for a rushed budget."""
    before = len(asked)
    step(s)
    return any(asked[before:])


def test_a_step_rushes_when_a_request_would_get_its_first_token_late_at_the_unrushed_pace():
    s, asked, now = one_running(max_num_seqs=4)
    # 3 tokens: one step, and one more for the prediction's error: 0.2 s, due in 0.15 s
    late = promised(s, "late", 1.85, 2.0, now)
    assert rushed(s, asked)
    assert late.output_ids  # it ran, and got its first token
    request(s, "plain", 3)
    assert not rushed(s, asked)  # a request with its first token rushes nothing


def test_a_request_on_course_for_its_promise_does_not_rush_the_step_however_long_it_waited():
    s, asked, now = one_running(max_num_seqs=4)
    promised(s, "on-course", 1.7, 2.0, now)  # past 80% of its promise, its first token 0.2 s away
    assert not rushed(s, asked)


def test_a_long_prompt_rushes_the_step_while_a_short_one_that_waited_as_long_does_not():
    s, asked, now = one_running(max_num_seqs=4)
    promised(s, "short", 1.0, 2.0, now, prompt=64)  # 2 steps: 0.2 s of the 1 s left
    assert not rushed(s, asked)
    s, asked, now = one_running(max_num_seqs=4)
    promised(s, "long", 1.0, 2.0, now, prompt=640)  # 11 steps: 1.1 s of the 1 s left
    assert rushed(s, asked)


def test_a_promise_at_risk_is_kept_with_the_tokens_it_needs_not_all_the_knee_allows():
    s = scheduler(budget=1024, num_blocks=256, prefill_budget=lambda decodes, adapters, rush, *_: 512 if rush else 64,
                  step_time=lambda shape: 0.1)
    request(s, "running", 3, max_tokens=50)
    step(s)
    now = time.monotonic()
    # 640 tokens at 64 a step: 11 steps with the margin, 1.1 s, due in 1.09 s: 9 steps then, of 72 tokens
    promised(s, "long", 0.91, 2.0, now, prompt=640)
    assert step(s) == [("running", 1), ("long", 72)]


def test_the_prompts_waiting_ahead_of_a_promised_request_count_in_its_work():
    s, asked, now = one_running(max_num_seqs=4)
    request(s, "first", 600).arrival = now - 2.0  # no promise, ahead of it in the same queue
    promised(s, "behind", 1.0, 2.0, now, prompt=64)  # its own 64 tokens: 0.2 s; with the 600 ahead, 1.2 s
    assert rushed(s, asked)


def test_a_rushed_step_is_held_to_the_knee_s_budget_for_the_sequences_it_prefills():
    # the knee's budget: 100 tokens in one prefilling sequence, 60 in two; unrushed, 16
    s = scheduler(budget=1024, num_blocks=512, step_time=lambda shape: 0.1,
                  prefill_budget=lambda decodes, adapters, rush, seqs, new: (100 if seqs == 1 else 60) if rush else 16)
    now = time.monotonic()
    promised(s, "x-short", 1.9, 2.0, now, prompt=30, adapter="x")
    promised(s, "y-long", 1.89, 2.0, now, prompt=500, adapter="y")
    assert step(s) == [("x-short", 30), ("y-long", 30)]  # 60 in all, not the 100 of one sequence


def test_a_request_that_cannot_run_does_not_rush_the_step():
    s, asked, now = one_running(max_num_seqs=1, prompt=200)
    promised(s, "seatless", 1.95, 2.0, now)  # the only seat is taken by a prompt still being prefilled
    assert not rushed(s, asked)


# ---- floods: streams of accounts the pod turns away yield to prompts of those it does not ----------

def beside_decodes(*decoding: str | None, policy: Policy = Policy.FAIR) -> Scheduler:
    """A scheduler (1024 tokens a step; the knee's budget 100 prompt tokens, 16 unrushed) with one request
    decoding on each of ``decoding``'s adapters."""
    s = scheduler(budget=1024, num_blocks=512, max_loras=3, adapters="xyz", policy=policy,
                  prefill_budget=lambda decodes, adapters, rush, *_: 100 if rush else 16)
    for i, adapter in enumerate(decoding):
        request(s, f"stream{i}", 3, adapter, max_tokens=50)
    step(s)
    return s


def prompt_tokens(s: Scheduler, name: str, adapter: str | None, prompt: int = 300) -> int:
    """The tokens the next step computes of a new ``prompt``-token request of ``adapter``."""
    request(s, name, prompt, adapter)
    return dict(step(s))[name]


def turn_away(s: Scheduler, adapter: str | None, tenant: str | None = None) -> None:
    """The account has a request waiting (3 prompt tokens) when the pod turns another of its requests away."""
    request(s, f"{adapter}-{tenant}-waiting", 3, adapter, tenant=tenant)
    s.turned_away(adapter, tenant)


def test_streams_of_a_flooding_account_yield_to_a_prompt_of_one_that_is_not():
    s = beside_decodes("x", "x")
    assert prompt_tokens(s, "y0", "y") == 16  # nobody was turned away: the streams keep their pace
    s = beside_decodes("x", "x")
    turn_away(s, "x")
    assert prompt_tokens(s, "y0", "y") == 300  # all of it, as on an idle pod (not only the knee's 100)
    s = beside_decodes("x", "y")
    turn_away(s, "x")
    assert prompt_tokens(s, "y0", "y") == 300  # the prompt's own account's stream yields to it too


def test_an_account_turned_away_with_nothing_waiting_here_does_not_flood():
    s = beside_decodes("x", "x")
    s.turned_away("x")  # its two requests run, none waits: a full pod turned away one more
    assert s.flooding(time.monotonic()) == set()
    assert prompt_tokens(s, "y0", "y") == 16


def test_streams_of_an_account_that_keeps_within_the_pod_s_room_keep_their_pace():
    s = beside_decodes("x", None)  # the base model's stream was never turned away
    turn_away(s, "x")
    assert prompt_tokens(s, "y0", "y") == 16
    s = beside_decodes("y")  # only the prompt's own account decodes
    turn_away(s, "x")
    assert prompt_tokens(s, "y0", "y") == 16 - 3  # at the pace, after x's waiting request (served less) took 3


def test_a_prompt_of_a_flooding_account_does_not_rush_beside_a_flood():
    s = beside_decodes("x", "y")
    turn_away(s, "x"), turn_away(s, "y")
    assert prompt_tokens(s, "y0", "y") == 16 - 3 - 3  # at the pace, after x's and y's waiting requests
    s = beside_decodes("x")
    request(s, "x0", 300, "x")  # waiting when the next x request is turned away
    s.turned_away("x")
    assert dict(step(s))["x0"] == 16


def test_a_yielded_prompt_takes_no_more_than_the_free_kv_blocks_hold():
    s = scheduler(budget=1024, num_blocks=40, block_size=4, prefill_budget=lambda decodes, adapters, rush, *_: 16)
    request(s, "stream", 3, "x", max_tokens=50)
    step(s)  # one block of 4 for the stream's 3 tokens and its next
    turn_away(s, "x")
    assert prompt_tokens(s, "y0", "y", prompt=300) == (40 - 1) * 4  # the blocks the stream does not hold, not 300
    assert s.num_preemptions == 0


def test_tenants_not_adapters_flood_and_yield():
    def acme_streaming() -> Scheduler:
        s = beside_decodes()
        for adapter in "xy":  # one tenant's streams on two adapters
            request(s, f"acme-{adapter}", 3, adapter, max_tokens=50, tenant="acme")
        step(s)
        turn_away(s, "x", "acme")  # refused on one of them
        return s

    assert prompt_tokens(acme_streaming(), "z0", "z") == 300  # both streams are of the flooding account
    s = acme_streaming()
    request(s, "acme-z", 300, "z", tenant="acme")  # on an adapter it was not refused on: still its account
    assert dict(step(s))["acme-z"] == 16 - 3  # at the pace, after its waiting request on x


def test_a_flood_is_forgotten_after_flood_memory_s(monkeypatch):
    s = beside_decodes("x")
    turn_away(s, "x")
    later = time.monotonic() + FLOOD_MEMORY_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert prompt_tokens(s, "y0", "y") == 16
    assert s.flooding(later) == set()


def test_under_fcfs_streams_keep_their_pace_beside_a_flood():
    s = beside_decodes("x", policy=Policy.FCFS)
    turn_away(s, "x")
    assert prompt_tokens(s, "y0", "y") == 16 - 3  # at the pace, after x's waiting request (older)


def test_a_started_prompt_with_a_cached_prefix_counts_only_what_it_computes_against_its_quantum():
    s = scheduler(num_blocks=256, prefill_budget=lambda decodes, adapters, rush, *_: 16)
    cached = request(s, "cached", 200, adapter="x")
    step(s)
    # as if its first 150 tokens had been found in the prefix cache at admission: computed, never charged
    cached.started_at_computed = 150
    cached.num_computed += 150 - 16
    request(s, "quiet", 4, adapter="y")
    assert s.order.key(cached)[0] == pytest.approx(cached.started_at_standing)  # 16 computed, within the quantum
    assert step(s)[0] == ("cached", 16)


def test_a_started_prompt_stays_no_more_than_a_quantum_behind_its_tenants_counter():
    s = scheduler(num_blocks=256, prefill_budget=lambda decodes, adapters, rush, *_: 16)
    long = request(s, "long", 400, adapter="x")
    step(s)
    s.shares.charge("x", 1000)  # the tenant's decodes and other prompts moved its counter on
    assert s.order.key(long)[0] == pytest.approx(s.shares.served("x") - STARTED_QUANTUM)


def flood_started_then_quiet(quiet_busy: bool) -> Scheduler:
    """x decodes one request and queues three 12-token prompts, the first of which starts (4 tokens a
    step); then y queues a 4-token request, while a request of y decodes too (``quiet_busy``) or not."""
    s = scheduler(prefill_budget=lambda decodes, adapters, rush, *_: 4)
    if quiet_busy:
        request(s, "y-running", 1, adapter="y")
    request(s, "x-running", 1, adapter="x")
    step(s)
    for i in range(3):
        request(s, f"flood{i}", 12, adapter="x")  # x is busy: ordinary arrivals
    step(s)  # the flood's first prompt starts: 4 of its 12 tokens
    request(s, "quiet", 4, adapter="y")
    return s


def prefill_of(batch: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(name, n) for name, n in batch if not name.endswith("-running")]


def test_a_started_prompt_is_finished_before_a_busy_tenant_served_as_much_starts_another():
    s = flood_started_then_quiet(quiet_busy=True)
    # y, already running a request, stands at its counter, level with the flood's: the flood's started
    # prompt keeps its standing from when it started and is finished first; then the quiet one, which
    # has had less, goes before the flood's next prompt
    assert prefill_of(step(s)) == [("flood0", 4)]
    assert prefill_of(step(s)) == [("flood0", 4)]
    assert prefill_of(step(s)) == [("flood0", 1), ("quiet", 4)]
    assert prefill_of(step(s)) == [("flood0", 1), ("quiet", 1), ("flood1", 4)]


def test_a_request_of_a_tenant_with_nothing_in_flight_goes_before_a_flood_s_started_prompt():
    s = flood_started_then_quiet(quiet_busy=False)
    # y had nothing queued or running: it joins a quantum below the least-served active tenant (x), ahead
    # of the flood's prompt, started at x's counter
    assert prefill_of(step(s)) == [("quiet", 4)]
    assert prefill_of(step(s)) == [("quiet", 1), ("flood0", 4)]


def test_a_new_tenant_s_prompt_is_not_stuck_behind_more_than_a_quantum_of_a_flood_s_long_prompt():
    s = scheduler(budget=1024, num_blocks=256, prefill_budget=lambda decodes, adapters, rush, *_: 64)
    request(s, "long", STARTED_QUANTUM + 256, adapter="x")
    step(s)  # 64 of its tokens
    # each tenant joined a quantum below the floor (0): x at -128, where the long prompt started, and y at
    # -128 too; through its first quantum (128 computed) the long one keeps that standing, level with the
    # quiet one (the older goes first)
    request(s, "quiet", 4, adapter="y")
    assert step(s) == [("long", 64)]
    assert step(s) == [("long", 64)]
    # past the quantum it stands behind by what it computed beyond it (64 at 192): the quiet one goes first
    assert step(s) == [("quiet", 4), ("long", 60)]


def test_under_fcfs_prompts_being_chunked_keep_going_before_newer_ones():
    s = scheduler(policy=Policy.FCFS, prefill_budget=lambda decodes, adapters, rush, *_: 4)
    request(s, "old", 12, adapter="x")
    step(s)
    request(s, "new", 4, adapter="y")
    assert step(s) == [("old", 4)]
    assert step(s) == [("old", 4)]
    assert step(s) == [("old", 1), ("new", 4)]


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


# ---- fair shares across adapters ----------------------------------------------------------------

def test_a_flooding_adapter_does_not_starve_another_that_asks_later():
    s = scheduler(max_num_seqs=2)
    for i in range(20):
        request(s, f"x{i}", 8, adapter="x")
    request(s, "y", 8, adapter="y")
    assert step(s) == [("x0", 8), ("y", 8)]  # in arrival order y would wait for all twenty


def test_a_waiting_adapter_goes_before_one_that_has_had_more_tokens():
    s = scheduler(max_num_seqs=2)
    request(s, "x-long", 4, adapter="x", max_tokens=30)
    step(s)
    for _ in range(10):
        step(s)  # x-long decodes: x has had 14 tokens
    request(s, "x-next", 4, adapter="x")
    request(s, "base", 4)  # arrived later, but the base model has had nothing
    assert step(s) == [("x-long", 1), ("base", 4)]


def test_requests_of_one_adapter_run_in_arrival_order_between_the_others():
    s = scheduler(max_num_seqs=1)
    for i in range(3):
        request(s, f"x{i}", 4, adapter="x", max_tokens=2)
        request(s, f"y{i}", 4, adapter="y", max_tokens=2)
    request(s, "base", 4, max_tokens=2)
    assert admission_order(s) == ["x0", "y0", "base", "x1", "y1", "x2", "y2"]


def test_weights_shift_the_shares():
    s = scheduler(max_num_seqs=1, weights={"x": 3.0}, join_credit=0)  # the shares alone, without a head start
    for i in range(12):
        request(s, f"x{i}", 4, adapter="x", max_tokens=2)
    for i in range(4):
        request(s, f"y{i}", 4, adapter="y", max_tokens=2)
    first = admission_order(s)[:12]
    assert (sum(n.startswith("x") for n in first), sum(n.startswith("y") for n in first)) == (9, 3)


def test_an_adapter_back_from_idling_gets_a_quantum_s_head_start_not_a_catch_up_for_the_idle_time():
    s = scheduler(max_num_seqs=1)
    request(s, "y-early", 4, adapter="y", max_tokens=2)
    admission_order(s)
    for i in range(90):
        request(s, f"x{i}", 4, adapter="x", max_tokens=2)  # 5 tokens computed each
    assert admission_order(s, steps=120) == [f"x{i}" for i in range(60)]  # x has had 60 times y's tokens
    for i in range(40):
        request(s, f"y{i}", 4, adapter="y", max_tokens=2)
    # y joins a quantum (128 tokens) below x's counter: its first 26 requests (130 tokens) go first, then
    # turns, not the 300 tokens x was served while y was idle
    order = admission_order(s)
    assert order[:26] == [f"y{i}" for i in range(26)]
    assert order[26:32] == ["x60", "y26", "x61", "y27", "x62", "y28"]


def test_when_blocks_run_out_the_most_served_adapter_gives_back_its_latest_request():
    s = scheduler(num_blocks=6, block_size=4)
    x1, x2 = request(s, "x1", 8, adapter="x"), request(s, "x2", 4, adapter="x", max_tokens=2)
    y = request(s, "y", 8, adapter="y")
    assert step(s) == [("x1", 8), ("y", 8), ("x2", 4)]  # all 6 blocks held; x has had 12 tokens, y 8
    assert step(s) == [("x1", 1), ("y", 1)]  # x1's and y's 9th tokens need a block each: x2, not y, gives back
    assert x2.status is SequenceStatus.WAITING and y.status is SequenceStatus.RUNNING
    assert s.num_preemptions == 1 and x1.status is SequenceStatus.RUNNING


# ---- adapter slots ------------------------------------------------------------------------------

def test_a_request_that_cannot_get_a_slot_does_not_hold_back_the_base_model_or_adapters_in_slots():
    s = scheduler(max_loras=2, adapters="xyz")
    s.cache.pin("z")
    request(s, "x-first", 3, adapter="x")
    step(s)  # x holds the other slot
    request(s, "y", 3, adapter="y")  # no slot until x's requests finish
    request(s, "z", 3, adapter="z")  # z's slot is pinned: it runs at once
    request(s, "base", 3)
    assert step(s) == [("x-first", 1), ("z", 3), ("base", 3)]
    assert [seq.request_id for seq in s.waiting] == ["y"]


def test_a_request_waiting_for_a_slot_holds_back_only_the_adapter_with_fewest_running_requests():
    s = scheduler(max_loras=2, adapters="xyz")
    request(s, "x1", 3, adapter="x")
    request(s, "x2", 3, adapter="x")
    z_first = request(s, "z-first", 3, adapter="z")
    step(s)  # x and z hold both slots
    request(s, "y", 3, adapter="y")
    request(s, "x-later", 3, adapter="x")  # x keeps being served
    request(s, "z-later", 3, adapter="z")  # z, with one request running, drains so that y gets its slot
    assert step(s) == [("x1", 1), ("z-first", 1), ("x2", 1), ("x-later", 3)]
    s.finish(z_first)
    assert step(s) == [("x1", 1), ("x2", 1), ("x-later", 1), ("y", 3)]
    assert [seq.request_id for seq in s.waiting] == ["z-later"]


def test_with_every_slot_pinned_a_request_for_another_adapter_is_refused_at_once():
    s = scheduler(max_loras=1)
    s.cache.pin("x")
    with pytest.raises(CapacityExceeded) as e:
        request(s, "y", 3, adapter="y")
    assert e.value.status == "RESOURCE_EXHAUSTED"
    assert "'y'" in str(e.value) and "pinned" in str(e.value) and "--max-loras" in str(e.value)
    assert not s.waiting
    request(s, "x", 3, adapter="x")
    request(s, "base", 3)
    assert step(s) == [("x", 3), ("base", 3)]


def test_a_waiting_request_is_refused_once_pins_fill_every_slot():
    loaded = {"x", "z"}
    s = scheduler(max_loras=2, adapters="xyz", ready=lambda adapter: adapter in loaded)
    y = request(s, "y", 3, adapter="y")  # waits for its adapter to load
    assert s.refused() == []
    s.cache.pin("x")
    s.cache.pin("z")
    [(seq, error)] = s.refused()
    assert seq is y and isinstance(error, CapacityExceeded) and "unpin" in str(error)
    s.cache.unpin("z")
    assert s.refused() == []


# ---- seats --------------------------------------------------------------------------------------

def test_when_seats_are_full_a_tenant_without_one_takes_the_latest_of_the_tenant_holding_most():
    s = scheduler(max_num_seqs=2)
    request(s, "x0", 4, adapter="x"), request(s, "x1", 4, adapter="x")
    step(s)
    request(s, "x2", 4, adapter="x")
    y = request(s, "y", 4, adapter="y")
    assert step(s) == [("x0", 1), ("y", 4)]  # x1 gives its seat to y's first request at once
    assert y.status is SequenceStatus.RUNNING and s.num_preemptions == 1
    assert [seq.request_id for seq in s.waiting] == ["x1", "x2"]  # x1 first again among x's


def test_tenants_that_each_hold_a_seat_do_not_trade_them():
    s = scheduler(max_num_seqs=2)
    for i in range(4):
        request(s, f"x{i}", 4, adapter="x", max_tokens=6), request(s, f"y{i}", 4, adapter="y", max_tokens=6)
    admission_order(s)
    assert s.num_preemptions == 0


def test_no_seat_is_taken_for_a_request_queued_behind_the_one_that_would_give_it_up():
    # x's two requests hold both seats; the next request on x is another tenant's, with no seat: x's latest,
    # queued again first of x, would take its own seat back in the very step that took it (its progress not
    # yet reset), so no seat changes hands: the tenant waits in x's order
    s = scheduler(max_num_seqs=2)
    request(s, "x0", 4, adapter="x"), request(s, "x1", 4, adapter="x")
    step(s)
    request(s, "t0", 4, adapter="x", tenant="t")
    assert step(s) == [("x0", 1), ("x1", 1)] and s.num_preemptions == 0


@pytest.mark.parametrize(("policy", "holders"), [(Policy.FAIR, "xy"), (Policy.FCFS, "xx")])
def test_a_tenant_without_a_seat_waits_for_one_when_no_tenant_holds_two_or_under_fcfs(policy, holders):
    s = scheduler(max_num_seqs=2, max_loras=3, adapters="xyz", policy=policy)
    for i, adapter in enumerate(holders):
        request(s, f"{adapter}{i}", 4, adapter=adapter)
    step(s)
    request(s, "z", 4, adapter="z")
    assert step(s) == [(f"{holders[0]}0", 1), (f"{holders[1]}1", 1)] and s.num_preemptions == 0


# ---- first come, first served ---------------------------------------------------------------------

def test_under_fcfs_a_flooding_adapter_goes_first_in_arrival_order():
    s = scheduler(max_num_seqs=1, policy=Policy.FCFS)
    for i in range(3):
        request(s, f"x{i}", 4, adapter="x", max_tokens=2)
    request(s, "y", 4, adapter="y", max_tokens=2)
    request(s, "base", 4, max_tokens=2)
    assert admission_order(s) == ["x0", "x1", "x2", "y", "base"]


def test_under_fcfs_the_latest_admitted_request_gives_back_its_blocks():
    s = scheduler(num_blocks=6, block_size=4, policy=Policy.FCFS)
    request(s, "x1", 8, adapter="x"), request(s, "y", 8, adapter="y")
    late = request(s, "x2", 4, adapter="x", max_tokens=2)
    assert step(s) == [("x1", 8), ("y", 8), ("x2", 4)]
    assert step(s) == [("x1", 1), ("y", 1)]
    assert late.status is SequenceStatus.WAITING and s.num_preemptions == 1


# ---- where the plan of the queue lands a new request ---------------------------------------------

def flooded(policy: Policy = Policy.FAIR, weights=None, y_before: tuple[float, ...] = (),
            step_s: float = 0.0) -> Scheduler:
    """x was served a 4-token prompt; then ten 5-token x requests and a 7-token y request (y0) wait, each
    ending at its first token; steps of 8 tokens, seats to spare, no join credit (the shares alone).
    ``y_before``: how long ago y sent each of its earlier 6-token prompts; ``step_s``: each step's seconds
    (0: no time passes in the plan, so no later arrival comes)."""
    s = scheduler(max_num_seqs=16, budget=8, num_blocks=256, policy=policy, weights=weights, join_credit=0,
                  step_time=lambda shape: step_s)
    now = time.monotonic()
    for ago in y_before:
        s.arrivals.record("y", 6, now - ago)
    request(s, "running", 4, adapter="x", max_tokens=1)
    step(s)
    for i in range(10):
        request(s, f"x{i}", 5, adapter="x", max_tokens=1)
    request(s, "y0", 7, adapter="y", max_tokens=1)
    return s


def lands(s: Scheduler, flow: str | None, prompt: int, tenant: str | None = None) -> tuple[int, dict]:
    """Where the plan of ``s``'s queue lands a new request (``QueuePlan.landing``): the step that gives it
    its first token, and the prompt tokens of others, per flow, computed in the steps up to it."""
    landing = s.plan().landing(flow, tenant, prompt)
    assert landing.followed
    return landing.steps, dict(landing.by_flow)


def no_arrivals(s: Scheduler) -> Scheduler:
    s.arrivals.coming = lambda *_, **__: iter(())  # the plan expects no later arrival
    return s


def test_under_fair_share_a_quiet_adapter_is_prefilled_beside_a_flood_and_the_flood_behind_itself():
    s = flooded()  # x was served 4 tokens (the first request's prompt); y joined at that counter
    # x and y take turns by their counters, 8 tokens a step: a new y request's first token comes in the
    # third step, after y0 and two of x's prompts, not behind all ten
    assert lands(s, "y", 7) == (3, {"x": 10, "y": 7})
    # a new x request comes after all of x's own and all of y0
    assert lands(s, "x", 5) == (8, {"x": 50, "y": 7})
    # the base model, served nothing yet, joins at the floor and goes alongside: its first token in the
    # third step, beside y0 and three of x's prompts (the last in part, in its own step)
    assert lands(s, None, 5) == (3, {"x": 12, "y": 7})


def test_a_new_request_of_a_tenant_without_a_seat_takes_one_at_once_and_one_with_a_seat_does_not():
    def x_holds_both_seats(policy: Policy = Policy.FAIR) -> Scheduler:
        s = scheduler(max_num_seqs=2, max_loras=3, adapters="xyz", policy=policy)
        request(s, "x0", 4, adapter="x"), request(s, "x1", 4, adapter="x")
        step(s)
        return s

    s = x_holds_both_seats()
    # a y or base-model request takes one of x's seats at the next step: its first token then
    assert s.plan().landing("y", None, 4).steps == s.plan().landing(None, None, 4).steps == 1
    assert s.plan().landing("x", None, 4).steps > 1  # x's own waits for one of its requests to end
    request(s, "y0", 4, adapter="y")
    assert s.plan().landing("y", None, 4).steps > 1  # y0 takes the seat; the next y request waits behind it
    assert x_holds_both_seats(Policy.FCFS).plan().landing("y", None, 4).steps > 1  # no seat changes hands


def test_requests_of_other_adapters_expected_while_one_waits_take_their_share_before_it():
    def busy_y() -> Scheduler:  # y sent four 6-token prompts over the last 8 s, then y0; steps of 0.5 s
        return flooded(y_before=(8.0, 6.0, 4.0, 2.0), step_s=0.5)

    s, unexpected = busy_y(), no_arrivals(busy_y())
    assert lands(unexpected, "x", 5) == (8, {"x": 50, "y": 7})
    # waiting 5 s, an x request expects y's 5 requests in the last 10 s to go on at that rate: 2 more y
    # requests of y's mean prompt ((4 × 6 + 7) / 5, rounded: 6) are served before its own is done
    assert lands(s, "x", 5) == (10, {"x": 50, "y": 7 + 2 * 6})
    # but no more than their share: x's requests expected meanwhile queue behind x's own, and a y request
    # lands where it would without them
    assert s.plan().landing("y", None, 7) == unexpected.plan().landing("y", None, 7)
    # first come, first served: nobody arriving later goes first (a later y prompt may share its last step)
    fcfs = flooded(Policy.FCFS, y_before=(8.0, 6.0, 4.0, 2.0), step_s=0.5)
    fcfs_unexpected = no_arrivals(flooded(Policy.FCFS, y_before=(8.0, 6.0, 4.0, 2.0), step_s=0.5))
    assert fcfs.plan().landing("x", None, 5).seconds == fcfs_unexpected.plan().landing("x", None, 5).seconds


def test_arrivals_forget_what_is_older_than_their_window_and_rate_over_the_whole_window():
    arrivals = Arrivals(window_s=10.0)
    arrivals.record("x", 100, 0.0)
    arrivals.record("x", 300, 5.0)
    # 2 in the window: 2 per 10 s, each of their mean prompt
    assert [prompt for _, _, _, prompt, _ in arrivals.coming(10.0, 5.0)] == [200, 200]
    assert list(arrivals.coming(0.0, 5.0)) == []
    assert list(arrivals.coming(5.0, 5.0, besides="x")) == []  # no other flow sent any
    assert [prompt for _, _, _, prompt, _ in arrivals.coming(10.0, 12.0)] == [300]  # the first left the window
    assert list(arrivals.coming(100.0, 15.5)) == []
    for _ in range(30):  # a burst of 30 at once counts as 30 per window, not as a rate over an instant
        arrivals.record("z", 10, 20.0)
    assert len(list(arrivals.coming(1.0, 20.0))) == 3


def test_under_fcfs_every_waiting_request_is_ahead():
    s = flooded(Policy.FCFS)
    assert lands(s, "y", 7) == lands(s, None, 1) == (8, {"x": 50, "y": 7})


def test_weights_scale_the_share_another_adapter_is_served_alongside():
    # x's weight is 3: its counter grows a third as fast, so 26 of x's tokens go alongside before a new y
    # request's first token (in the fifth step), against 10 at equal weights
    assert lands(flooded(weights={"x": 3.0}), "y", 7) == (5, {"x": 26, "y": 7})


def test_the_load_lists_the_running_decodes_and_their_adapters():
    s = scheduler(budget=8)
    request(s, "long", 12, adapter="x", max_tokens=10)
    request(s, "short", 4, max_tokens=3)
    step(s)  # long: 8 of its 12 prompt tokens; short not admitted (budget)
    step(s)  # long's last 4, short's 4
    load = s.load()
    assert load.running_decodes == 2
    assert load.decode_adapters == {"x"} and load.adapters == 1  # the base model's decodes bring none
    request(s, "prompt", 40, adapter="y")
    step(s)  # y's prompt is being prefilled, 8 tokens a step: its adapter is not yet among the decodes
    assert s.load().decode_adapters == {"x"} and s.load().running_decodes == 2


def test_prompts_being_chunked_count_as_prefill_work_ahead_but_hold_their_seats():
    s = scheduler(max_num_seqs=2, prefill_budget=lambda decodes, adapters, rush, *_: 4, join_credit=0)  # shares alone
    request(s, "flood", 12, adapter="x")
    step(s)  # 8 of its tokens still to compute; it holds one of the two seats
    # a new request takes the other seat and comes after the flood's 8: a started prompt keeps its
    # standing for a quantum (fair_order.py), whatever the new request's flow and size
    assert lands(s, "x", 4) == (3, {"x": 8})
    assert lands(s, None, 8) == (4, {"x": 8})
    assert lands(s, None, 3) == (3, {"x": 8})
    request(s, "flood2", 6, adapter="x")
    # flood2 takes the second seat: a new x request comes after both prompts and waits for a seat, until one
    # of them has decoded its 100 tokens (past the steps a plan follows)
    landing = s.plan().landing("x", None, 4)
    assert landing.by_flow == {"x": 8 + 6} and not landing.followed


def test_waiting_requests_past_their_deadline_are_expired_and_running_ones_are_not():
    s = scheduler(max_num_seqs=1)
    running = request(s, "running", 4, deadline=5.0)
    step(s)
    late = request(s, "late", 4, deadline=10.0)
    request(s, "later", 4, deadline=20.0)
    request(s, "none", 4)
    assert s.expired(now=9.0) == []
    assert s.expired(now=10.0) == [late]
    assert running not in s.expired(now=30.0) and len(s.expired(now=30.0)) == 2


def test_a_preempted_request_s_progress_is_reset_by_the_step_s_postprocess_not_by_the_preemption():
    s = scheduler(num_blocks=6, block_size=4)
    request(s, "a", 8, max_tokens=2), request(s, "b", 8, max_tokens=2)
    c = request(s, "c", 8)
    step(s)
    batch = s.schedule()  # a's and b's 9th tokens need a block each: c gives up its two
    assert (c.status, c.block_table, c.num_computed) == (SequenceStatus.WAITING, [], 8)  # progress untouched
    assert c not in {item.seq for item in batch}  # not taken again in the step that preempted it
    s.postprocess(batch, [0] * len(batch))
    assert c.num_computed == 0  # recomputed from its first token

"""The plan of the queue: the scheduler's own rules followed step by step on a copy of its state, so a new
request's planned first token is the one the scheduler gives it when nothing arrives after it; later
arrivals planned at the quantile of their number, taking the turns the rules give them."""

from __future__ import annotations

import random
import time

import pytest

from data_plane.engine.admission import Arrivals
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.fair_order import Policy
from data_plane.engine.progress import step_shape
from data_plane.engine.scheduler import Scheduler, SchedulerLimits
from data_plane.engine.sequence import SamplingParams, Sequence, Timing
from data_plane.engine.step_cost import StepCost, StepShape
from data_plane.lora.adapter_cache import AdapterCache
from data_plane.lora.peft_adapter import LoraAdapter

FLOWS = (None, "a", "b", "c")


def device_s(shape: StepShape) -> float:
    return 0.02 + 0.0015 * shape.decode_rows + 0.0006 * shape.prefill_tokens + 0.004 * shape.prefill_seqs + \
        0.003 * shape.adapters


def costs() -> StepCost:
    """A step-time model fitted to ``device_s`` (so its predictions are exact), steps held to 1.4x their decodes."""
    model = StepCost(max_batched_tokens=256)
    for shape in (StepShape(1), StepShape(8), StepShape(16, adapters=2), StepShape(0, 100, 1), StepShape(0, 50, 1),
                  StepShape(0, 100, 2), StepShape(4, 32, 1, 1), StepShape(8, 64, 2, 3)):
        model.observe_prior(shape, device_s(shape))
    return model


def scheduler(model: StepCost, max_num_seqs: int, policy: Policy = Policy.FAIR) -> Scheduler:
    cache = AdapterCache({}, max_loras=3, max_cpu_loras=3)
    for name in FLOWS[1:]:
        cache.insert(LoraAdapter(name, name * 64, 8, (), 0))
    return Scheduler(SchedulerLimits(max_num_seqs, 256), BlockManager(4096, 16), cache, lambda adapter: True,
                     policy=policy, prefill_budget=model.prefill_budget, step_time=model.predict)


@pytest.mark.parametrize(("policy", "max_num_seqs", "seed"),
                         [(Policy.FAIR, 6, 1), (Policy.FAIR, 3, 2), (Policy.FAIR, 16, 3), (Policy.FCFS, 4, 4)])
def test_a_request_nothing_arrives_after_gets_its_first_token_when_the_plan_lands_it(monkeypatch, policy,
                                                                                     max_num_seqs, seed):
    # a virtual clock, each step lasting what the model predicts; tenants, adapters, seats traded, promises
    # (rushes) and turned-away accounts (floods) as they come; no arrivals are planned, so a request that no
    # later one reaches before its first token must get it exactly when its plan says
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    model = costs()
    s = scheduler(model, max_num_seqs, policy)
    s.arrivals.coming = lambda *_, **__: iter(())  # no arrival is planned
    rnd = random.Random(seed)
    planned: dict[Sequence, float] = {}
    first: dict[Sequence, float] = {}
    admitted: list[Sequence] = []
    arrival = now[0]
    while now[0] < 130.0 or s.running or s.waiting:
        while now[0] < 130.0 and arrival <= now[0]:
            flow, tenant = rnd.choice(FLOWS), rnd.choice((None, None, "acme", "zeta"))
            prompt = rnd.randint(4, 160)
            if rnd.random() < 0.1:
                s.turned_away(flow, tenant)  # a flood, if its account has a request waiting
            due = now[0] + rnd.choice((0.3, 1.5, 5.0))
            landing = s.plan().landing(flow, tenant, prompt, due=due)
            seq = Sequence(f"r{len(admitted)}", flow, list(range(prompt)), SamplingParams(max_tokens=24),
                           prompt + rnd.randint(1, 24), arrival=now[0], tenant=tenant,
                           timing=Timing(first_token_due=due))
            s.add(seq)
            admitted.append(seq)
            if landing.followed:  # not past the steps a plan follows one by one
                planned[seq] = now[0] + landing.seconds
            arrival += rnd.expovariate(4.0)
        if not (s.running or s.waiting):
            now[0] = arrival
            continue
        batch = s.schedule()
        now[0] += device_s(step_shape(batch))
        sampled = [item.samples for item in batch]
        s.postprocess(batch, [0 if sample else None for sample in sampled])
        for item, sample in zip(batch, sampled, strict=True):
            if sample:
                first.setdefault(item.seq, now[0])
                if item.seq.num_tokens >= item.seq.max_total:
                    s.finish(item.seq)
    alone = [seq for i, seq in enumerate(admitted) if seq in planned
             and all(later.arrival >= first[seq] for later in admitted[i + 1:])]
    assert len(alone) > 20 and s.num_preemptions >= (policy is Policy.FAIR and max_num_seqs < 6)
    assert [first[seq] for seq in alone] == pytest.approx([planned[seq] for seq in alone], abs=1e-9)


def test_later_arrivals_of_other_flows_are_planned_to_take_the_turns_the_rules_give_them(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    model = costs()
    s = scheduler(model, 16)
    # b and another account stream (their decodes keep the steps at their pace); c has sent a 60-token
    # prompt every half second, none of which waits now
    for name, flow in (("stream-a", "a"), ("stream-b", "b")):
        s.add(Sequence(name, flow, list(range(4)), SamplingParams(max_tokens=200), 204, arrival=now[0]))
    s.postprocess(s.schedule(), [0, 0])
    quiet, quiet_c = s.plan().landing("b", None, 100), s.plan().landing("c", None, 100)
    for i in range(20):
        s.arrivals.record("c", 60, now[0] - 9.75 + 0.5 * i, 16)
    busy = s.plan().landing("b", None, 100)
    # c, with nothing in flight, joins a quantum below the least-served account: its next requests go before
    # b's new one, whose account is busy
    assert busy.seconds > quiet.seconds and busy.ahead > quiet.ahead == 0
    # a request's own flow's later requests queue behind it: not planned
    assert s.plan().landing("c", None, 100) == quiet_c


def test_arrivals_are_planned_at_the_quantile_of_their_number_the_flows_in_turn():
    arrivals = Arrivals(window_s=10.0)
    for i in range(6):
        arrivals.record("x", 100, float(i), 10, tenant="acme")
    for i in range(3):
        arrivals.record("y", 40 + 20 * i, float(i), 30)
    arrivals.record("z", 5, 0.0)
    coming = list(arrivals.coming(5.0, 9.0, besides="z"))  # x and y: 9 requests a window, one per 1.11 s
    # the (k+1)-th where the 0.6-quantile of a Poisson count first exceeds k: at a mean of 0.511, 1.376,
    # 2.285, 3.211, 4.148 arrivals, each a little before the mean comes to k + 1
    assert [at for at, *_ in coming] == pytest.approx([m * 10 / 9 for m in (0.511, 1.376, 2.285, 3.211, 4.148)],
                                                      abs=1e-3)
    # x twice as often as y, each of its flow's mean sizes and latest tenant
    assert [flow for _, flow, *_ in coming] == ["x", "y", "x", "x", "y"]
    assert coming[0][1:] == ("x", "acme", 100, 10) and coming[1][1:] == ("y", None, 60, 30)
    assert list(arrivals.coming(5.0, 30.0)) == []  # all of them out of the window

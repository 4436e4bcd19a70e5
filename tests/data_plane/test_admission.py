"""The estimate of how long a new request waits for its first token: the step in flight, then the steps of
the plan of the queue up to the one that ends its prompt (each timed by the step-time model: the work
ahead and its own in steps of the prefill budget, waiting for a seat when the running requests fill
them), corrected by how late recent first tokens came; and whether to refuse it."""

from __future__ import annotations

import math

import pytest

from data_plane.engine.admission import DelayEstimator, Load, lateness, retry_after
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.fair_order import Policy
from data_plane.engine.queue_plan import Landing
from data_plane.engine.scheduler import Scheduler, SchedulerLimits
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.engine.step_cost import StepCost, StepShape
from data_plane.lora.adapter_cache import AdapterCache
from data_plane.lora.peft_adapter import LoraAdapter

IDLE = Load(running_decodes=0)
ONE_STEP = Landing(0.13, 1)  # where the plan lands a 30-token prompt on an idle pod (one step of 30 tokens)


def device_costs() -> StepCost:
    """A device where every step costs 100 ms plus 1 ms per prefill token, and nothing else costs; a step
    holds at most 100 tokens. With a 140 ms step target, a step beside decodes may prefill 40 tokens."""
    costs = StepCost(target_itl_s=0.14, max_batched_tokens=100)
    for shape, s in ((StepShape(1), 0.1), (StepShape(2), 0.1), (StepShape(1, adapters=1), 0.1),
                     (StepShape(0, 100, 1), 0.2), (StepShape(0, 50, 1), 0.15), (StepShape(0, 100, 2), 0.2)):
        costs.observe_prior(shape, s)
    return costs


def estimator(costs: StepCost | None = None) -> DelayEstimator:
    return DelayEstimator(costs=costs or device_costs())


def pod(e: DelayEstimator, *remaining: int, policy: Policy = Policy.FCFS, adapter: str | None = None) -> Scheduler:
    """A scheduler of four seats whose steps take what ``e``'s step-time model predicts, with a running
    request decoding for each of ``remaining`` (the tokens it has left), on ``adapter``; first come, first
    served unless ``policy`` says otherwise; no later arrival planned."""
    cache = AdapterCache({}, max_loras=4, max_cpu_loras=4)
    for name in "xyzw":
        cache.insert(LoraAdapter(name, name * 64, 8, (), 0))
    s = Scheduler(SchedulerLimits(4, 100), BlockManager(4096, 16), cache, lambda name: True, policy=policy,
                  prefill_budget=e.costs.prefill_budget, step_time=e.costs.predict)
    s.arrivals.coming = lambda *_, **__: iter(())
    for i, left in enumerate(remaining):
        s.add(Sequence(f"decode{i}", adapter, [0, 0], SamplingParams(max_tokens=left + 1), 3 + left))
    if remaining:
        batch = s.schedule()  # their 2-token prompts; each samples its first token
        s.postprocess(batch, [0] * len(batch))
    return s


def queued(s: Scheduler, *prompts: int, adapter: str | None = None) -> Scheduler:
    """``s`` with a waiting request of each of ``prompts`` tokens, each decoding long after it."""
    for i, tokens in enumerate(prompts):
        s.add(Sequence(f"waiting{i}-{tokens}", adapter, [0] * tokens, SamplingParams(max_tokens=10**6), tokens + 10**6))
    return s


def wait(e: DelayEstimator, s: Scheduler, prompt: int, adapter: str | None = None,
         horizon_s: float = math.inf) -> float:
    """The estimate of a new request's first token, as the engine makes it: where the plan of ``s``'s queue
    lands it (``Scheduler.plan``), from the end of the step in flight, with the pod's correction."""
    return e.first_token(s.plan().landing(adapter, None, prompt, horizon_s))


def test_nothing_measured_yet_estimates_no_wait():
    e = estimator(costs=StepCost())
    assert e.first_token(Landing(50.0, 500)) == 0.0 and e.own_prefill(5000, IDLE) == 0.0


def test_with_free_seats_the_wait_is_the_prefill_of_the_work_ahead_and_its_own():
    e = estimator()
    assert wait(e, pod(e), 30) == pytest.approx(0.13)  # one step of 30 tokens
    # one prompt of 250 ahead and nothing decoding: steps of 100 (0.2 s), 100, then its last 50 with our 30
    assert wait(e, queued(pod(e), 250), 30) == pytest.approx(2 * 0.2 + 0.18)
    # two prompts of 125 ahead: the first is done in the second step and decodes from the third, when a
    # step prefills only 40 tokens beside it (0.14 s): 100, 100 (25 + 75), 40, then the last 10 and our 30
    assert wait(e, queued(pod(e), 125, 125), 30) == pytest.approx(2 * 0.2 + 2 * 0.14)
    # two requests decoding already: every step prefills 40 tokens, 280 tokens take seven
    assert wait(e, queued(pod(e, 1000, 1000), 250), 30) == pytest.approx(7 * 0.14)


def test_when_seats_are_full_a_new_request_waits_for_running_requests_to_end():
    e = estimator()
    # four seats, each decoding for 50 more tokens (a step of four rows takes 0.1 s): the first seat frees
    # after 50 steps, then its own step of 4 tokens beside the three left (0.104 s)
    assert wait(e, pod(e, 50, 50, 50, 50), 4) == pytest.approx(50 * 0.1 + 0.104)
    # they end after 10, 20, 30 and 40 more tokens: the first seat frees after 10 steps
    assert wait(e, pod(e, 10, 20, 30, 40), 4) == pytest.approx(10 * 0.1 + 0.104)
    # three requests of 10 tokens waiting ahead take the first three seats to free: it takes the fourth,
    # after 40 steps, and the steps that admitted each of the three prefilled 10 tokens more (0.01 s)
    assert wait(e, queued(pod(e, 10, 20, 30, 40), 10, 10, 10), 4) == pytest.approx(40 * 0.1 + 3 * 0.01 + 0.104)


def test_a_request_that_takes_a_seat_at_the_next_step_waits_only_for_prefill():
    e = estimator()
    # under fair share, x holds all four seats: a request of y takes one of them at the next step (seats.py)
    full = pod(e, 50, 50, 50, 50, policy=Policy.FAIR, adapter="x")
    assert wait(e, full, 4, adapter="y") == pytest.approx(0.104)


def test_the_step_in_flight_adds_what_is_left_of_it():
    e = estimator()
    before = e.first_token(ONE_STEP)
    e.step_began(StepShape(0, 9900, 1))  # predicted 10 s
    assert 9.0 < e.first_token(ONE_STEP) - before <= 10.0
    e.observe_step(StepShape(0, 9900, 1), 10.0)  # it ended
    assert e.first_token(ONE_STEP) == pytest.approx(before, rel=0.01)


def test_a_first_token_later_than_the_queue_delay_or_the_deadline_is_refused_with_the_time_to_wait():
    assert lateness(1.5, 0.2, 1.0, 2.0, None) is None
    late = lateness(2.5, 0.2, 1.0, 2.0, None)
    assert (late.reason, late.retry_after_s) == ("queue_delay", pytest.approx(0.5))
    assert "first token in about 2.50 s" in late.message and "beyond its --max-queue-delay of 2 s" in late.message
    late = lateness(1.5, 0.2, 1.0, 2.0, 1.0)  # the caller's deadline is shorter
    assert (late.reason, late.retry_after_s) == ("deadline", pytest.approx(0.5))
    assert "after its deadline (1.00 s from now)" in late.message
    assert lateness(100.0, 0.2, 1.0, 0.0, None) is None  # no queue delay, no deadline: nothing refused


def test_a_promised_first_token_must_come_a_step_before_the_promise_ends():
    assert lateness(1.9, 0.2, 1.0, 2.0, None, step_s=0.05) is None
    late = lateness(1.97, 0.2, 1.0, 2.0, None, step_s=0.05)  # within a step of it: the scheduler would rush
    assert (late.reason, late.retry_after_s) == ("queue_delay", pytest.approx(0.05))  # the least hint
    assert lateness(1.97, 0.2, 1.0, 2.0, 5.0) is None  # only the promise keeps the step, not a deadline
    # a long prompt with nothing ahead is promised twice its own prefill, and served however long a step is
    assert lateness(0.1, 0.1, 1.0, 0.001, None, step_s=0.5) is None
    assert lateness(0.19, 0.1, 1.0, 0.001, None, step_s=0.5) is not None  # 0.09 s behind others: kept


def test_a_prompt_longer_than_half_the_queue_delay_may_wait_twice_its_own_prefill():
    assert lateness(3.0, 3.0, 1.0, 2.0, None) is None  # nothing ahead of it: served, though past 2 s
    assert lateness(5.9, 3.0, 1.0, 2.0, None) is None  # ahead of it less work than its own
    late = lateness(6.5, 3.0, 1.0, 2.0, None)
    assert late.reason == "queue_delay" and late.retry_after_s == pytest.approx(0.5)


def test_the_tail_of_recent_lateness_judges_the_wait():
    assert lateness(1.5, 0.2, 1.0, 2.0, None) is None
    late = lateness(1.5, 0.2, 1.5, 2.0, None)  # first tokens have come 1.5x as late as estimated
    assert late.reason == "queue_delay" and late.retry_after_s == pytest.approx(0.25)
    assert lateness(3.0, 0.2, 0.5, 2.0, None) is None  # and earlier


def test_the_retry_hint_is_the_excess_over_the_time_allowed_within_bounds():
    assert retry_after(3.5, 1.0) == pytest.approx(2.5)
    assert retry_after(1.01, 1.0) == 0.05
    assert retry_after(500.0, 1.0) == 60.0


def test_first_tokens_later_than_estimated_make_later_estimates_longer_within_bounds():
    e = estimator()
    plain = e.first_token(ONE_STEP)
    for _ in range(40):  # every first token came twice as late as estimated
        e.observe_first_token(e.first_token(ONE_STEP), 2 * e.first_token(ONE_STEP))
    assert e.first_token(ONE_STEP) == pytest.approx(4.0 * plain)  # capped at 4x
    for _ in range(200):  # then they come as estimated by the model alone
        e.observe_first_token(e.first_token(ONE_STEP), plain)
    assert e.first_token(ONE_STEP) == pytest.approx(plain, rel=0.01)


def test_first_tokens_earlier_than_estimated_make_estimates_shorter_and_tiny_estimates_teach_nothing():
    e = estimator()
    plain = e.first_token(ONE_STEP)
    e.observe_first_token(0.01, 1.0)  # under 50 ms: one step's noise, not a trend
    assert e.first_token(ONE_STEP) == pytest.approx(plain)
    for _ in range(100):
        e.observe_first_token(e.first_token(ONE_STEP), 0.7 * plain)
    assert e.first_token(ONE_STEP) == pytest.approx(0.7 * plain, rel=0.01)


def test_admission_judges_by_the_slowest_tenth_of_recent_first_tokens_against_their_estimates():
    e = estimator()
    assert e.calibration().tail() == 1.0
    for late in (1.0, 0.9, 1.1, 1.0, 0.8):  # too few to judge a tail by
        e.observe_first_token(1.0, late)
    assert e.calibration().tail() == 1.0
    e.observe_first_token(0.01, 5.0)  # under 50 ms: noise of one step, not counted
    for late in (1.0, 1.2, 1.0, 1.0, 1.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0):
        e.observe_first_token(1.0, late)
    # 20 seen: the slowest tenth starts at the 18th of them in order (index int(0.9 × 19) = 17): 1.1
    assert e.calibration().tail() == pytest.approx(1.1)
    for _ in range(64):  # the window holds the latest 64: all twice as late, then ten times (capped)
        e.observe_first_token(1.0, 2.0)
    assert e.calibration().tail() == pytest.approx(2.0)
    for _ in range(64):
        e.observe_first_token(1.0, 10.0)
    assert e.calibration().tail() == 4.0


def test_an_account_is_judged_by_its_own_first_tokens_once_it_has_had_enough():
    e = estimator()
    flood, trickle = ("tenant", "big"), ("tenant", "small")
    model = e.first_token(ONE_STEP)  # nothing learnt yet: the model's estimate

    def admitted(account, lateness: float) -> None:
        """A request of ``account`` estimated as admission estimates it, whose first token came ``lateness``
        times the model's estimate."""
        estimate = e.first_token(ONE_STEP, account)
        e.observe_first_token(estimate, lateness * model, account, e.calibration(account).bias)

    for _ in range(60):  # the flood's first tokens come three times as late as the model says
        admitted(flood, 3.0)
    assert e.calibration(flood).bias == pytest.approx(3.0, rel=0.01) and e.bias == pytest.approx(3.0, rel=0.01)
    for _ in range(7):  # the trickle's on time, but too few of them to judge it by: the pod's judges it
        admitted(trickle, 1.0)
    assert e.calibration(trickle) is e.pod
    admitted(trickle, 1.0)  # its eighth: from now on its own, which started from the pod's and learnt
    own = e.calibration(trickle)
    assert own is not e.pod and own.bias < 1.5 and e.calibration(flood).bias == pytest.approx(3.0, rel=0.01)
    assert e.first_token(ONE_STEP, trickle) < e.first_token(ONE_STEP, flood) / 2
    assert e.own_prefill(30, IDLE, trickle) < e.own_prefill(30, IDLE, flood) / 2
    assert e.calibration(("tenant", "unseen")) is e.pod


def test_the_accounts_kept_are_the_most_recently_seen():
    e = estimator()
    for _ in range(8):
        e.observe_first_token(1.0, 1.0, "old")
    assert e.calibration("old") is not e.pod
    for i in range(1024):  # as many other accounts as are kept: the least recently seen is dropped
        e.observe_first_token(1.0, 1.0, f"tenant-{i}")
    assert e.calibration("old") is e.pod


def test_a_requests_own_prefill_is_its_estimate_with_nothing_ahead_beside_the_same_decodes():
    e = estimator()
    decoding = Load(2)
    assert e.own_prefill(250, IDLE) == pytest.approx(wait(e, pod(e), 250))
    assert e.own_prefill(250, IDLE) == pytest.approx(0.2 + 0.2 + 0.15)
    # 40 tokens a step beside two decodes: six steps of 40, then the last 10 (0.11 s)
    assert e.own_prefill(250, decoding) == pytest.approx(6 * 0.14 + 0.11)
    # the work ahead adds to the estimate, never to its own part; the correction applies to both
    assert wait(e, queued(pod(e), 100), 250) > e.own_prefill(250, IDLE)
    e.pod.bias = 2.0
    assert e.own_prefill(250, decoding) == pytest.approx(2 * (6 * 0.14 + 0.11))
    assert estimator(costs=StepCost()).own_prefill(250, IDLE) == 0.0


def test_a_prompt_of_an_adapter_the_decodes_have_not_got_pays_that_adapter_in_each_of_its_steps():
    # every step 100 ms, 1 ms a prompt token, 20 ms an adapter; steps held to 140 ms
    costs = StepCost(target_itl_s=0.14, max_batched_tokens=100)
    for shape, s in ((StepShape(1), 0.1), (StepShape(2), 0.1), (StepShape(1, adapters=1), 0.12),
                     (StepShape(0, 100, 1), 0.2), (StepShape(0, 50, 1), 0.15), (StepShape(0, 100, 2), 0.2),
                     (StepShape(0, 100, 1, 1), 0.22)):
        costs.observe_prior(shape, s)
    e = estimator(costs=costs)
    base_decodes = Load(2)
    # beside base-model decodes a base-model prompt gets 40 tokens a step; one of adapter x 20 (x costs 20 ms)
    assert e.own_prefill(100, base_decodes) == pytest.approx(0.14 + 0.14 + 0.12)
    assert e.own_prefill(100, base_decodes, adapter="x") == pytest.approx(5 * 0.14)
    assert wait(e, pod(e, 1000, 1000), 100, adapter="x") == pytest.approx(5 * 0.14)
    # work ahead on adapter y pays y's cost; once its prompt is done y decodes, and its steps cost that
    assert wait(e, queued(pod(e, 1000, 1000), 20, adapter="y"), 40) == pytest.approx(0.14 + 2 * 0.14)
    # beside decodes of x an x prompt brings nothing: the 20 ms of the decodes' x leave 20 tokens a step
    x_decodes = Load(2, frozenset({"x"}))
    assert e.own_prefill(100, x_decodes, adapter="x") == pytest.approx(e.own_prefill(100, x_decodes))


def test_work_past_the_steps_followed_one_by_one_counts_at_the_last_steps_rate():
    e = estimator()
    decoding = Load(2)  # 40 tokens a step of 0.14 s
    huge = 40 * 4096 * 3  # three times what the steps followed one by one hold
    assert e.own_prefill(huge, decoding) == pytest.approx(3 * 4096 * 0.14)
    # the work ahead of a huge prompt still shows in the part of its wait that is not its own
    ahead = wait(e, queued(pod(e, 10**7, 10**7), 40 * 100), huge) - e.own_prefill(huge, decoding)
    assert ahead == pytest.approx(100 * 0.14)


def test_an_estimate_past_what_admission_allows_counts_the_rest_at_the_last_steps_rate():
    e = estimator()
    followed = wait(e, queued(pod(e, 10**7, 10**7), 40 * 100), 40)  # 40 tokens a step of 0.14 s
    assert followed == pytest.approx(101 * 0.14)
    # stopped after 1 s (8 steps), the other 93 at the same rate: the same wait, as long as steps are alike
    assert wait(e, queued(pod(e, 10**7, 10**7), 40 * 100), 40, horizon_s=1.0) == pytest.approx(followed)

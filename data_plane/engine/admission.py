"""Admission by deadline: how long a new request would wait for its first token, and whether to take it.

The wait is where the plan of the queue lands the new request (``queue_plan.py``): the scheduler's own
rules followed step by step on a copy of its state, each step timed by the step-time model the engine
fits to its own steps (``step_cost.py``), so the estimate reads the order the scheduler will take (fair
shares, started prompts' quanta, seats taken and given up, rushes, floods' streams yielding, decodes
ending at their length), with the other flows' requests expected to arrive meanwhile at their recent
rates (``Arrivals``) taking the turns the rules give them. To the end of the step in flight (what is
left of its predicted time) it adds the plan's steps up to the one that ends the new request's prompt,
which brings its first token. The sum is then scaled by how late (or early) recent admitted requests'
first tokens came against their estimates, so what the plan misses (steps waiting on the event loop, a
busy machine, requests that stop before their length, arrivals other than expected) is corrected from the
pod's own outcomes.

A request is refused when that wait exceeds its gRPC deadline or the pod's ``--max-queue-delay``,
judged as late as the slowest tenth of recent first tokens came against their estimates (``tail``),
since the promise is for nearly every request, not the average one. The correction and the tail are
an account's own (its tenant's, or its adapter's for a request without one) once it has had enough
first tokens, else the pod's: how late a flood's first tokens come, behind its own backlog, says
nothing of a tenant that fair share serves first, and judged by the flood's lateness that tenant
would be refused too. A prompt whose own prefill beside
the running decodes (``own_prefill``) takes more than half the queue delay may wait up to twice that:
it cannot start sooner anywhere, and is served once no more work than its own is ahead of it. The
refusal says when to try again: the time until the estimate would fit.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from data_plane.engine.queue_plan import Landing, work_plan
from data_plane.engine.step_cost import StepCost, StepShape

# Weight of the newest sample in the moving average of service time: about the last ten requests count.
_EWMA = 0.2
# The estimate corrects itself by how late or early recent first tokens came: within these factors, and
# from estimates of at least this long (shorter ones are mostly noise of one step).
_MIN_BIAS, _MAX_BIAS, _MIN_CALIBRATED_S = 0.5, 4.0, 0.05
# Admission judges a wait as late as this quantile of recent first tokens came against their estimates,
# over this many of them once at least the minimum were seen.
_TAIL_QUANTILE, _TAIL_SAMPLES, _TAIL_MIN_SAMPLES = 0.9, 64, 8
# Accounts whose own calibration is kept, the most recently seen (tenants are names clients send).
_MAX_ACCOUNTS = 1024
# How far back the arrival rates that predict overtaking (Arrivals) look.
ARRIVAL_WINDOW_S = 10.0
# The plan of the queue counts the requests expected to arrive by each moment of a wait at this quantile of
# their number (a Poisson process at the recent rate): a little more than their mean number, since each
# one that comes sooner overtakes and the wait grows with it. The least that kept admitted first tokens
# within their promise on benchmarks/admission_replay.py --calibrated at its highest rate (RESULTS.md,
# "One model of the queue"); higher refuses more for fewer first tokens kept.
_ARRIVAL_QUANTILE = 0.6
# Bounds of the retry hint a refusal carries.
_MIN_RETRY_S, _MAX_RETRY_S = 0.05, 60.0


@dataclass(frozen=True)
class Ahead:
    """What a new request would wait behind, as a list rather than a plan (``DelayEstimator.estimate``,
    ``Scheduler.ahead_of``): requests admitted before it (that still need a seat) and the uncomputed
    tokens of the prefill work before it, ``sizes`` that work item by item in order (default:
    ``tokens`` shared evenly by ``requests``); ``seat_now`` when it would not wait for a seat (its account
    has none and takes one at the next step)."""

    requests: int
    tokens: int
    seat_now: bool = False
    sizes: tuple[int, ...] = field(default=(), compare=False)
    adapters: tuple[object, ...] = field(default=(), compare=False)  # each of ``sizes``' adapter (None: base)

    def work(self) -> list[tuple[int, object]]:
        """(tokens, adapter) of each work item, in order; the base model's where the adapters are not known."""
        return list(zip(self.items(), self.adapters or [None] * len(self.items()), strict=True))

    def items(self) -> list[int]:
        if self.sizes:
            return list(self.sizes)
        n = max(1, self.requests)
        return [t for t in (self.tokens // n + (i < self.tokens % n) for i in range(n)) if t]


class Arrivals:
    """Each flow's requests (an adapter's, or the base model's) admitted over the last ``window_s``: how many
    more to expect within a wait, their mean prompt and completion sizes, and when the plan of the queue
    expects them (``coming``). Under fair share a request is overtaken by other flows' later requests
    (each takes the turns the rules give it), so a wait planned from the queues alone comes out short when
    the other flows' queues are short now and fill while it waits."""

    def __init__(self, window_s: float = ARRIVAL_WINDOW_S) -> None:
        self.window_s = window_s
        # flow -> (time, prompt tokens, new tokens at most, tenant), oldest first
        self._seen: dict[object, deque[tuple[float, int, int, str | None]]] = {}

    def record(self, flow: object, prompt_tokens: int, now: float, new_tokens: int = 1,
               tenant: str | None = None) -> None:
        self._seen.setdefault(flow, deque()).append((now, prompt_tokens, new_tokens, tenant))
        self._forget(now)

    def recent(self, now: float) -> list[object]:
        """Flows with requests admitted within the window."""
        self._forget(now)
        return list(self._seen)

    def expected(self, flow: object, within_s: float, now: float) -> int:
        """Requests of ``flow`` expected within the next ``within_s`` seconds at its recent rate, rounded."""
        seen = self._seen.get(flow)
        if not seen or within_s <= 0:
            return 0
        # the rate over the whole window, however recent the first of them: a burst sent at once is not
        # taken for a rate that lasts
        return round(len(seen) * within_s / self.window_s)

    def mean_prompt(self, flow: object) -> int:
        seen = self._seen.get(flow)
        return round(sum(tokens for _, tokens, _, _ in seen) / len(seen)) if seen else 0

    def coming(self, within_s: float, now: float, besides: object = ...) -> Iterator[tuple[float, object, str | None,
                                                                                        int, int]]:
        """The requests of flows other than ``besides`` expected within the next ``within_s`` seconds, soonest
        first: at the window's rate of them all, the (k+1)-th when the ARRIVAL_QUANTILE of their number
        first exceeds k (at 0.6: at 0.51, 1.38, 2.29, 3.21 ... times the mean spacing), the flows taking
        turns in proportion to their own rates, each of its flow's recent mean prompt and completion sizes
        and billed to its latest tenant; (seconds from now, flow, tenant, prompt tokens, new tokens). Any
        other flow's request may overtake a waiting one, so what counts is how soon the next of them all
        comes."""
        self._forget(now)
        flows = {flow: seen for flow, seen in self._seen.items() if flow != besides}
        total = sum(len(seen) for seen in flows.values())
        if not total:
            return
        spacing_s = self.window_s / total
        kinds = {flow: (seen[-1][3], max(1, round(sum(p for _, p, _, _ in seen) / len(seen))),
                        max(1, round(sum(n for _, _, n, _ in seen) / len(seen)))) for flow, seen in flows.items()}
        credit = dict.fromkeys(flows, 0.0)
        for k in itertools.count():
            at = _arrival_mean(k) * spacing_s
            if at > within_s:
                return
            for flow, seen in flows.items():
                credit[flow] += len(seen) / total
            flow = max(credit, key=credit.__getitem__)  # the flow furthest behind its share of the turns
            credit[flow] -= 1.0
            yield at, flow, *kinds[flow]

    def _forget(self, now: float) -> None:
        for flow, seen in list(self._seen.items()):
            while seen and seen[0][0] < now - self.window_s:
                seen.popleft()
            if not seen:
                del self._seen[flow]


@dataclass(frozen=True)
class Load:
    """The engine's load when a request arrives."""

    running: int
    running_decodes: int  # running requests past their prefill: one token each per step
    running_remaining: tuple[int, ...]  # tokens each running request may still produce (its max_total)
    decode_adapters: frozenset = frozenset()  # distinct adapters among the running decodes (the base model not)

    @property
    def adapters(self) -> int:
        return len(self.decode_adapters)


@dataclass
class Calibration:
    """How late first tokens came against their estimates: the pod's, or one account's."""

    bias: float = 1.0  # moving average of first-token time over estimate, applied to every estimate
    lateness: deque[float] = field(default_factory=lambda: deque(maxlen=_TAIL_SAMPLES))  # recent ratios

    def observe(self, ratio: float) -> None:
        self.bias = min(_MAX_BIAS, max(_MIN_BIAS, self.bias * (1 + _EWMA * (ratio - 1))))
        self.lateness.append(ratio)

    def tail(self) -> float:
        """How late, against their estimates, the slowest tenth of recent first tokens came (1.0 until
        enough were seen): admission judges a wait by the estimate times this, so that the promise holds
        for all but the slowest few first tokens, not only on average."""
        if len(self.lateness) < _TAIL_MIN_SAMPLES:
            return 1.0
        ranked = sorted(self.lateness)
        return min(_MAX_BIAS, max(_MIN_BIAS, ranked[int(_TAIL_QUANTILE * (len(ranked) - 1))]))


class DelayEstimator:
    def __init__(self, max_num_seqs: int, costs: StepCost) -> None:
        self._max_num_seqs = max_num_seqs
        self.costs = costs
        self.service_s: float | None = None  # moving average of admission to last token
        self.pod = Calibration()  # every first token's
        self._accounts: dict[object, Calibration] = {}  # each account's own (fair_share.account_of), LRU order
        self._step_ends = 0.0  # time.monotonic() the step in flight is predicted to end

    @property
    def bias(self) -> float:
        """The pod's correction: first-token time over estimate, a moving average."""
        return self.pod.bias

    def calibration(self, account: object = None) -> Calibration:
        """``account``'s own once it has had _TAIL_MIN_SAMPLES first tokens, else the pod's."""
        own = self._accounts.get(account)
        return own if own is not None and len(own.lateness) >= _TAIL_MIN_SAMPLES else self.pod

    def step_began(self, shape: StepShape) -> None:
        self._step_ends = time.monotonic() + self.costs.predict(shape)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        self._step_ends = 0.0
        self.costs.observe(shape, seconds)

    def observe_first_token(self, estimated_s: float, seconds: float, account: object = None,
                            applied_bias: float | None = None) -> None:
        """A request of ``account`` admitted with the estimate ``estimated_s``, made with the correction
        ``applied_bias`` (None: the pod's as it is now), got its first token after ``seconds``. The pod's
        correction and the account's are each corrected by how late the first token came against the
        estimate it would have made (the model's, times its own correction), so each converges on its own
        requests whichever was used. An account's starts from the pod's."""
        model_s = estimated_s / (self.pod.bias if applied_bias is None else applied_bias)
        calibrations = [self.pod]
        if account is not None:
            own = self._accounts.pop(account, None) or Calibration(bias=self.pod.bias)
            self._accounts[account] = own  # the most recently seen last
            if len(self._accounts) > _MAX_ACCOUNTS:
                del self._accounts[next(iter(self._accounts))]
            calibrations.append(own)
        for calibration in calibrations:
            if model_s * calibration.bias >= _MIN_CALIBRATED_S:
                calibration.observe(seconds / (model_s * calibration.bias))

    def observe_service(self, seconds: float) -> None:
        """A request finished ``seconds`` after it was first scheduled."""
        self.service_s = _average(self.service_s, seconds)

    def in_flight_s(self) -> float:
        """What is left of the step in flight, as predicted when it began."""
        return max(0.0, self._step_ends - time.monotonic())

    def first_token(self, landing: Landing, account: object = None) -> float:
        """Seconds until a new request of ``account`` gets its first token where the plan of the queue lands
        it (``queue_plan.Landing``, its steps from the end of the step in flight), with the account's
        correction; 0.0 until a step has been timed."""
        if self.costs.coef is None:
            return 0.0
        return (self.in_flight_s() + landing.seconds) * self.calibration(account).bias

    def estimate(self, ahead: Ahead, prompt_tokens: int, load: Load, enough_s: float = math.inf,
                 account: object = None, adapter: object = None) -> float:
        """Seconds a new request of ``account`` on ``adapter`` (None: the base model) with ``prompt_tokens``
        would wait for its first token behind ``ahead``, a list of the work before it rather than the
        scheduler's state (the engine reads the plan of its queue: ``first_token``): the plan of that work in
        order beside the running decodes (``queue_plan.work_plan``), and a seat's turnover for each seat short;
        0.0 until a step has been timed (an idle pod with nothing measured has nothing to wait for). Past
        ``enough_s`` the steps are no longer followed one by one: the rest counts at the last step's rate."""
        if self.costs.coef is None:
            return 0.0
        bias = self.calibration(account).bias
        wait = self.in_flight_s() + self._prefill_s(
            [*ahead.work(), (prompt_tokens, adapter)], load, enough_s / bias)
        short = load.running + ahead.requests + 1 - self._max_num_seqs  # seats that must free up first
        if short > 0 and not ahead.seat_now:
            wait += short * self._seat_turnover_s(load) / self._max_num_seqs
        return wait * bias

    def own_prefill(self, prompt_tokens: int, load: Load, account: object = None, adapter: object = None) -> float:
        """Seconds the prefill of ``prompt_tokens`` on ``adapter`` alone takes beside the running decodes,
        with the same correction as ``estimate``: the part of a wait that is not spent behind other work."""
        if self.costs.coef is None:
            return 0.0
        return self._prefill_s([(prompt_tokens, adapter)], load) * self.calibration(account).bias

    def _prefill_s(self, work: list[tuple[int, object]], load: Load, enough_s: float = math.inf) -> float:
        """Seconds until the last item of prefill ``work`` ((tokens, adapter), in order) is computed beside the
        running decodes: a plan of that work alone (``queue_plan.work_plan``)."""
        return work_plan(work, load.running_decodes, load.decode_adapters, self.costs.prefill_budget,
                         self.costs.predict, self.costs.max_batched_tokens, enough_s)

    def _seat_turnover_s(self, load: Load) -> float:
        if self.service_s is not None:
            return self.service_s
        # nothing finished yet: a running request holds its seat for its remaining tokens at most
        remaining = load.running_remaining or (1,)
        decode_s = self.costs.predict(StepShape(load.running_decodes, adapters=load.adapters))
        return sum(remaining) / len(remaining) * decode_s


@dataclass(frozen=True)
class Late:
    """Why a request is refused: ``reason`` as the refusals metric labels it, what the caller is told."""

    reason: str
    message: str
    retry_after_s: float


def lateness(wait_s: float, own_s: float, tail: float, max_queue_delay_s: float,
             timeout_s: float | None, step_s: float = 0.0) -> Late | None:
    """Whether a request whose first token is estimated ``wait_s`` away (``own_s`` of it its own prefill
    beside today's decodes) must be refused, judged as late as recent first tokens came in the tail
    (``tail``, ``Calibration.tail``): when it would come after the caller's deadline (``timeout_s``;
    None: none) or after ``max_queue_delay_s`` (0: no limit). A prompt whose own prefill takes more than
    half the queue delay may wait up to twice its own prefill: it cannot start sooner on any pod, and is
    served once no more work than its own is ahead of it. A promised first token must come a step
    (``step_s``, one beside today's decodes; at most the part of the wait spent behind other work, so a
    request with nothing ahead is never refused for it) before the promise ends: the scheduler keeps
    that step for the error of its predictions, and rushes steps, lengthening running streams' gaps, for
    a request whose first token would come later (``step_budget.Rush``). The caller learns at
    once to go elsewhere instead of after a long wait, with the hint ``retry_after``."""
    wait_s, own_s = wait_s * tail, own_s * tail
    if timeout_s is not None and wait_s > timeout_s:
        return Late("deadline", f"this pod would give the request its first token in about {wait_s:.2f} s, after "
                                f"its deadline ({timeout_s:.2f} s from now); retry on another pod or later",
                    retry_after(wait_s, timeout_s))
    allowed_s = promise_s(own_s, max_queue_delay_s)
    if allowed_s is not None and wait_s + max(0.0, min(step_s, wait_s - own_s)) > allowed_s:
        return Late("queue_delay", f"this pod would give the request its first token in about {wait_s:.2f} s, "
                                   f"too close to or beyond its --max-queue-delay of {max_queue_delay_s:g} s; "
                                   "retry on another pod or later", retry_after(wait_s, allowed_s))
    return None


def promise_s(own_s: float, max_queue_delay_s: float) -> float | None:
    """How soon an admitted request's first token is promised (None: no --max-queue-delay, no promise):
    within the queue delay, or for a prompt whose own prefill (``own_s``) takes more than half of it,
    within twice that."""
    return max(max_queue_delay_s, 2 * own_s) if max_queue_delay_s else None


def retry_after(estimate_s: float, allowed_s: float) -> float:
    """How long a refused request should wait before it is sent here again: until the queue ahead of it
    would have drained to what it allows."""
    return min(_MAX_RETRY_S, max(_MIN_RETRY_S, estimate_s - allowed_s))


def _average(current: float | None, sample: float) -> float:
    return sample if current is None else current + _EWMA * (sample - current)


@functools.cache
def _arrival_mean(k: int) -> float:
    """The mean number of arrivals of a Poisson process by which the ARRIVAL_QUANTILE of their number first
    exceeds ``k``: the plan puts the (k+1)-th arrival where the expected number comes to that. Exact (by
    bisection) for the first few, then by the normal approximation."""
    if k >= 32:
        z = statistics.NormalDist().inv_cdf(_ARRIVAL_QUANTILE)  # m + z·sqrt(m) = k + 1/2
        return ((-z + math.sqrt(z * z + 4 * (k + 0.5))) / 2) ** 2
    low, high = 0.0, k + 10.0
    for _ in range(50):  # P(count <= k) at mean m falls as m grows: the m where it falls to the quantile
        mid = (low + high) / 2
        term = cdf = math.exp(-mid)
        for i in range(1, k + 1):
            term *= mid / i
            cdf += term
        low, high = (mid, high) if cdf > _ARRIVAL_QUANTILE else (low, mid)
    return high

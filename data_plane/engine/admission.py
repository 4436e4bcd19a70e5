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

# Weight of the newest sample in the moving average of how late first tokens came: about the last ten count.
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


class Arrivals:
    """Each flow's requests (an adapter's, or the base model's) admitted over the last ``window_s``: when the
    plan of the queue expects more of them, and of what sizes (``coming``). Under fair share a request is
    overtaken by other flows' later requests (each takes the turns the rules give it), so a wait planned
    from the queues alone comes out short when the other flows' queues are short now and fill while it
    waits."""

    def __init__(self, window_s: float = ARRIVAL_WINDOW_S) -> None:
        self.window_s = window_s
        # flow -> (time, prompt tokens, new tokens at most, tenant), oldest first
        self._seen: dict[object, deque[tuple[float, int, int, str | None]]] = {}

    def record(self, flow: object, prompt_tokens: int, now: float, new_tokens: int = 1,
               tenant: str | None = None) -> None:
        self._seen.setdefault(flow, deque()).append((now, prompt_tokens, new_tokens, tenant))
        self._forget(now)

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
    """The running decodes when a request arrives: what a prompt's own prefill is computed beside."""

    running_decodes: int  # running requests past their prefill: one token each per step
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
    def __init__(self, costs: StepCost) -> None:
        self.costs = costs
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

    def own_prefill(self, prompt_tokens: int, load: Load, account: object = None, adapter: object = None) -> float:
        """Seconds the prefill of ``prompt_tokens`` on ``adapter`` alone takes beside the running decodes,
        with the same correction as ``first_token``: the part of a wait that is not spent behind other work."""
        if self.costs.coef is None:
            return 0.0
        seconds = work_plan([(prompt_tokens, adapter)], load.running_decodes, load.decode_adapters,
                            self.costs.prefill_budget, self.costs.predict, self.costs.max_batched_tokens)
        return seconds * self.calibration(account).bias


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

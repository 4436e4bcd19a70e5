"""Admission by deadline: how long a new request would wait for its first token, and whether to take it.

The wait has three parts, estimated from the step-time model the engine fits to its own steps
(``step_cost.py``) and from what it measured recently; their sum is then scaled by how late (or early)
recent admitted requests' first tokens came against their estimates, so what the model misses (steps
waiting on the event loop, a busy machine, work the scheduler orders differently) is corrected from
the pod's own outcomes:

- the step in flight: what is left of its predicted time;
- a seat: when the requests running plus those ahead of the new one fill ``max_num_seqs``, the new
  one waits for enough running requests to finish. Each seat turns over once per service time (admission
  to last token, an average over recent requests), so ``n`` extra seats take ``n × service / max_num_seqs``.
  Before any request has finished, a running request's service time is its remaining tokens (at most
  its ``max_tokens``) times the predicted decode step;
- its prefill and the prefill work ahead of it (prompts being chunked, waiting requests): their
  uncomputed tokens in steps of the prefill budget beside the decodes of the requests running and
  ahead of it (by then all decoding, up to ``max_num_seqs``), each step of the predicted time for its
  shape. Its first token comes with the step that ends its prompt.

Which requests are ahead follows the scheduler's policy (``Scheduler.ahead_of``): under fair share a
request of a quiet adapter is ahead of most of a flooding adapter's backlog, and when its adapter has
no seat it takes one from the flood at the next step, so the flood is refused and the quiet adapter
is not.

A request is refused when that wait exceeds the time it has: its gRPC deadline, or the pod's
``--max-queue-delay``, whichever is shorter. The refusal says when to try again: the time until the
estimate would fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from data_plane.engine.step_cost import StepCost, StepShape

# Weight of the newest sample in the moving average of service time: about the last ten requests count.
_EWMA = 0.2
# The estimate corrects itself by how late or early recent first tokens came: within these factors, and
# from estimates of at least this long (shorter ones are mostly noise of one step).
_MIN_BIAS, _MAX_BIAS, _MIN_CALIBRATED_S = 0.5, 4.0, 0.05
# Bounds of the retry hint a refusal carries.
_MIN_RETRY_S, _MAX_RETRY_S = 0.05, 60.0


@dataclass(frozen=True)
class Ahead:
    """What a new request would wait behind: requests admitted before it and their uncomputed tokens;
    ``seat_now`` when it would not wait for a seat (its tenant has none and takes one at the next step)."""

    requests: int
    tokens: int
    seat_now: bool = False


@dataclass(frozen=True)
class Load:
    """The engine's load when a request arrives."""

    running: int
    running_decodes: int  # running requests past their prefill: one token each per step
    running_remaining: tuple[int, ...]  # tokens each running request may still produce (its max_total)
    adapters: int = 0  # distinct adapters among the running requests


class DelayEstimator:
    def __init__(self, max_num_seqs: int, costs: StepCost) -> None:
        self._max_num_seqs = max_num_seqs
        self.costs = costs
        self.service_s: float | None = None  # moving average of admission to last token
        self.bias = 1.0  # moving average of first-token time over estimate, applied to every estimate
        self._step_ends = 0.0  # time.monotonic() the step in flight is predicted to end

    def step_began(self, shape: StepShape) -> None:
        self._step_ends = time.monotonic() + self.costs.predict(shape)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        self._step_ends = 0.0
        self.costs.observe(shape, seconds)

    def observe_first_token(self, estimated_s: float, seconds: float) -> None:
        """A request admitted with the estimate ``estimated_s`` got its first token after ``seconds``."""
        if estimated_s >= _MIN_CALIBRATED_S:  # the estimate was made with the bias then: correct it by the miss
            self.bias = min(_MAX_BIAS, max(_MIN_BIAS, self.bias * (1 + _EWMA * (seconds / estimated_s - 1))))

    def observe_service(self, seconds: float) -> None:
        """A request finished ``seconds`` after it was first scheduled."""
        self.service_s = _average(self.service_s, seconds)

    def estimate(self, ahead: Ahead, prompt_tokens: int, load: Load) -> float:
        """Seconds a new request with ``prompt_tokens`` would wait for its first token; 0.0 until a step
        has been timed (an idle pod with nothing measured has nothing to wait for)."""
        if self.costs.coef is None:
            return 0.0
        # while its prefill runs, the requests running now and those admitted before it decode beside it
        decodes = min(self._max_num_seqs, load.running + ahead.requests)
        wait = max(0.0, self._step_ends - time.monotonic()) + self._prefill_s(ahead.tokens + prompt_tokens, decodes,
                                                                              load.adapters)
        short = load.running + ahead.requests + 1 - self._max_num_seqs  # seats that must free up first
        if short > 0 and not ahead.seat_now:
            wait += short * self._seat_turnover_s(load) / self._max_num_seqs
        return wait * self.bias

    def _prefill_s(self, tokens: int, decodes: int, adapters: int) -> float:
        """Seconds of steps that compute ``tokens`` of prefill beside ``decodes`` decoding requests."""
        per_step = max(1, self.costs.prefill_budget(decodes, adapters))
        full, rest = divmod(tokens, per_step)
        last = self.costs.predict(StepShape(decodes, rest, 1, adapters)) if rest else 0.0
        return full * self.costs.predict(StepShape(decodes, per_step, 1, adapters)) + last

    def _seat_turnover_s(self, load: Load) -> float:
        if self.service_s is not None:
            return self.service_s
        # nothing finished yet: a running request holds its seat for its remaining tokens at most
        remaining = load.running_remaining or (1,)
        decode_s = self.costs.predict(StepShape(load.running_decodes, adapters=load.adapters))
        return sum(remaining) / len(remaining) * decode_s


def retry_after(estimate_s: float, allowed_s: float) -> float:
    """How long a refused request should wait before it is sent here again: until the queue ahead of it
    would have drained to what it allows."""
    return min(_MAX_RETRY_S, max(_MIN_RETRY_S, estimate_s - allowed_s))


def _average(current: float | None, sample: float) -> float:
    return sample if current is None else current + _EWMA * (sample - current)

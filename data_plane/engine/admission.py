"""Admission by deadline: how long a new request would wait for its first token, and whether to take it.

The wait has two parts, both estimated from what the engine measured recently:

- a seat: when the requests running plus those ahead of the new one fill ``max_num_seqs``, the new
  one waits for enough running requests to finish. Each seat turns over once per service time (admission
  to last token, an average over recent requests), so ``n`` extra seats take ``n × service / max_num_seqs``.
  Before any request has finished, a running request's service time is its remaining tokens (at most
  its ``max_tokens``) times the recent step time;
- its prefill and that of the requests ahead: their uncomputed tokens over the step's token budget
  left after the running requests' decodes, times the recent step time.

Which requests are ahead follows the scheduler's policy (``Scheduler.ahead_of``): under fair share a
request of a quiet adapter is ahead of most of a flooding adapter's backlog, and when its adapter has
no seat it takes one from the flood at the next step, so the flood is refused and the quiet adapter
is not.

A request is refused when that wait exceeds the time it has: its gRPC deadline, or the pod's
``--max-queue-delay``, whichever is shorter. The refusal says when to try again: the time until the
estimate would fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Weight of the newest sample in the moving averages: about the last ten steps or requests count.
_EWMA = 0.2
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


class DelayEstimator:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self._max_num_seqs = max_num_seqs
        self._budget = max_num_batched_tokens
        self.step_s: float | None = None  # moving average of one step's duration
        self.service_s: float | None = None  # moving average of admission to last token

    def observe_step(self, seconds: float) -> None:
        self.step_s = _average(self.step_s, seconds)

    def observe_service(self, seconds: float) -> None:
        """A request finished ``seconds`` after it was first scheduled."""
        self.service_s = _average(self.service_s, seconds)

    def estimate(self, ahead: Ahead, prompt_tokens: int, load: Load) -> float:
        """Seconds a new request with ``prompt_tokens`` would wait for its first token; 0.0 until a step
        has been timed (an idle pod with nothing measured has nothing to wait for)."""
        if self.step_s is None:
            return 0.0
        prefill_budget = max(1, self._budget - load.running_decodes)
        prefill_s = math.ceil((ahead.tokens + prompt_tokens) / prefill_budget) * self.step_s
        short = load.running + ahead.requests + 1 - self._max_num_seqs  # seats that must free up first
        if short <= 0 or ahead.seat_now:
            return prefill_s
        return prefill_s + short * self._seat_turnover_s(load) / self._max_num_seqs

    def _seat_turnover_s(self, load: Load) -> float:
        if self.service_s is not None:
            return self.service_s
        # nothing finished yet: a running request holds its seat for its remaining tokens at most
        remaining = load.running_remaining or (1,)
        return sum(remaining) / len(remaining) * self.step_s


def retry_after(estimate_s: float, allowed_s: float) -> float:
    """How long a refused request should wait before it is sent here again: until the queue ahead of it
    would have drained to what it allows."""
    return min(_MAX_RETRY_S, max(_MIN_RETRY_S, estimate_s - allowed_s))


def _average(current: float | None, sample: float) -> float:
    return sample if current is None else current + _EWMA * (sample - current)

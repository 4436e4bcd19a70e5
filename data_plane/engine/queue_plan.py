"""The plan of the queue: the steps ahead as the scheduler will take them, and where a new request lands.

One set of rules (``step``) decides what a step computes: a seat for an account without one
(``seats.py``), every running decode's next token, then prefill work, prompts being chunked and waiting
requests, in fair order (``fair_order.py``: the least-served flow first by each account's virtual token
counter, a started prompt keeping its standing for a quantum) while the step's budget lasts
(``step_budget.py``: the step-time target, rushes for promises at risk, floods' streams yielding), a
waiting request admitted while a seat, its adapter (``slot_reservations.py``) and its KV blocks allow.
``Scheduler.schedule()`` applies the rules to the scheduler's own state: that is the next step.
``QueuePlan`` applies the same rules step after step to a copy of that state on a virtual clock: each
step lasts what the fitted step-time model predicts (``step_cost.py``), its requests progress as the
step's postprocess leaves them (a finished prompt decodes, a request ends at its ``max_total``), and the
other flows' requests arrive as their recent rates and sizes lead one to expect (``admission.Arrivals``),
overtaking whom the rules let them overtake. Admission asks it where a new request lands and when its
first token comes (``QueuePlan.landing``); a request nothing arrives after gets it then, to the step.
``work_plan`` is the same rules over a bare list of work in order beside decodes that run on, for a
caller without the scheduler's state (a prompt's own prefill). The plan does not foresee KV blocks
running out (it takes them to suffice), prefix-cache hits, adapters still to load or waiting for a slot
(their flows wait through the plan, the new request's own aside), requests that stop before their
``max_total``, or arrivals other than expected.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from data_plane.engine.fair_order import FairOrder, Policy
from data_plane.engine.fair_share import Account, FairShare, Flow, account_of
from data_plane.engine.floods import Floods
from data_plane.engine.progress import ScheduledSeq
from data_plane.engine.seats import Seats
from data_plane.engine.sequence import SequenceStatus
from data_plane.engine.step_budget import PrefillBudget, Rush, StepBudget
from data_plane.engine.step_cost import StepShape

if TYPE_CHECKING:
    from data_plane.engine.admission import Arrivals

RUNNING, WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING
# Steps a plan follows one by one; the work left after them counts at the last step's rate. A landing
# follows fewer: within its horizon (what admission would allow) FOLLOWED_STEPS, and where nothing bounds
# the wait (no promise, no deadline: the estimate then only feeds the pod's metrics) UNBOUNDED_STEPS.
MAX_STEPS, FOLLOWED_STEPS, UNBOUNDED_STEPS = 4096, 256, 64


@dataclass
class Decodes:
    """A step's decodes, taken first: ``batch`` (one entry per decode, or none where the state counts them),
    ``rows`` decodes over ``adapters`` and ``accounts``, ``tokens`` the step may still carry, and the
    running prompts still being computed (``started``, read in the same walk)."""

    batch: list[ScheduledSeq]
    rows: int
    adapters: frozenset
    accounts: set[Account]
    tokens: int
    started: list


class QueueState(Protocol):
    """What the rules read and do: the scheduler's own state (``Scheduler``), or a plan's copy of it."""

    policy: Policy
    max_num_seqs: int
    running: list
    queues: Mapping[Flow, deque]
    held: Collection  # preempted since the last postprocess: their flows wait for it
    order: FairOrder
    seats: Seats
    floods: Floods
    rush: Rush
    prefill_budget: PrefillBudget

    def now(self) -> float: ...
    def decode(self) -> Decodes: ...
    def can_run_now(self, flow: Flow) -> bool: ...
    def can_run(self, flow: Flow) -> bool: ...
    def forget_stale(self) -> None: ...
    def room(self, seq: Any) -> int: ...
    def make_room(self, seq: Any, num_new: int, batch: list[ScheduledSeq]) -> bool: ...
    def admit(self, seq: Any, budget: int) -> tuple[int, int] | None: ...
    def take(self, batch: list[ScheduledSeq], seq: Any, num_new: int, num_cached: int = 0) -> int: ...
    def preempt(self, seq: Any) -> None: ...


def step(q: QueueState) -> list[ScheduledSeq]:
    """The next step of ``q`` under the scheduler's rules: a seat for an account without one (``Seats``),
    every running decode's token, then prefill work (running prompts being chunked and waiting requests)
    in fair order while the step's budget lasts."""
    fair = q.policy is Policy.FAIR
    # a flow without a seat of its account takes one at once (seats.py): (that flow,) or None
    seated = q.seats.trade(q.running, q.queues, q.can_run_now, q.preempt) if fair else None
    decodes = q.decode()
    now = q.now()
    seats_free = len(q.running) < q.max_num_seqs
    # everything that could take prompt tokens this step, in the order it gets them (for a rush, when one of
    # them has a first token promised and not given): prompts being prefilled as the step began (not
    # preempted since) and requests that could start now
    started = [seq for seq in decodes.started if seq.status == RUNNING]
    startable = [flow for flow in q.queues if seats_free and q.can_run_now(flow)]
    promised = any(seq.timing.first_token_due is not None and not seq.output_ids
                   for seq in itertools.chain(started, *(q.queues[flow] for flow in startable)))
    queued = q.order.in_order(started, {flow: q.queues[flow] for flow in startable}) if promised else []
    rushed = q.rush.tokens(now, decodes.rows, decodes.adapters, queued)
    yields_to = q.floods.yields_to(decodes.accounts, now, fair=fair)
    budget = StepBudget(q.prefill_budget, decodes.tokens, decodes.rows, decodes.adapters, rushed, yields_to, q.room)
    q.forget_stale()
    batch = decodes.batch
    passed: set[Flow] = set()
    admitting = True
    while True:
        ongoing = min((seq for seq in decodes.started if seq.status == RUNNING and seq not in budget.prefill),
                      key=q.order.key, default=None)
        waiting = None
        if admitting and len(q.running) < q.max_num_seqs:
            offered = q.queues[seated[0]][0] if seated and seated[0] in q.queues else None
            waiting = offered if offered is not None and offered not in q.held else \
                q.order.next_waiting(q.queues, passed, q.held)
        if ongoing is not None and (waiting is None or q.order.key(ongoing) <= q.order.key(waiting)):
            allowed = budget.allowance(ongoing)
            if allowed <= 0:
                break
            num_new = min(ongoing.num_uncomputed, allowed)
            if q.make_room(ongoing, num_new, batch):
                budget.take(ongoing, q.take(batch, ongoing, num_new))
            continue
        seated = None  # the freed seat is offered once, first
        if waiting is None:
            break
        if not q.can_run(waiting.adapter):
            passed.add(waiting.adapter)
            continue
        allowed = budget.allowance(waiting)
        if allowed <= 0:
            break  # it keeps its turn for the next step
        admitted = q.admit(waiting, allowed)
        if admitted is None:
            admitting = False  # the next request in fair order keeps its turn for KV blocks
            continue
        budget.take(waiting, q.take(batch, waiting, *admitted))
    return batch


class Planned:
    """A request as a plan follows it: what the rules read of a ``Sequence``, and its tokens."""

    __slots__ = ("adapter", "tenant", "arrival", "status", "num_tokens", "num_computed", "max_total", "timing",
                 "output_ids", "started_at_standing", "started_at_computed", "decoding_since", "first_token_s")

    def __init__(self, adapter: Flow, tenant: str | None, arrival: float, num_tokens: int, max_total: float,
                 num_computed: int = 0, status: SequenceStatus = WAITING, timing: Any = None, has_output: bool = False,
                 started_at_standing: float | None = None, started_at_computed: int = 0) -> None:
        self.adapter, self.tenant, self.arrival, self.status = adapter, tenant, arrival, status
        self.num_tokens, self.num_computed, self.max_total = num_tokens, num_computed, max_total
        self.timing = timing if timing is not None else _NO_PROMISE
        self.output_ids = [0] if has_output else []  # only whether it has any is read (``Rush``)
        self.started_at_standing, self.started_at_computed = started_at_standing, started_at_computed
        self.decoding_since: tuple[int, int] | None = None  # (steps done, its tokens then) while it decodes
        self.first_token_s: float | None = None  # seconds into the plan its first planned token came

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @classmethod
    def of(cls, seq: Any, status: SequenceStatus) -> Planned:
        return cls(seq.adapter, seq.tenant, seq.arrival, seq.num_tokens, seq.max_total, seq.num_computed, status,
                   seq.timing, bool(seq.output_ids), seq.started_at_standing, seq.started_at_computed)


@dataclass(frozen=True)
class _Promise:
    """A planned request's ``timing``, as far as the rules read it."""

    first_token_due: float | None = None


_NO_PROMISE = _Promise()


@dataclass(frozen=True)
class Landing:
    """Where a new request lands in the plan: ``seconds`` from the plan's first step to the end of the step
    that computes the last of its prompt (its first token), after ``steps`` steps; ``ahead``: the prompt
    tokens of other requests computed in those steps (prompts being chunked, waiting requests, later
    arrivals, recomputations), ``by_flow`` the same per flow; ``followed``: False when the plan stopped at
    its horizon and the rest was counted at the last step's rate. A request that takes a seat at once and
    whose prompt fits the first step's budget lands after one step."""

    seconds: float
    steps: int
    ahead: int = 0
    followed: bool = True
    by_flow: Mapping[Flow, int] = field(default_factory=dict)


class _Copy:
    """A ``QueueState`` a plan owns: requests as ``Planned``, decodes counted per (flow, tenant) rather than
    walked one by one, KV blocks taken to suffice, adapters as they stand now (``runnable``)."""

    def __init__(self, *, policy: Policy, max_num_seqs: float, max_batched_tokens: int, shares: FairShare,
                 floods: Floods, rush: Rush, prefill_budget: PrefillBudget, runnable: Callable[[Flow], bool],
                 room: int = 1 << 30, start: float = 0.0) -> None:
        self.policy, self.max_num_seqs, self.max_batched_tokens = policy, max_num_seqs, max_batched_tokens
        self.shares, self.floods, self.rush, self.prefill_budget = shares, floods, rush, prefill_budget
        self.order = FairOrder(policy, shares)
        self.seats = Seats(max_num_seqs, shares)  # type: ignore[arg-type]
        self._runnable, self._room, self._start = runnable, room, start
        self.running: list[Planned] = []
        self.queues: dict[Flow, deque[Planned]] = {}
        self.held: list[Planned] = []
        self.prefilling: list[Planned] = []  # running, their prompt (or a recomputation) still being computed
        self.rows = 0  # the decodes of the step being built
        self._decoding: Counter[tuple[Flow, str | None]] = Counter()
        self._ends: list[tuple[float, int, Planned]] = []  # (steps done when it ends, tie, a decoding request)
        self._untokened: list[Planned] = []  # decoding the last token of a prompt: the next step samples
        self.steps = 0  # steps done
        self.elapsed = 0.0  # their seconds
        self.computed: Counter[Flow] = Counter()  # prompt tokens computed, per flow (``Landing.by_flow``)

    # ---- what the plan begins with -----------------------------------------------------------------
    def run(self, seq: Planned) -> None:
        """``seq`` is running as the plan begins."""
        self.running.append(seq)
        if seq.num_uncomputed > 1:
            self.prefilling.append(seq)
        else:
            self._decodes(seq)

    def queue(self, seq: Planned, held: bool = False) -> None:
        """``seq`` waits (``held``: preempted since the last postprocess, its progress not yet reset)."""
        self.queues.setdefault(seq.adapter, deque()).append(seq)
        if held:
            self.held.append(seq)

    def arrive(self, seq: Planned) -> None:
        """``seq`` arrives (``Scheduler.add``)."""
        self.queue(seq)
        self.shares.join(seq.adapter, seq.tenant)

    # ---- the rules' reads and effects (QueueState) -------------------------------------------------
    def now(self) -> float:
        return self._start + self.elapsed

    def can_run_now(self, flow: Flow) -> bool:
        return self._runnable(flow)

    def can_run(self, flow: Flow) -> bool:
        return self._runnable(flow)

    def forget_stale(self) -> None:
        pass

    def room(self, seq: Planned) -> int:
        return self._room

    def make_room(self, seq: Planned, num_new: int, batch: list[ScheduledSeq]) -> bool:
        return True

    def decode(self) -> Decodes:
        rows = 0
        for (flow, tenant), n in self._decoding.items():
            if n:
                self.shares.charge(flow, n, tenant)
                rows += n
        self.rows = min(rows, self.max_batched_tokens)
        keys = [key for key, n in self._decoding.items() if n]
        return Decodes([], self.rows, frozenset(flow for flow, _ in keys if flow is not None),
                       {account_of(flow, tenant) for flow, tenant in keys}, self.max_batched_tokens - self.rows,
                       list(self.prefilling))

    def admit(self, seq: Planned, budget: int) -> tuple[int, int]:
        queue = self.queues[seq.adapter]
        queue.remove(seq)
        if not queue:
            del self.queues[seq.adapter]
        seq.started_at_standing = self.shares.served(seq.adapter)
        seq.started_at_computed = seq.num_computed
        seq.status = RUNNING
        self.running.append(seq)
        self.prefilling.append(seq)
        return min(seq.num_uncomputed, budget), 0

    def take(self, batch: list[ScheduledSeq], seq: Planned, num_new: int, num_cached: int = 0) -> int:
        batch.append(ScheduledSeq(seq, num_new, num_cached))  # type: ignore[arg-type]  # read alike
        self.shares.charge(seq.adapter, num_new, seq.tenant)
        return num_new

    def preempt(self, seq: Planned) -> None:
        self.running.remove(seq)
        if seq.decoding_since is not None:
            seq.num_tokens = self._tokens(seq)
            self._decoding[seq.adapter, seq.tenant] -= 1
            seq.decoding_since = None
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        seq.started_at_standing = None
        seq.status = WAITING
        self.queues.setdefault(seq.adapter, deque()).appendleft(seq)
        self.held.append(seq)

    # ---- the step's postprocess ---------------------------------------------------------------------
    def advance(self, batch: list[ScheduledSeq], step_s: float) -> None:
        """The step of ``batch`` (its prefill; its decodes are counted apart) took ``step_s``: each request's
        progress as ``Progress.record`` and the engine's postprocess leave it."""
        self.elapsed += step_s
        self.steps += 1
        for seq in self.held:
            seq.num_computed = 0
        self.held.clear()
        for seq in self._untokened:  # decoding since before this step, no token yet: this step sampled it
            if seq.decoding_since is not None:
                seq.output_ids.append(0)
                seq.first_token_s = self.elapsed
                self.computed[seq.adapter] += 1  # the last of its prompt, computed as a decode row
        self._untokened.clear()
        for item in batch:
            seq: Planned = item.seq  # type: ignore[assignment]
            seq.num_computed += item.num_cached + item.num_new
            self.computed[seq.adapter] += item.num_new
            if seq.num_uncomputed > 1:
                continue
            self.prefilling.remove(seq)
            if seq.num_uncomputed == 0:  # its prompt (or recomputation) is done: it sampled a token
                seq.num_tokens += 1
                if not seq.output_ids:
                    seq.output_ids.append(0)
                    seq.first_token_s = self.elapsed
            self._decodes(seq)  # one token left to compute: a decode, as the scheduler sees it
        while self._ends and self._ends[0][0] <= self.steps:
            _, _, seq = heapq.heappop(self._ends)
            if seq.decoding_since is not None and self._ends_after(seq) <= self.steps:
                self._decoding[seq.adapter, seq.tenant] -= 1
                seq.decoding_since = None
                self._end(seq)

    def _decodes(self, seq: Planned) -> None:
        """``seq``, one token left to compute, decodes from the next step, a token a step until its
        ``max_total``."""
        if seq.num_tokens >= seq.max_total:  # its last token is sampled: it ends
            self._end(seq)
            return
        seq.decoding_since = (self.steps, seq.num_tokens)
        self._decoding[seq.adapter, seq.tenant] += 1
        if not seq.output_ids:
            self._untokened.append(seq)
        if seq.max_total < math.inf:
            heapq.heappush(self._ends, (self._ends_after(seq), id(seq), seq))

    def _ends_after(self, seq: Planned) -> float:
        since, tokens = seq.decoding_since
        return since + (seq.max_total - tokens)

    def _tokens(self, seq: Planned) -> int:
        since, tokens = seq.decoding_since
        return tokens + self.steps - since

    def _end(self, seq: Planned) -> None:
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.shares.leave(seq.adapter, seq.tenant)

    def shape(self, batch: list[ScheduledSeq]) -> StepShape:
        """The step's shape as ``progress.step_shape`` has it (a one-token entry is a decode row)."""
        prefills = [item.num_new for item in batch if item.num_new > 1]
        adapters = {flow for (flow, _), n in self._decoding.items() if n and flow is not None}
        adapters |= {item.seq.adapter for item in batch if item.seq.adapter is not None}
        return StepShape(self.rows + len(batch) - len(prefills), sum(prefills), len(prefills), len(adapters))

    def left(self) -> int:
        """Prompt tokens still to compute, of the requests running or waiting."""
        return sum(seq.num_uncomputed for seq in self.prefilling) + sum(
            seq.num_uncomputed for queue in self.queues.values() for seq in queue)


def _follow(state: _Copy, step_time: Callable[[StepShape], float], done: Callable[[], bool],
            left: Callable[[], int], horizon_s: float = math.inf, most_steps: int = MAX_STEPS,
            arrivals: Iterable[tuple[float, Planned]] = (), steady: bool = False) -> Landing:
    """Takes ``state``'s steps until ``done()``; past ``horizon_s`` (or ``most_steps`` steps) the tokens
    still ``left()`` to compute count at the last step's rate. ``arrivals``: (seconds into the plan,
    request), soonest first, each arriving before the first step that begins after it. ``steady``: the
    state changes only by its prefill (no decode ends, arrivals, promises or fair shares), so a step that
    repeats the one before it, one prompt's chunk of the same size, repeats until that prompt's last
    chunks, and those repeats are counted at once."""
    coming = iter(arrivals)
    arriving = next(coming, None)
    used, step_s, computed = 0, 0.0, 0  # the last step's prompt tokens and seconds; all prompt tokens computed
    last: tuple | None = None  # the step before: (its one prefill item's request, its tokens), when it had one
    while state.steps < most_steps:
        while arriving is not None and arriving[0] <= state.elapsed:
            state.arrive(arriving[1])
            arriving = next(coming, None)
        batch = step(state)
        step_s = step_time(state.shape(batch))
        used = sum(item.num_new for item in batch)
        computed += used
        state.advance(batch, step_s)
        if done():
            return Landing(state.elapsed, state.steps, computed)
        if state.elapsed > horizon_s:
            break
        now = (batch[0].seq, batch[0].num_new) if len(batch) == 1 else None
        if steady and now is not None and now == last and not state.queues:
            seq, tokens = now
            repeats = min((seq.num_uncomputed - 2) // tokens, most_steps - state.steps)
            if repeats > 0:
                seq.num_computed += repeats * tokens
                computed += repeats * tokens
                state.computed[seq.adapter] += repeats * tokens
                state.steps += repeats
                state.elapsed += repeats * step_s
        last = now
    rest = left()
    if used <= 0:  # a step that prefilled nothing: the plan's rate so far, or one step's of the most tokens
        used, step_s = (computed, state.elapsed) if computed else (
            state.max_batched_tokens, step_time(StepShape(0, state.max_batched_tokens, 1)))
    return Landing(state.elapsed + rest / max(1, used) * step_s, state.steps, computed, followed=False)


class QueuePlan:
    """The plan of a scheduler's queue from now on (``Scheduler.plan``): a copy of its state (``running``:
    the running requests, in admission order; ``queues``: each flow's waiting ones, in order; ``held``: those
    preempted since the last postprocess; ``shares``, ``floods``: its counters and floods), the rules' limits
    and parts, ``runnable(flow)``: whether a flow's adapter lets it start now, ``room``: the tokens the free
    KV blocks hold, ``arrivals``: the flows' recent arrivals, ``step_time(shape)``: a step's predicted
    seconds, ``start``: when its first step begins (``time.monotonic()`` seconds)."""

    def __init__(self, *, policy: Policy, max_num_seqs: int, max_batched_tokens: int, running: Iterable[Any],
                 queues: Mapping[Flow, Iterable[Any]], held: Collection[Any], shares: FairShare, floods: Floods,
                 rush: Rush, prefill_budget: PrefillBudget, runnable: Callable[[Flow], bool], room: int,
                 arrivals: Arrivals, step_time: Callable[[StepShape], float], start: float) -> None:
        self._limits = dict(policy=policy, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                            rush=rush, prefill_budget=prefill_budget, room=room, start=start)
        self._running = [seq for seq in running if seq.status == RUNNING]
        self._queues = {flow: list(queue) for flow, queue in queues.items()}
        self._held = set(held)
        self._shares, self._floods, self._runnable = shares, floods, runnable
        self._arrivals, self._step_time, self._start = arrivals, step_time, start
        self._known = {flow: runnable(flow) for flow in self._queues}  # adapters as they stand now

    def landing(self, flow: Flow, tenant: str | None, prompt_tokens: int, horizon_s: float = math.inf,
                due: float | None = None) -> Landing:
        """Where a new request of ``flow`` billed to ``tenant`` with ``prompt_tokens`` would land: when its
        first token would come, the plan followed up to ``horizon_s`` seconds (then the rest at the last
        step's rate). Later arrivals of other flows come as ``Arrivals.coming`` expects them and take the
        turns the rules give them (its own flow's queue behind it); its own flow runs as soon as the rules
        let it (its adapter is loaded and in a slot for it). ``due``: when its first token would be promised
        by, so that the plan rushes steps for it as the scheduler would; admission plans without (a rush is
        for a wait the estimate got wrong, not one to admit by)."""
        runnable = {**self._known, flow: True}
        state = _Copy(shares=copy.deepcopy(self._shares), floods=copy.deepcopy(self._floods),
                      runnable=lambda f: runnable[f] if f in runnable else self._runnable(f), **self._limits)
        for seq in self._running:
            state.run(Planned.of(seq, RUNNING))
        for queue in self._queues.values():
            for seq in queue:
                state.queue(Planned.of(seq, WAITING), held=seq in self._held)
        now = time.monotonic()
        new = Planned(flow, tenant, now, prompt_tokens, prompt_tokens + 1, timing=_Promise(due))
        state.arrive(new)
        late = self._start - now  # the plan's first step begins this long after now
        coming = ((at - late, Planned(f, t, now + at, prompt, prompt + completion)) for at, f, t, prompt, completion
                  in self._arrivals.coming(min(horizon_s, self._arrivals.window_s) + late, now, besides=flow))

        def left() -> int:  # its own prompt, and the prompt tokens before it in fair order
            key = state.order.key(new)
            others = [*state.prefilling, *(seq for queue in state.queues.values() for seq in queue)]
            return new.num_uncomputed + sum(seq.num_uncomputed for seq in others
                                            if seq is not new and state.order.key(seq) < key)

        most_steps = FOLLOWED_STEPS if horizon_s < math.inf else UNBOUNDED_STEPS
        landing = _follow(state, self._step_time, lambda: new.first_token_s is not None, left, horizon_s, most_steps,
                          coming)
        by_flow = state.computed
        by_flow[flow] -= prompt_tokens if new.first_token_s is not None else new.num_computed  # its own
        by_flow = {f: tokens for f, tokens in by_flow.items() if tokens > 0}
        return Landing(landing.seconds, landing.steps, sum(by_flow.values()), landing.followed, by_flow)


def work_plan(work: Iterable[tuple[int, Flow]], decodes: int, decode_adapters: Collection[Flow],
              prefill_budget: PrefillBudget, step_time: Callable[[StepShape], float], max_batched_tokens: int,
              enough_s: float = math.inf) -> float:
    """Seconds until the last of ``work`` ((prompt tokens, flow), in the order given) is computed under the
    rules, beside ``decodes`` decodes over ``decode_adapters`` that run on (no seat is short: a caller without
    the scheduler's state counts seats apart), each item decoding once its prompt is done: a plan for a
    caller that has only a list of work (``DelayEstimator``: a prompt's own prefill). Past ``enough_s`` (or
    MAX_STEPS steps) the rest counts at the last step's rate."""
    state = _Copy(policy=Policy.FCFS, max_num_seqs=math.inf, max_batched_tokens=max_batched_tokens,
                  shares=FairShare(), floods=Floods(), rush=Rush(prefill_budget, step_time),
                  prefill_budget=prefill_budget, runnable=lambda flow: True)
    adapters = [flow for flow in decode_adapters if flow is not None]
    for i in range(decodes):
        state.run(Planned(adapters[i] if i < len(adapters) else None, None, -1.0, 1, math.inf, status=RUNNING))
    for i, (tokens, flow) in enumerate(work):
        if tokens > 0:
            state.queue(Planned(flow, None, float(i), tokens, math.inf))
    if not state.queues:
        return 0.0
    return _follow(state, step_time, lambda: not state.queues and not state.prefilling, state.left, enough_s,
                   steady=True).seconds

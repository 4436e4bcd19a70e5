"""Decides which sequences run in the next step and how many of their tokens, and holds what that reads.

Words: a *flow* is what requests queue by, an adapter or the base model (None); an *account* is who is
served, the request's tenant (the router's customer, ``Sequence.tenant``) or, without one, its flow
(``fair_share.py``). The rules of a step are ``queue_plan.step``, applied here to the scheduler's own
state (``schedule``) and by the plan of the queue to a copy of it, step after step (``plan``: where a
new request would land, for admission). Each step, every running decode gets its next token first, in
the order they were admitted. Prefill work fills the rest of the step, up to the step's prefill budget
(``step_budget.py``: the step stays near its target inter-token latency unless a first-token promise is
at risk): prompts being chunked across steps and newly admitted requests, in fair order
(``fair_order.py``): the least-served flow first (each account has a virtual token counter), its oldest
request first; a started prompt keeps the standing it started with for its first STARTED_QUANTUM tokens,
so prompts finish in the order they started rather than side by side a few tokens each. Under ``fcfs``
the oldest request goes first. A waiting request is admitted while a seat (``max_num_seqs``;
``seats.py``), its KV blocks and its adapter (``slot_reservations.py``) allow; when its KV blocks do not
fit, nothing else is admitted this step, so it is not overtaken. The streams of accounts flooding the
pod yield to other accounts' prompts (``floods.py``). When blocks run out, the most recently admitted
running sequence of the most-served flow (under FCFS: the most recently admitted one) gives its blocks
back and is recomputed later from its prompt plus what it has generated, first of its flow, from the
step after the one that preempted it (whose postprocess resets its progress). ``postprocess`` is the one
writer of a sequence's progress.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from data_plane.engine.admission import Arrivals, Load
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.fair_order import STARTED_QUANTUM, FairOrder, Policy
from data_plane.engine.fair_share import Account, FairShare, Flow, account_of
from data_plane.engine.floods import Floods
from data_plane.engine.progress import Progress, ScheduledSeq
from data_plane.engine.queue_plan import Decodes, QueuePlan, step
from data_plane.engine.seats import Seats
from data_plane.engine.sequence import Sequence, SequenceStatus
from data_plane.engine.slot_reservations import SlotReservations
from data_plane.engine.step_budget import PrefillBudget, Rush
from data_plane.engine.step_cost import StepShape
from data_plane.errors import CapacityExceeded
from data_plane.lora.adapter_cache import AdapterCache


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockManager, cache: AdapterCache | None,
                 adapter_ready: Callable[[str], bool], weights: Mapping[Flow, float] | None = None,
                 policy: Policy = Policy.FAIR, salt: Callable[[Sequence], str] = lambda seq: "",
                 prefill_budget: PrefillBudget | None = None, join_credit: float = STARTED_QUANTUM,
                 step_time: Callable[[StepShape], float] | None = None) -> None:
        """``weights``: a flow's share relative to the others (default 1.0; None names the base model), under
        the FAIR policy; ``salt``: what a flow's cached prefix blocks are keyed under besides their tokens;
        ``prefill_budget``: ``step_budget.PrefillBudget`` (default: all that ``max_num_batched_tokens``
        leaves); ``join_credit``: the tokens an account that becomes active starts below the least-served
        active one (``FairShare``); ``step_time(shape)``: a step's expected seconds (``StepCost.predict``;
        default 0: no promise is seen at risk before it is due)."""
        self._salt = salt
        self.prefill_budget: PrefillBudget = prefill_budget or (lambda *_: limits.max_num_batched_tokens)
        self._step_time = step_time or (lambda *_: 0.0)
        self.rush = Rush(self.prefill_budget, self._step_time)
        self.limits = limits
        self.policy = policy
        self.blocks = blocks
        self.cache = cache
        self.slots = SlotReservations(cache, adapter_ready)
        self.shares = FairShare(weights, join_credit)
        self.order = FairOrder(policy, self.shares)
        self.seats = Seats(limits.max_num_seqs, self.shares)
        self.floods = Floods()
        self.queues: dict[Flow, deque[Sequence]] = {}  # backlogged flows only
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.progress = Progress(blocks)
        self.arrivals = Arrivals()

    @property
    def waiting(self) -> list[Sequence]:
        """Every waiting request, flow by flow, each flow's in the order they will be admitted."""
        return [seq for queue in self.queues.values() for seq in queue]

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self.queues.values())

    def add(self, seq: Sequence) -> None:
        """Queues ``seq``; raises CapacityExceeded, queuing nothing, if it could never run (``refused``)."""
        error = self.slots.refusal(seq.adapter)
        if error is not None:
            raise error
        self.queues.setdefault(seq.adapter, deque()).append(seq)
        self.shares.join(seq.adapter, seq.tenant)
        self.arrivals.record(seq.adapter, seq.num_tokens, time.monotonic(), seq.max_total - seq.num_tokens, seq.tenant)

    def refused(self) -> list[tuple[Sequence, CapacityExceeded]]:
        """Waiting requests that can never run since pins changed, with their errors; the caller ends them."""
        return self.slots.refused(self.queues)

    def load(self) -> Load:
        """What is running now, for the admission estimate."""
        decoding = [seq for seq in self.running if seq.num_uncomputed <= 1]
        return Load(len(decoding), frozenset(seq.adapter for seq in decoding if seq.adapter is not None))

    def expired(self, now: float) -> list[Sequence]:
        """Waiting requests whose deadline has passed; the caller ends them."""
        return [seq for seq in self.waiting if seq.deadline is not None and seq.deadline <= now]

    def has_work(self) -> bool:
        return bool(self.running) or any(self.slots.ready(s.adapter) for s in self.waiting)

    def turned_away(self, flow: Flow, tenant: str | None = None) -> None:
        """The pod refused a request of ``flow`` billed to ``tenant`` for want of room (queue full, or a first
        token estimated past its promise); its account floods the pod if a request of its own waits here."""
        account = account_of(flow, tenant)
        if any(account_of(seq.adapter, seq.tenant) == account for seq in self.waiting):
            self.floods.turned_away(account, time.monotonic())

    def flooding(self, now: float) -> set[Account]:
        """The accounts flooding the pod (``floods.py``)."""
        return self.floods.flooding(now)

    def schedule(self) -> list[ScheduledSeq]:
        """The next step: the rules (``queue_plan.step``) applied to the scheduler's own state, the first
        step of its plan."""
        return step(self)

    def plan(self, begins_in_s: float = 0.0) -> QueuePlan:
        """The plan of the queue from the step after the one in flight (``begins_in_s`` from now on), for
        admission: where a new request would land (``QueuePlan.landing``)."""
        return QueuePlan(policy=self.policy, max_num_seqs=self.max_num_seqs,
                         max_batched_tokens=self.limits.max_num_batched_tokens, running=self.running,
                         queues=self.queues, held=self.held, shares=self.shares, floods=self.floods, rush=self.rush,
                         prefill_budget=self.prefill_budget, runnable=self.slots.can_run_now,
                         room=self.blocks.num_available * self.blocks.block_size, arrivals=self.arrivals,
                         step_time=self._step_time, start=time.monotonic() + begins_in_s)

    # ---- the rules' reads and effects on this state (queue_plan.QueueState) ------------------------------
    @property
    def max_num_seqs(self) -> int:
        return self.limits.max_num_seqs

    @property
    def held(self) -> list[Sequence]:
        return self.progress.preempted

    def now(self) -> float:
        return time.monotonic()

    def can_run_now(self, flow: Flow) -> bool:
        return self.slots.can_run_now(flow)

    def can_run(self, flow: Flow) -> bool:
        return self.slots.can_run(flow, (seq.adapter for seq in self.running))

    def forget_stale(self) -> None:
        self.slots.forget_stale(self.queues)

    def room(self, seq: Sequence) -> int:
        return self.blocks.room(seq)

    def decode(self) -> Decodes:
        """Every running decode's next token, in admission order, while the step's tokens last; the running
        prompts (or recomputations) still being computed, read in the same walk: progress changes only in
        the step's postprocess, so none becomes a decode, nor a decode one of them, before it."""
        budget = self.limits.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        room = self.blocks.block_size  # tokens a block holds
        started: list[Sequence] = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue
            uncomputed = seq.num_uncomputed
            if uncomputed > 1:
                started.append(seq)
            # A spent budget takes no more decodes; a sequence whose pending last token reaches its length ends
            # when that token is settled, and computes nothing more.
            if uncomputed != 1 or budget <= 0 or seq.num_tokens >= seq.max_total:
                continue
            if seq.num_computed < len(seq.block_table) * room:  # its token fits its last block: nothing to allocate
                batch.append(ScheduledSeq(seq, 1))
                self.shares.charge(seq.adapter, 1, seq.tenant)
                budget -= 1
            elif self.make_room(seq, 1, batch):
                budget -= self.take(batch, seq, 1)
        return Decodes(batch, len(batch), frozenset(item.seq.adapter for item in batch if item.seq.adapter is not None),
                       {account_of(item.seq.adapter, item.seq.tenant) for item in batch}, budget, started)

    def admit(self, seq: Sequence, budget: int) -> tuple[int, int] | None:
        """Moves waiting ``seq`` to running with its cached prefix matched; returns (tokens to compute this
        step, cached tokens), or None, changing nothing, when its KV blocks do not fit."""
        num_cached = self.blocks.match_prefix(seq, self._salt(seq))
        num_new = min(seq.num_uncomputed - num_cached, budget)
        if not self.blocks.can_allocate(seq, num_cached + num_new):
            self.blocks.free(seq)  # the matched blocks go back, still cached
            return None
        if self.blocks.prefix is not None:
            self.blocks.prefix.record_lookup(seq.num_tokens, num_cached)
        if seq.adapter is not None:
            seq.slot = self.slots.acquire(seq.adapter)
        self._dequeue(seq)
        seq.started_at_standing = self.shares.served(seq.adapter)
        seq.started_at_computed = seq.num_computed + num_cached  # cached tokens were never computed for it
        seq.status = SequenceStatus.RUNNING
        if seq.timing.first_scheduled is None:
            seq.timing.first_scheduled = time.monotonic()
        self.running.append(seq)
        return num_new, num_cached

    def take(self, batch: list[ScheduledSeq], seq: Sequence, num_new: int, num_cached: int = 0) -> int:
        self.blocks.allocate(seq, num_cached + num_new)
        batch.append(ScheduledSeq(seq, num_new, num_cached))
        self.shares.charge(seq.adapter, num_new, seq.tenant)
        return num_new

    def postprocess(self, batch: list[ScheduledSeq], token_ids: list[int | None], ran: bool = True) -> int:
        """``Progress.record``: what the step did to each sequence's progress, its one writer."""
        return self.progress.record(batch, token_ids, ran)

    def settle(self, seq: Sequence, token_id: int | None) -> None:
        """``Progress.settle``: ``seq``'s pending token read from the device."""
        self.progress.settle(seq, token_id)

    def finish(self, seq: Sequence) -> None:
        """Frees everything ``seq`` holds; safe to call in any state, once or more."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
            self.shares.leave(seq.adapter, seq.tenant)
        elif seq in self.queues.get(seq.adapter, ()):
            self._dequeue(seq)
            self.shares.leave(seq.adapter, seq.tenant)
        seq.status = SequenceStatus.FINISHED

    def _dequeue(self, seq: Sequence) -> None:
        queue = self.queues[seq.adapter]
        queue.remove(seq)
        if not queue:
            del self.queues[seq.adapter]

    # ---- release and preemption ------------------------------------------------------------
    def make_room(self, seq: Sequence, num_new: int, batch: list[ScheduledSeq]) -> bool:
        """Makes KV room for ``num_new`` more tokens of running ``seq``, preempting others not in ``batch``
        (``FairOrder.victim``) if needed; when even that is not enough ``seq`` itself is preempted and False
        returned."""
        if self.blocks.can_allocate(seq, num_new):  # the common case, without a set of the step's sequences
            return True
        keep = {seq, *(item.seq for item in batch)}
        while not self.blocks.can_allocate(seq, num_new):
            victim = self.order.victim(other for other in self.running if other not in keep)
            if victim is None:
                break
            self.preempt(victim)
        if self.blocks.can_allocate(seq, num_new):
            return True
        self.preempt(seq)
        return False

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.slot >= 0:
            self.cache.release(seq.adapter)
            seq.slot = -1

    def preempt(self, seq: Sequence) -> None:
        """``seq`` gives its blocks and slot back and waits again, first of its flow."""
        self.running.remove(seq)
        self._release(seq)
        seq.started_at_standing = None
        seq.status = SequenceStatus.WAITING
        self.queues.setdefault(seq.adapter, deque()).appendleft(seq)
        self.progress.preempted.append(seq)
        self.num_preemptions += 1

"""Decides which sequences run in the next step and how many of their tokens.

Decodes first: every running sequence past its prompt gets its next token each step, in the order
they were admitted. Prefill work fills the rest of the step, up to the prefill budget the step-time
model allows (``step_cost.py``: the step stays near its target inter-token latency), asked again for
each prefilling sequence the step takes with the adapters the prefill brings, so a prompt of an
adapter the decodes have not got, or a second prompt in the step, pays its own cost from the same
target instead of stretching the step past it: prompts being
chunked across steps and newly admitted requests, by fair share: each tenant (an adapter, or the
base model) has a virtual token counter (``fair_share.py``), and the next prefill work is the oldest
of the least-served tenant, whether its prompt is already being chunked or still waits (then while
seats, KV blocks and its adapter allow); within a tenant, arrival order. A started prompt keeps the
standing it started with for its first STARTED_QUANTUM tokens (``_order``), so prompts are finished
in the order they started rather than side by side a few tokens each. So a new tenant's prompt
is not stuck behind a flood's long prompts. A tenant that becomes active starts a quantum below the
least-served active tenant (``FairShare``'s join credit), so a tenant sending a request now and then
goes ahead of a flood's started prompts instead of waiting for each of them. Under the ``fcfs``
policy the oldest request goes first. When a waiting request's KV blocks do not fit, nothing else is
admitted this step, so it is not overtaken.

A tenant whose adapter is still loading, or cannot get a slot (every slot pinned or serving), is
passed over for the step: requests of the base model and of adapters in slots go ahead of it.

Slot bound: a tenant that cannot get a slot reserves the unpinned adapter in a slot with the
fewest running requests; that adapter admits nothing new until the waiting tenant holds a slot,
so its running requests finish (bounded by their max_tokens), its slot becomes evictable, and
the waiting tenant takes it. A request that can never get a slot, because every slot holds
another pinned adapter, is refused (``refusal``) instead of waiting for ever.

Seats: under fair share, when every seat (``max_num_seqs``) is taken and a backlogged tenant that
can run has no request running, the tenant holding the most seats (ties: the most served) gives up
its latest admitted request, which is queued again first of its tenant: a tenant's first request
waits one step, not for a seat to turn over behind another tenant's burst. Only a tenant with no
seat takes one, and only from a tenant with more than one, so two busy tenants never trade seats
back and forth.

Floods: a step's decodes keep their pace (the step budget) against every prompt, except where they all
belong to accounts flooding the pod, i.e. whose requests it turned away (queue full, or a first token
estimated past its promise: ``turned_away``) within the last FLOOD_MEMORY_S while they had a request of
their own waiting, and the prompt is of an account that does not flood it. Then the step carries that
prompt as a pod with nothing else running would, all of it that ``max_num_batched_tokens`` and the free
KV blocks leave: the flood's streams get a longer gap (one per such prompt up to a step's tokens), and
the other account's first token comes about as soon as on an idle pod instead of after the many steps a
prompt takes at the streams' pace (on the CPU pod a long prompt beside decodes takes about ``g/(g-1)``
times its prefill alone at an ``--itl-growth`` of ``g``; at the throughput knee, as a rush, two or three
steps of it took more than twice its prefill alone). So one account that asks more than the pod can
take does not multiply the first-token time of those that do not, and streams of an account that keeps
within the pod's room are never slowed beyond their pace for another account's prompt (a burst of new
prompts beside them included; a rush aside). A prompt's own account's streams yield to it too, only
while the rest of the decodes flood. In the spirit of the sparse-flow priority of FQ-CoDel (RFC 8290):
a flow with no standing queue goes ahead of those with one. FAIR policy only.

Preemption: when blocks run out, the most recently admitted running sequence of the most-served
tenant (under FCFS: the most recently admitted one) gives its blocks back (so fair admission is not
undone by preempting the newcomer it let in); it is recomputed later from its prompt plus what it
has generated, first of its tenant, from the step after the one that preempted it (whose postprocess
resets its progress).
"""

from __future__ import annotations

import enum
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from data_plane.engine.admission import Ahead, Arrivals, Load
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.fair_share import Account, FairShare, account_of
from data_plane.engine.fair_share import Flow as Tenant  # a flow (fair_share.py), not a router tenant
from data_plane.engine.sequence import PENDING, Sequence, SequenceStatus
from data_plane.engine.step_cost import StepShape
from data_plane.errors import CapacityExceeded
from data_plane.lora.adapter_cache import AdapterCache


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed for it this step
    num_cached: int = 0  # tokens after its computed ones found in the prefix cache at admission (not computed)

    @property
    def samples(self) -> bool:
        """True when this step completes the sequence's known tokens, so it gets a next token."""
        return self.seq.num_computed + self.num_cached + self.num_new == self.seq.num_tokens


def step_shape(batch: list[ScheduledSeq]) -> StepShape:
    """What a step computes, as the step-time model reads it: a one-token entry is a decode row."""
    prefills = [item.num_new for item in batch if item.num_new > 1]
    return StepShape(len(batch) - len(prefills), sum(prefills), len(prefills),
                     len({item.seq.slot for item in batch if item.seq.slot >= 0}))


_NOBODY = object()  # no tenant (None is the base model's name)
# Seconds an account counts as flooding the pod after a request of its was turned away (see Floods).
FLOOD_MEMORY_S = 10.0
# Prompt tokens a started prompt computes at the standing it started with before it shares the prefill
# budget with other tenants' work (see Scheduler._order).
STARTED_QUANTUM = 128


class Policy(enum.Enum):
    """The order waiting requests are admitted in (the pod's --scheduling-policy)."""

    FAIR = "fair"  # least-served tenant first, arrival order within a tenant
    FCFS = "fcfs"  # arrival order across all tenants


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockManager, cache: AdapterCache | None,
                 adapter_ready: Callable[[str], bool], weights: Mapping[Tenant, float] | None = None,
                 policy: Policy = Policy.FAIR, salt: Callable[[Sequence], str] = lambda seq: "",
                 prefill_budget: Callable[[int, int, bool, int, int], int] | None = None,
                 join_credit: float = STARTED_QUANTUM,
                 step_time: Callable[[StepShape], float] | None = None) -> None:
        """``weights``: a tenant's share relative to the others (default 1.0; None names the base model),
        under the FAIR policy; ``salt``: what a tenant's cached prefix blocks are keyed under besides their
        tokens (its adapter's content and the pod's precision); ``prefill_budget(decode_rows, adapters, rush,
        prefill_seqs, new_adapters)``: the prefill tokens a step with those decodes over those adapters may
        carry in that many prefilling sequences, which bring that many adapters the decodes have not got,
        ``rush`` when an admitted request's first-token promise is at risk (``StepCost.prefill_budget``;
        default: all that ``max_num_batched_tokens`` leaves); ``join_credit``: the tokens a tenant that
        becomes active starts below the least-served active one (``FairShare``); ``step_time(shape)``: the
        seconds a step of that shape is expected to take (``StepCost.predict``; default 0: no promise is
        seen at risk before it is due)."""
        self._salt = salt
        self._prefill_budget = prefill_budget or (lambda *_: limits.max_num_batched_tokens)
        self._step_time = step_time or (lambda *_: 0.0)
        self.limits = limits
        self.policy = policy
        self.blocks = blocks
        self.cache = cache
        self._adapter_ready = adapter_ready  # False while the adapter is still being loaded
        self.shares = FairShare(weights, join_credit)
        self._queues: dict[Tenant, deque[Sequence]] = {}  # backlogged tenants only
        self.running: list[Sequence] = []
        self._reserved: dict[str, str] = {}  # adapter waiting for a slot -> adapter it waits to take it from
        self.num_preemptions = 0
        self._preempted: list[Sequence] = []  # preempted since the last postprocess, which resets their progress
        self.arrivals = Arrivals()
        # account -> when the pod last refused it room (Floods), the least recent first
        self._turned_away: OrderedDict[Account, float] = OrderedDict()

    @property
    def waiting(self) -> list[Sequence]:
        """Every waiting request, tenant by tenant, each tenant's in the order they will be admitted."""
        return [seq for queue in self._queues.values() for seq in queue]

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def add(self, seq: Sequence) -> None:
        """Queues ``seq``; raises CapacityExceeded, queuing nothing, if it could never run (``refusal``)."""
        error = self.refusal(seq.adapter)
        if error is not None:
            raise error
        self._queues.setdefault(seq.adapter, deque()).append(seq)
        self.shares.join(seq.adapter, seq.tenant)
        self.arrivals.record(seq.adapter, seq.num_tokens, time.monotonic())

    def refusal(self, adapter: str | None) -> CapacityExceeded | None:
        """The error a request for ``adapter`` ends with because it can never run here (every slot
        holds another pinned adapter), else None. Checked by ``add`` and, as pins change, ``refused``."""
        if adapter is None or self.cache is None or not self.cache.pinned_out(adapter):
            return None
        return CapacityExceeded(
            f"adapter {adapter!r} cannot run on this pod: all {self.cache.max_loras} adapter slots hold pinned "
            "adapters; unpin one or raise --max-loras, or send the request to a pod that serves it"
        )

    def refused(self) -> list[tuple[Sequence, CapacityExceeded]]:
        """Waiting requests that can never run since pins changed, with their errors; the caller ends them."""
        out = []
        for tenant, queue in self._queues.items():
            error = self.refusal(tenant)
            if error is not None:
                out += [(seq, error) for seq in queue]
        return out

    def ahead_of(self, tenant: Tenant, prompt_tokens: int, within_s: float = 0.0,
                 billed_to: str | None = None) -> Ahead:
        """The prefill work a new request of ``tenant`` (billed to ``billed_to``: its account, for whether it
        would take a seat at once) with ``prompt_tokens`` would come after, as the
        policy orders it: prompts being chunked and waiting requests. Under FCFS all of them. Under fair
        share its own tenant's, and of each other tenant the tokens it is served before the new request's
        prompt is done: fair shares are counted in tokens, so prompts of several tenants are prefilled side
        by side, chunk by chunk, and another tenant goes on until its counter reaches what the new
        request's tenant's will be then (scaled by the weights). Requests of other tenants that arrive
        while it waits take their share too: ``within_s`` (the wait it would have) counts those expected
        at each tenant's recent rate, each of that tenant's recent mean prompt size (the engine passes the
        time until the new request's prompt would start: once started, later arrivals no longer go first).
        Shares are an account's (``fair_share.py``): a tenant's adapters are counted against one share."""
        chunking: dict[Tenant, list[Sequence]] = {}  # prompts being chunked share the prefill budget
        for seq in self._prefilling():
            chunking.setdefault(seq.adapter, []).append(seq)
        own = [*chunking.get(tenant, ()), *self._queues.get(tenant, ())]
        # its tenant's counter once its prompt is done
        done_at = self.shares.standing(tenant, billed_to) + (sum(seq.num_uncomputed for seq in own) +
                                                             prompt_tokens) / self.shares.weight(tenant)
        own_account = account_of(tenant, billed_to)
        now = time.monotonic()
        requests = 0
        sizes: list[int] = []
        adapters: list[Tenant] = []  # each size's adapter
        left: dict[Account, float] = {}  # each other account's share still to count, over all its adapters
        for other in {*self._queues, *chunking, *self.arrivals.recent(now)}:
            queue = [*chunking.get(other, ()), *self._queues.get(other, ())]
            work = [seq.num_uncomputed for seq in queue]
            share, account = math.inf, None
            if self.policy is Policy.FAIR and other != tenant:
                coming = self.arrivals.expected(other, within_s, now)
                if not work and not coming:
                    continue
                account = account_of(other, queue[0].tenant if queue else None)
                if account == own_account:  # its tenant's work on its other adapters: all of it goes first
                    account = None
                elif account not in left:
                    left[account] = max(0.0, (done_at - self.shares.standing(other)) * self.shares.weight(other))
            if account is not None:
                share = left[account]
                mean = max(1, self.arrivals.mean_prompt(other))
                work += [mean] * min(coming, math.ceil(share / mean))  # no more than its share can take
            for i, size in enumerate(work):
                if share < 1:
                    break
                sizes.append(size if size <= share else math.ceil(share))
                adapters.append(other)
                share -= size
                requests += i >= len(chunking.get(other, ()))  # it still needs a seat
            if account is not None:
                left[account] = max(0.0, share)
        return Ahead(requests, sum(sizes), seat_now=self._would_take_a_seat(tenant, billed_to), sizes=tuple(sizes),
                     adapters=tuple(adapters))

    def _would_take_a_seat(self, tenant: Tenant, billed_to: str | None) -> bool:
        """Whether a new request of ``tenant`` billed to ``billed_to`` would take a seat at the next step
        (see Seats above)."""
        if self.policy is not Policy.FAIR or tenant in self._queues:
            return False
        seats = self._seats()
        return account_of(tenant, billed_to) not in seats and max(seats.values(), default=0) >= 2

    def load(self) -> Load:
        """What is running now, for the admission estimate."""
        decoding = [seq for seq in self.running if seq.num_uncomputed <= 1]
        return Load(len(self.running), len(decoding), tuple(seq.max_total - seq.num_tokens for seq in self.running),
                    frozenset(seq.adapter for seq in decoding if seq.adapter is not None))

    def expired(self, now: float) -> list[Sequence]:
        """Waiting requests whose deadline has passed; the caller ends them."""
        return [seq for seq in self.waiting if seq.deadline is not None and seq.deadline <= now]

    def has_work(self) -> bool:
        return bool(self.running) or any(self._admissible(s) for s in self.waiting)

    def schedule(self) -> list[ScheduledSeq]:
        """The next step: every running decode's token first, then prefill work (running prompts being
        chunked, and newly admitted requests) in fair order while the prefill budget lasts."""
        budget = self.limits.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        seated = self._free_a_seat_for_a_tenant_without_one() if self.policy is Policy.FAIR else _NOBODY
        room = self.blocks.block_size  # tokens a block holds
        # Running prompts (or recomputations) still being computed, read in the same walk: progress changes
        # only in the step's postprocess, so none becomes a decode, nor a decode one of them, before it.
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
            elif self._make_room(seq, 1, batch):
                budget -= self._take(batch, seq, 1)
        decodes = len(batch)
        decode_adapters = {item.seq.adapter for item in batch if item.seq.adapter is not None}
        now = time.monotonic()
        rushed = self._rushed_budget(now, decodes, decode_adapters, started)
        flooding = self.flooding(now)
        decode_accounts = {account_of(item.seq.adapter, item.seq.tenant) for item in batch} if flooding else set()
        prefill: list[Sequence] = []  # given prompt tokens this step
        used = 0  # their tokens

        def allowance(seq: Sequence) -> int:
            """Prompt tokens ``seq`` may have beside the decodes and the prefill taken so far: the budget for
            one more prefilling sequence, counting the adapter it brings if the step has not got it yet."""
            new = {s.adapter for s in (*prefill, seq) if s.adapter is not None} - decode_adapters
            unrushed = self._prefill_budget(decodes, len(decode_adapters), False, len(prefill) + 1, len(new))
            if rushed > unrushed:  # a rush is held to the knee's budget for this many sequences and adapters
                unrushed = max(unrushed, min(rushed, self._prefill_budget(decodes, len(decode_adapters), True,
                                                                          len(prefill) + 1, len(new))))
            paced = min(budget, unrushed - used)
            if flooding and self._streams_yield_to(seq, decode_accounts, flooding):
                # all the step holds, as on a pod with nothing else running (see Floods), as far as free KV
                # blocks go: more would preempt, or keep a waiting request out, where its pace would not
                return max(paced, min(budget, self.blocks.room(seq)))
            return paced

        self._forget_stale_reservations()
        passed: set[Tenant] = set()
        admitting = True
        while True:
            taken = {item.seq for item in batch}
            ongoing = min((seq for seq in started if seq.status == SequenceStatus.RUNNING and seq not in taken),
                          key=self._order, default=None)
            waiting = None
            if admitting and len(self.running) < self.limits.max_num_seqs:
                waiting = self._queues[seated][0] if seated in self._queues else self._next_in_fair_order(passed)
            if ongoing is not None and (waiting is None or self._order(ongoing) <= self._order(waiting)):
                allowed = allowance(ongoing)
                if allowed <= 0:
                    break
                num_new = min(ongoing.num_uncomputed, allowed)
                if self._make_room(ongoing, num_new, batch):
                    used += self._take(batch, ongoing, num_new)
                    budget -= num_new
                    prefill.append(ongoing)
                continue
            seated = _NOBODY  # the freed seat is offered once, first
            if waiting is None:
                break
            tenant = waiting.adapter
            if not self._can_run(tenant):
                passed.add(tenant)
                continue
            allowed = allowance(waiting)
            if allowed <= 0:
                break  # it keeps its turn for the next step
            admitted = self._admit(waiting, allowed)
            if admitted is None:
                admitting = False  # the next request in fair order keeps its turn for KV blocks
                continue
            used += self._take(batch, waiting, *admitted)
            budget -= admitted[0]
            prefill.append(waiting)
        return batch

    def _rushed_budget(self, now: float, decodes: int, decode_adapters: set[str], started: list[Sequence]) -> int:
        """The prompt tokens this step must carry so that every request admitted with a first-token promise,
        prefilling or able to start now (a seat free, its adapter ready and in a slot), gets its first token
        by when it is due; 0 while the unrushed budget keeps them all. A request's work is the prompt
        tokens ahead of it in order (prompts being prefilled, and requests waiting that could start now)
        and its own, computed a step's budget at a time beside these decodes,
        with one step more for the error of a step's prediction; a request that falls behind that pace
        asks for just the tokens a step that keeps it needs (at most the device's throughput knee,
        ``StepCost``), so a wait the admission estimate got wrong is made up with the smallest longer
        gaps for running streams, instead of a broken promise. A request that could not run this step
        asks for nothing. ``started``: the running sequences whose prompts were being computed as the step
        began."""
        seated = len(self.running) < self.limits.max_num_seqs
        # everything that could take prompt tokens this step, in the order it gets them
        prefilling = [seq for seq in started if seq.status == SequenceStatus.RUNNING]  # not preempted since
        startable = [seq for seq in self.waiting if seated and self._can_run_now(seq.adapter)]
        queued = sorted(((self._order(seq), seq) for seq in (*prefilling, *startable)), key=lambda item: item[0])
        adapters, needed, work = len(decode_adapters), 0, 0
        pace: dict[int, tuple[int, float]] = {}  # adapters new to the step (0 or 1) -> unrushed tokens, step time
        for _, seq in queued:
            work += seq.num_uncomputed  # its own prompt and all ahead of it
            if seq.timing.first_token_due is None or seq.output_ids:
                continue
            new_adapter = int(seq.adapter is not None and seq.adapter not in decode_adapters)
            if new_adapter not in pace:
                tokens = max(1, self._prefill_budget(decodes, adapters, False, 1, new_adapter))
                pace[new_adapter] = tokens, self._step_time(StepShape(decodes, tokens, 1, adapters + new_adapter))
            tokens, step_s = pace[new_adapter]
            if now + (-(-work // tokens) + 1) * step_s <= seq.timing.first_token_due:
                continue
            for _ in range(2):  # the tokens a step must carry, then again at the longer step that carries them
                steps = int((seq.timing.first_token_due - now) / step_s) - 1 if step_s > 0 else 0
                tokens = -(-work // steps) if steps > 0 else work
                step_s = self._step_time(StepShape(decodes, tokens, 1, adapters + new_adapter))
            needed = max(needed, min(tokens, self._prefill_budget(decodes, adapters, True, 1, new_adapter)))
        return needed

    def turned_away(self, adapter: Tenant, tenant: str | None = None) -> None:
        """The pod refused a request of ``adapter`` billed to ``tenant`` for want of room (its queue full, or
        its first token estimated past what the pod promises). The account floods the pod (see Floods) when
        it has a request of its own waiting here as well: a full pod turns away anyone who arrives, and an
        account with nothing queued was turned away for others' backlog, not its own."""
        account = account_of(adapter, tenant)
        if not any(account_of(seq.adapter, seq.tenant) == account for seq in self.waiting):
            return
        now = time.monotonic()
        self._turned_away.pop(account, None)
        self._turned_away[account] = now
        self._forget_floods(now)

    def flooding(self, now: float) -> set[Account]:
        """The accounts flooding the pod: one turned away within FLOOD_MEMORY_S with a request of its own
        waiting."""
        self._forget_floods(now)
        return set(self._turned_away)

    def _forget_floods(self, now: float) -> None:
        while self._turned_away and now - next(iter(self._turned_away.values())) >= FLOOD_MEMORY_S:
            self._turned_away.popitem(last=False)

    def _streams_yield_to(self, seq: Sequence, decodes: set[Account], flooding: set[Account]) -> bool:
        """Whether the step's decodes (of these accounts) yield to ``seq``'s prompt (see Floods):
        under fair share, when its account does not flood the pod and every other account decoding does
        (there is at least one); its own account's streams yield to it too. The prompt then has all the step
        holds, as on an idle pod."""
        account = account_of(seq.adapter, seq.tenant)
        others = decodes - {account}
        return self.policy is Policy.FAIR and account not in flooding and bool(others) and others <= flooding

    def _prefilling(self) -> list[Sequence]:
        """Running sequences whose prompt (or, after a preemption, prompt and output) is still being computed."""
        return [seq for seq in self.running if seq.status == SequenceStatus.RUNNING and seq.num_uncomputed > 1]

    def _order(self, seq: Sequence) -> tuple:
        """Who gets prefill work first: the least-served tenant, then the oldest request (under FCFS the
        oldest request). A started prompt keeps the standing its tenant had when it started for the first
        STARTED_QUANTUM tokens it computes, and stands behind by what it computes past them, but never more
        than a quantum behind its tenant's counter as it is now: prompts up to that long are finished in
        the order they started, not side by side chunk by chunk, so each first token comes as early as the
        budget allows and later arrivals of tenants served as much do not slow it; a longer prompt then
        shares the budget with the rest, so nobody waits behind one for more than about a quantum of it;
        a request of a tenant served less still goes first."""
        if self.policy is Policy.FCFS:
            return (seq.arrival,)
        served = self.shares.served(seq.adapter)
        if seq.started_at_standing is None:
            return served, seq.arrival
        weight = self.shares.weight(seq.adapter)
        past_quantum = max(0, seq.num_computed - seq.started_at_computed - STARTED_QUANTUM) / weight
        # its tenant's other work (decodes, other prompts) moves its counter on meanwhile: never more than a
        # quantum behind it
        return max(seq.started_at_standing + past_quantum, served - STARTED_QUANTUM / weight), seq.arrival

    def _admit(self, seq: Sequence, budget: int) -> tuple[int, int] | None:
        """Moves waiting ``seq`` to running with its cached prefix matched; returns (tokens to compute this
        step, cached tokens), or None, changing nothing, when its KV blocks do not fit."""
        tenant = seq.adapter
        num_cached = self.blocks.match_prefix(seq, self._salt(seq))
        num_new = min(seq.num_uncomputed - num_cached, budget)
        if not self.blocks.can_allocate(seq, num_cached + num_new):
            self.blocks.free(seq)  # the matched blocks go back, still cached
            return None
        if self.blocks.prefix is not None:
            self.blocks.prefix.record_lookup(seq.num_tokens, num_cached)
        if tenant is not None:
            seq.slot = self.cache.acquire(tenant)
            self._reserved.pop(tenant, None)
        self._dequeue(seq)
        seq.started_at_standing = self.shares.served(tenant)
        seq.started_at_computed = seq.num_computed + num_cached  # cached tokens were never computed for it
        seq.status = SequenceStatus.RUNNING
        if seq.timing.first_scheduled is None:
            seq.timing.first_scheduled = time.monotonic()
        self.running.append(seq)
        return num_new, num_cached

    def _make_room(self, seq: Sequence, num_new: int, batch: list[ScheduledSeq]) -> bool:
        """Makes KV room for ``num_new`` more tokens of running ``seq``, preempting others not in ``batch``
        if needed; when even that is not enough ``seq`` itself is preempted and False returned."""
        while not self.blocks.can_allocate(seq, num_new):
            if self._preempt_one(keep={seq, *(item.seq for item in batch)}) is None:
                break
        if self.blocks.can_allocate(seq, num_new):
            return True
        self._preempt(seq)
        return False

    def postprocess(self, batch: list[ScheduledSeq], token_ids: list[int | None], ran: bool = True) -> int:
        """Records what the step did to each sequence's progress, its one writer: a sequence preempted since
        the last postprocess holds no KV any more (it is recomputed from its first token); each scheduled
        chunk, and the cached tokens found for it at admission, is now in the cache; a sampled token
        (``token_ids``, one per item; None where the chunk samples nothing) joins its output, as PENDING where
        its id is still on the device. ``ran``: the step has run, so its full blocks whose ids are known are
        offered to the prefix cache; the engine records a step when it launches it (False) and settles it once
        its tokens are read (``settle``), so that a step that fails offers nothing it never computed.
        Sequences that ended while the step ran are left as they are. Returns how many preempted sequences it
        reset (they may be admitted again from the next step)."""
        preempted = len(self._preempted)
        for seq in self._preempted:
            seq.num_computed = 0
        self._preempted.clear()
        for item, token in zip(batch, token_ids, strict=True):
            seq = item.seq
            if seq.is_finished:
                continue
            seq.num_computed += item.num_cached + item.num_new
            if token is not None:
                seq.output_ids.append(token)
                seq.pending += token == PENDING
            if ran:
                self.blocks.cache_full_blocks(seq)
        return preempted

    def settle(self, seq: Sequence, token_id: int | None) -> None:
        """The second half of a launched step's postprocess for ``seq``, once the step has run: the id of its
        oldest pending token, read from the device, written in its place (None: the step sampled nothing for
        it), and its full blocks whose ids are known offered to the prefix cache."""
        if token_id is not None:
            seq.output_ids[len(seq.output_ids) - seq.pending] = token_id
            seq.pending -= 1
        self.blocks.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Frees everything ``seq`` holds; safe to call in any state, once or more."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
            self.shares.leave(seq.adapter, seq.tenant)
        elif seq in self._queues.get(seq.adapter, ()):
            self._dequeue(seq)
            self.shares.leave(seq.adapter, seq.tenant)
        seq.status = SequenceStatus.FINISHED

    # ---- admission -------------------------------------------------------------------------
    def _next_in_fair_order(self, passed: set[Tenant]) -> Sequence | None:
        """The oldest waiting request of the least-served tenant not yet passed over (ties: oldest first);
        under FCFS the oldest waiting request not passed over."""
        # a request preempted by this step waits for the step's postprocess to reset its progress
        heads = [queue[0] for tenant, queue in self._queues.items()
                 if tenant not in passed and queue[0] not in self._preempted]
        if self.policy is Policy.FCFS:
            return min(heads, key=lambda seq: seq.arrival, default=None)
        return min(heads, key=lambda seq: (self.shares.served(seq.adapter), seq.arrival), default=None)

    def _free_a_seat_for_a_tenant_without_one(self) -> Tenant | object:
        """Preempts one request for the least-served backlogged tenant with no seat, when every seat is
        taken; returns that tenant (whose head then takes the seat first), or _NOBODY."""
        if len(self.running) < self.limits.max_num_seqs or not self._queues:
            return _NOBODY
        seats = self._seats()
        seatless = [t for t, queue in self._queues.items()
                    if account_of(t, queue[0].tenant) not in seats and self._can_run_now(t)]
        holder = max(seats, key=lambda a: (seats[a], self.shares.account_served(a)), default=None)
        if not seatless or seats[holder] < 2:
            return _NOBODY
        self._preempt(next(seq for seq in reversed(self.running) if account_of(seq.adapter, seq.tenant) == holder))
        return min(seatless, key=lambda t: (self.shares.served(t), self._queues[t][0].arrival))

    def _seats(self) -> Counter[Account]:
        """Running requests per account (fair_share.py): a tenant's seats across its adapters are its own."""
        return Counter(account_of(seq.adapter, seq.tenant) for seq in self.running)

    def _can_run_now(self, tenant: Tenant) -> bool:
        """Whether ``tenant``'s next request could start this step as far as its adapter goes (no side effects)."""
        return tenant is None or (self._adapter_ready(tenant) and tenant not in self._reserved.values()
                                  and self.cache.can_acquire(tenant))

    def _can_run(self, tenant: Tenant) -> bool:
        if tenant is None:
            return True
        if not self._adapter_ready(tenant) or tenant in self._reserved.values():
            return False
        if self.cache.can_acquire(tenant):
            return True
        self._reserve_slot(tenant)
        return False

    def _reserve_slot(self, tenant: str) -> None:
        if tenant in self._reserved:
            return
        taken = set(self._reserved.values())
        candidates = [name for name in self.cache.unpinned_in_slots() if name not in taken]
        if candidates:
            running = Counter(seq.adapter for seq in self.running)
            self._reserved[tenant] = min(candidates, key=lambda name: running[name])

    def _forget_stale_reservations(self) -> None:
        for tenant, victim in list(self._reserved.items()):
            if (tenant not in self._queues or self.cache.slot_of(tenant) is not None
                    or self.cache.slot_of(victim) is None or self.cache.is_pinned(victim)):
                del self._reserved[tenant]

    def _admissible(self, seq: Sequence) -> bool:
        return seq.adapter is None or self._adapter_ready(seq.adapter)

    def _take(self, batch: list[ScheduledSeq], seq: Sequence, num_new: int, num_cached: int = 0) -> int:
        self.blocks.allocate(seq, num_cached + num_new)
        batch.append(ScheduledSeq(seq, num_new, num_cached))
        self.shares.charge(seq.adapter, num_new, seq.tenant)
        return num_new

    def _dequeue(self, seq: Sequence) -> None:
        queue = self._queues[seq.adapter]
        queue.remove(seq)
        if not queue:
            del self._queues[seq.adapter]

    # ---- release and preemption ------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.slot >= 0:
            self.cache.release(seq.adapter)
            seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.started_at_standing = None
        seq.status = SequenceStatus.WAITING
        self._queues.setdefault(seq.adapter, deque()).appendleft(seq)
        self._preempted.append(seq)
        self.num_preemptions += 1

    def _preempt_one(self, keep: set[Sequence]) -> Sequence | None:
        candidates = [seq for seq in reversed(self.running) if seq not in keep]
        if not candidates:
            return None
        if self.policy is Policy.FCFS:
            victim = candidates[0]  # the latest admitted
        else:
            victim = max(candidates, key=lambda seq: self.shares.served(seq.adapter))  # the first max: latest admitted
        self._preempt(victim)
        return victim

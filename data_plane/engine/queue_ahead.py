"""What a new request would wait behind by the fair shares' counters alone, without steps (``Scheduler.ahead_of``).

Admission does not read this: it reads the plan of the queue (``queue_plan.py``), which follows the
scheduler's own steps. This is the summary in a few lines: under FCFS all of the prefill work, prompts
being chunked and waiting requests; under fair share its own flow's, and of each other flow the tokens it
is served before the new request's prompt is done: fair shares are counted in tokens, so prompts of
several flows are prefilled side by side, chunk by chunk, and another flow goes on until its counter
reaches what the new request's flow's will be then (scaled by the weights). Requests of other flows that
arrive while it waits take their share too: ``within_s`` (the wait it would have) counts those expected
at each flow's recent rate, each of that flow's recent mean prompt size. Shares are an account's
(``fair_share.py``): an account's flows are counted against one share. What it leaves out, the plan
keeps: decodes charging the counters, started prompts' quanta, seats turning over, joiners' credit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq

from data_plane.engine.admission import Ahead, Arrivals
from data_plane.engine.fair_share import Account, FairShare, Flow, account_of
from data_plane.engine.sequence import Sequence


def ahead_of(flow: Flow, prompt_tokens: int, within_s: float, billed_to: str | None, *,
             prefilling: Seq[Sequence], queues: Mapping[Flow, Seq[Sequence]], shares: FairShare,
             arrivals: Arrivals, fair: bool, seat_now: bool) -> Ahead:
    """The prefill work a new request of ``flow`` billed to ``billed_to`` with ``prompt_tokens`` would come
    after: ``prefilling``, the prompts being chunked, and ``queues``, each flow's waiting requests in
    order; ``fair`` under fair share (else FCFS); ``seat_now`` when it takes a seat at the next step."""
    chunking: dict[Flow, list[Sequence]] = {}
    for seq in prefilling:
        chunking.setdefault(seq.adapter, []).append(seq)
    own = [*chunking.get(flow, ()), *queues.get(flow, ())]
    # its flow's counter once its prompt is done
    done_at = shares.standing(flow, billed_to) + (sum(seq.num_uncomputed for seq in own) +
                                                  prompt_tokens) / shares.weight(flow)
    own_account = account_of(flow, billed_to)
    now = time.monotonic()
    requests = 0
    sizes: list[int] = []
    flows: list[Flow] = []  # each size's flow
    left: dict[Account, float] = {}  # each other account's share still to count, over all its flows
    for other in {*queues, *chunking, *arrivals.recent(now)}:
        queue = [*chunking.get(other, ()), *queues.get(other, ())]
        work = [seq.num_uncomputed for seq in queue]
        share, account = math.inf, None
        if fair and other != flow:
            coming = arrivals.expected(other, within_s, now)
            if not work and not coming:
                continue
            account = account_of(other, queue[0].tenant if queue else None)
            if account == own_account:  # its account's work on its other flows: all of it goes first
                account = None
            elif account not in left:
                left[account] = max(0.0, (done_at - shares.standing(other)) * shares.weight(other))
        if account is not None:
            share = left[account]
            mean = max(1, arrivals.mean_prompt(other))
            work += [mean] * min(coming, math.ceil(share / mean))  # no more than its share can take
        for i, size in enumerate(work):
            if share < 1:
                break
            sizes.append(size if size <= share else math.ceil(share))
            flows.append(other)
            share -= size
            requests += i >= len(chunking.get(other, ()))  # it still needs a seat
        if account is not None:
            left[account] = max(0.0, share)
    return Ahead(requests, sum(sizes), seat_now=seat_now, sizes=tuple(sizes), adapters=tuple(flows))

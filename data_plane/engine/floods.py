"""Floods: accounts that ask more than the pod can take, and the prompts their streams yield to.

A step's decodes keep their pace (the step budget) against every prompt, except where they all belong
to accounts flooding the pod, i.e. whose requests it turned away (queue full, or a first token
estimated past its promise) within the last FLOOD_MEMORY_S while they had a request of their own
waiting, and the prompt is of an account that does not flood it. Then the step carries that prompt as a
pod with nothing else running would, all of it that ``max_num_batched_tokens`` and the free KV blocks
leave: the flood's streams get a longer gap (one per such prompt up to a step's tokens), and the other
account's first token comes about as soon as on an idle pod instead of after the many steps a prompt
takes at the streams' pace (on the CPU pod a long prompt beside decodes takes about ``g/(g-1)`` times
its prefill alone at an ``--itl-growth`` of ``g``; at the throughput knee, as a rush, two or three steps
of it took more than twice its prefill alone). So one account that asks more than the pod can take does
not multiply the first-token time of those that do not, and streams of an account that keeps within the
pod's room are never slowed beyond their pace for another account's prompt (a burst of new prompts
beside them included; a rush aside). A prompt's own account's streams yield to it too, only while the
rest of the decodes flood. In the spirit of the sparse-flow priority of FQ-CoDel (RFC 8290): a flow with
no standing queue goes ahead of those with one. Fair-share policy only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from data_plane.engine.fair_share import Account, account_of
from data_plane.engine.sequence import Sequence

# Seconds an account counts as flooding the pod after a request of its was turned away.
FLOOD_MEMORY_S = 10.0


class Floods:
    def __init__(self, memory_s: float = FLOOD_MEMORY_S) -> None:
        self._memory_s = memory_s
        self._turned_away: OrderedDict[Account, float] = OrderedDict()  # account -> when, the least recent first

    def turned_away(self, account: Account, now: float) -> None:
        """The pod refused ``account`` room while a request of its own was waiting here (a full pod turns
        away anyone who arrives: an account with nothing queued was turned away for others' backlog, and
        the caller does not count it)."""
        self._turned_away.pop(account, None)
        self._turned_away[account] = now
        self._forget(now)

    def flooding(self, now: float) -> set[Account]:
        """The accounts turned away within FLOOD_MEMORY_S with a request of their own waiting."""
        self._forget(now)
        return set(self._turned_away)

    def yields_to(self, decodes: set[Account], now: float, fair: bool) -> Callable[[Sequence], bool]:
        """Whether a step's decodes (of ``decodes``' accounts) yield to a request's prompt: under fair share
        (``fair``), when its account does not flood the pod and every other account decoding does (there is
        at least one)."""
        flooding = self.flooding(now)
        if not flooding or not fair:
            return lambda seq: False

        def yields(seq: Sequence) -> bool:
            account = account_of(seq.adapter, seq.tenant)
            others = decodes - {account}
            return account not in flooding and bool(others) and others <= flooding
        return yields

    def _forget(self, now: float) -> None:
        while self._turned_away and now - next(iter(self._turned_away.values())) >= self._memory_s:
            self._turned_away.popitem(last=False)

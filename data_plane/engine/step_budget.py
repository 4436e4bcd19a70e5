"""How many prompt tokens a step may carry beside its decodes: the budget, and rushes.

Decodes keep their pace: every running decode gets its token each step, and prefill work fills what is
left of the step's target time (``step_cost.py``: the step stays near its target inter-token latency).
The budget is asked again for each prefilling sequence the step takes, with the adapters the prefill
brings that the decodes have not got, so a prompt of such an adapter, or a second prompt in the step,
pays its own cost from the same target instead of stretching the step past it. Two things lift it: a
rush (``Rush``), when an admitted request's first-token promise is at risk, and a flood (``floods.py``),
when every other account decoding floods the pod and the prompt's does not.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from data_plane.engine.sequence import Sequence
from data_plane.engine.step_cost import StepShape


class PrefillBudget(Protocol):
    """``StepCost.prefill_budget``: the prefill tokens a step with ``decode_rows`` decodes over ``adapters``
    adapters may carry in ``prefill_seqs`` prefilling sequences, which bring ``new_adapters`` adapters the
    decodes have not got; ``rush`` when an admitted request's first-token promise is at risk."""

    def __call__(self, decode_rows: int, adapters: int, rush: bool, prefill_seqs: int, new_adapters: int,
                 /) -> int: ...


class Rush:
    """The prompt tokens a step must carry so that every request admitted with a first-token promise,
    prefilling or able to start now (a seat free, its adapter ready and in a slot), gets its first token by
    when it is due; 0 while the unrushed budget keeps them all. A request's work is the prompt tokens
    ahead of it in order (prompts being prefilled, and requests waiting that could start now) and its own,
    computed a step's budget at a time beside these decodes, with one step more for the error of a step's
    prediction; a request that falls behind that pace asks for just the tokens a step that keeps it needs
    (at most the device's throughput knee, ``StepCost``), so a wait the admission estimate got wrong is
    made up with the smallest longer gaps for running streams, instead of a broken promise. A request
    that could not run this step asks for nothing."""

    def __init__(self, budget: PrefillBudget, step_time: Callable[[StepShape], float]) -> None:
        """``step_time(shape)``: the seconds a step of that shape is expected to take (``StepCost.predict``)."""
        self._budget = budget
        self._step_time = step_time

    def tokens(self, now: float, decodes: int, decode_adapters: Collection[str], queued: Seq[Sequence]) -> int:
        """The rushed budget of a step with these decodes, ``queued`` being everything that could take prompt
        tokens this step, in the order it gets them."""
        adapters, needed, work = len(decode_adapters), 0, 0
        pace: dict[int, tuple[int, float]] = {}  # adapters new to the step (0 or 1) -> unrushed tokens, step time
        most: int | None = None  # the most a rush may carry: once asked for, nobody asks for more
        for seq in queued:
            if most is not None and needed >= most:
                break
            work += seq.num_uncomputed  # its own prompt and all ahead of it
            if seq.timing.first_token_due is None or seq.output_ids:
                continue
            new_adapter = int(seq.adapter is not None and seq.adapter not in decode_adapters)
            if new_adapter not in pace:
                tokens = max(1, self._budget(decodes, adapters, False, 1, new_adapter))
                pace[new_adapter] = tokens, self._step_time(StepShape(decodes, tokens, 1, adapters + new_adapter))
            tokens, step_s = pace[new_adapter]
            if now + (-(-work // tokens) + 1) * step_s <= seq.timing.first_token_due:
                continue
            for _ in range(2):  # the tokens a step must carry, then again at the longer step that carries them
                steps = int((seq.timing.first_token_due - now) / step_s) - 1 if step_s > 0 else 0
                tokens = -(-work // steps) if steps > 0 else work
                step_s = self._step_time(StepShape(decodes, tokens, 1, adapters + new_adapter))
            needed = max(needed, min(tokens, self._budget(decodes, adapters, True, 1, new_adapter)))
            if most is None:
                most = max(self._budget(decodes, adapters, True, 1, new) for new in (0, 1))
        return needed


@dataclass
class StepBudget:
    """One step's room for prompt tokens once its decodes are in: ``tokens`` the step may still carry
    (``max_num_batched_tokens`` less what it holds), the prefill ``budget`` beside ``decodes`` decodes over
    ``decode_adapters``, lifted to ``rushed`` tokens (``Rush``) at most to the rushed budget, and for a
    prompt whose account the decodes yield to (``yields_to``, ``floods.py``) all the step holds as far as
    the free KV blocks go (``room``)."""

    budget: PrefillBudget
    tokens: int
    decodes: int
    decode_adapters: frozenset[str]
    rushed: int = 0
    yields_to: Callable[[Sequence], bool] = lambda seq: False
    room: Callable[[Sequence], int] = lambda seq: 0
    prefill: list[Sequence] = field(default_factory=list)  # given prompt tokens this step
    used: int = 0  # their tokens

    def allowance(self, seq: Sequence) -> int:
        """Prompt tokens ``seq`` may have beside the decodes and the prefill taken so far: the budget for one
        more prefilling sequence, counting the adapter it brings if the step has not got it yet."""
        new = {s.adapter for s in (*self.prefill, seq) if s.adapter is not None} - self.decode_adapters
        seqs = len(self.prefill) + 1
        unrushed = self._ask(rush=False, prefill_seqs=seqs, new_adapters=len(new))
        if self.rushed > unrushed:  # a rush is held to the knee's budget for this many sequences and adapters
            rushed = self._ask(rush=True, prefill_seqs=seqs, new_adapters=len(new))
            unrushed = max(unrushed, min(self.rushed, rushed))
        paced = min(self.tokens, unrushed - self.used)
        if self.yields_to(seq):
            # all the step holds, as on a pod with nothing else running, as far as free KV blocks go: more would
            # preempt, or keep a waiting request out, where its pace would not
            return max(paced, min(self.tokens, self.room(seq)))
        return paced

    def take(self, seq: Sequence, tokens: int) -> None:
        """``seq`` is given ``tokens`` prompt tokens in this step."""
        self.prefill.append(seq)
        self.used += tokens
        self.tokens -= tokens

    def _ask(self, *, rush: bool, prefill_seqs: int, new_adapters: int) -> int:
        return self.budget(self.decodes, len(self.decode_adapters), rush, prefill_seqs, new_adapters)

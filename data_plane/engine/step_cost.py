"""How long a step takes, from what it holds, fitted online; and how much prefill a step may carry.

A step's time is modelled as linear in what it computes::

    seconds ≈ c0 + c1·decode_rows + c2·prefill_tokens + c3·prefill_seqs + c4·adapters + c5·row_tiles

(``adapters``: distinct adapters in the step, each a LoRA segment; ``row_tiles``: on a CPU pod, whose
projections multiply fixed tiles of rows (``model.cpu_linear``), the tiles the step's rows fill). On a
GPU decode rows are almost free next to the fixed cost (weights are read once per step) and prefill
tokens cost compute; on a CPU both cost compute, by the tile. ``c5`` is a tile's projections: on the
CPU pod (demo model, bfloat16 matmuls, 32-row tiles, 2-core EPYC) a step of 16 decodes took 48 ms,
with 16 prompt tokens beside them 65 ms, with 17 95 ms, with 48 99 ms, with 49 136 ms. A pod without
tiles has the feature at 0 always, and its coefficient is 0. A GPU pod replays every step from a CUDA
graph, prefill included (``step_runner``), so a step with prompt tokens has no launch cost of its own
(when only decode-only steps were captured, the eager step that prefilled took several times a
replayed decode step: 34.7 against 9.64 ms at batch 1 on an H100 with an 8B model). The coefficients
are not guessed: ``Engine.warm_up`` times a few steps of known shapes at start-up (the prior, kept
for good so every coefficient stays identified: one and two prompts of the same length tell ``c3``
from ``c2``; a prompt that fills a tile and one a token longer tell ``c5`` from ``c2``), and every
served step adds its measured time; the fit is a least-squares solve over the prior and the most recent
steps, redone every few steps, with coefficients kept non-negative.

The step budget (stall-free batching, after Sarathi-Serve): every running decode gets its token each
step, and prefill work fills what is left of a target step time, so running streams keep their pace
while new prompts are prefilled beside them. By default (``--itl-growth``, ``DEFAULT_ITL_GROWTH``) a
step that also prefills lasts at most that many times its decodes alone, by the same fitted model, so a
running stream's gap grows by about that factor whatever arrives, except where even the floor of
MIN_PREFILL_TOKENS does not fit the target. The floor's step is then paid whatever it holds, so on a
tiled pod it fills the row tile its tokens end in: a CPU step of 31 decodes and 8 prompt tokens pays a
second tile and carries 33; beside 8 base-model decodes a prompt of an adapter pays that adapter's
segment and its sequence, which on the CPU pod leave almost nothing of 1.4x, and carries the 24 tokens
left in the decodes' tile (in runs of the same burst, steps of the 8-token floor took no less time
than steps of 24 tokens: benchmarks/history/overload.md, "each prompt pays its own adapter and
sequence"). ``--target-itl`` gives an absolute target in seconds instead. The target is set by the decodes (their
rows and adapters); the prefill pays from it for its tokens, each prefilling sequence, and each adapter
its prompts bring that the decodes have not got (a LoRA segment of its own: on the CPU pod with the demo
model, a prompt of an adapter beside base-model decodes took over the 1.4x that counting the
decodes' adapters only had planned; benchmarks/history/overload.md, "each prompt pays its own adapter
and sequence").

A step is rushed while an admitted request would get its first token after its promised time at the
pace prefill has without rushing (``step_budget.Rush``): it then carries the prompt tokens that
keep the promise, up to what the throughput knee allows (``rush``) whatever the growth, so a wait the
admission estimate got wrong is made up by a few longer steps instead of a broken promise.

``--itl-growth 0`` chooses throughput instead: a step that prefills may last up to the device's
throughput knee (or 1.4× its decodes alone when that is longer). A step pays its fixed part once
whatever it computes (``fixed``: the fixed cost, one prefilling sequence, one adapter), so a step of
``n`` prompt tokens prefills at ``n / (fixed + n·per_token)``, which reaches ``KNEE_EFFICIENCY`` of the
device's peak rate ``1 / per_token`` when the step lasts ``fixed / (1 - KNEE_EFFICIENCY)`` (with row
tiles, a token's cost includes its share of a tile).
Where the fixed part is most of a decode step (a small model, or a GPU reading its weights once per
step), that is several times the decodes alone: more prompt tokens per second, longer gaps for
running streams while prompts arrive (benchmarks/history/overload.md, "the step target at the device's
throughput knee").

A pod with nothing decoding prefills at its full ``--max-num-batched-tokens``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

# How many times its decodes alone a step that prefills may last.
DEFAULT_ITL_GROWTH = 1.4
# Under --itl-growth 0: the step whose prefill runs at this fraction of the device's peak prefill rate.
KNEE_EFFICIENCY = 0.8
# Prefill tokens a step may always carry when prefill is waiting, whatever the target: prefill always
# progresses, even when the decodes alone already exceed an explicit --target-itl.
MIN_PREFILL_TOKENS = 8
_WINDOW = 512  # recent steps the fit uses
_REFIT_EVERY = 16  # steps between solves
_PRIOR_WEIGHT = 4.0  # a warm-up step counts as this many served ones
TILE = 5  # the row tiles' feature (StepShape.features)


@dataclass(frozen=True)
class StepShape:
    """What one step computes."""

    decode_rows: int
    prefill_tokens: int = 0
    prefill_seqs: int = 0
    adapters: int = 0

    def features(self, row_tile: int = 0) -> tuple[float, ...]:
        """The model's features; ``row_tile``: the rows its projections multiply at once (0: not tiled). A
        step with any sequence fills at least one tile."""
        rows = self.decode_rows + self.prefill_tokens
        tiles = max(-(-rows // row_tile), int(rows > 0 or self.prefill_seqs > 0)) if row_tile else 0
        return (1.0, float(self.decode_rows), float(self.prefill_tokens), float(self.prefill_seqs),
                float(self.adapters), float(tiles))


class StepCost:
    """The fitted step-time model, and the prefill budget it implies under a target."""

    def __init__(self, target_itl_s: float = 0.0, max_batched_tokens: int = 1 << 30,
                 itl_growth: float = DEFAULT_ITL_GROWTH, row_tile: int = 0) -> None:
        """``target_itl_s``: the step time prefill may fill up to (0: ``itl_growth`` × the step's decodes
        alone, or with ``itl_growth`` 0 up to the device's throughput knee; see the module's notes);
        ``max_batched_tokens``: the most tokens one step holds (decodes and prefill together);
        ``row_tile``: the rows its projections multiply at once, 0 where not tiled (``StepShape.features``)."""
        if not 0 <= target_itl_s < math.inf:
            raise ValueError(f"target_itl_s must be a number of seconds >= 0 (0 = relative, by itl_growth), "
                             f"got {target_itl_s}")
        if not (itl_growth == 0 or 1 < itl_growth < math.inf):
            raise ValueError(f"itl_growth must be a factor > 1, or 0 for the throughput knee, got {itl_growth}")
        self.target_itl_s = target_itl_s
        self.itl_growth = itl_growth
        self.row_tile = row_tile
        self._budgets: dict[tuple[int, int, bool, int, int], int] = {}  # prefill_budget's answers since the last fit
        self._max_tokens = max_batched_tokens
        self._prior: list[tuple[tuple[float, ...], float]] = []
        self._recent: deque[tuple[tuple[float, ...], float]] = deque(maxlen=_WINDOW)
        self._since_fit = 0
        self.coef: np.ndarray | None = None  # [6] seconds per feature; None until something was timed

    @property
    def max_batched_tokens(self) -> int:
        """The most tokens one step holds, decodes and prefill together."""
        return self._max_tokens

    # ---- fitting -----------------------------------------------------------------------------
    def observe_prior(self, shape: StepShape, seconds: float) -> None:
        """A step timed at start-up; kept for good, and the model is solved again at once."""
        self._prior.append((self._features(shape), seconds))
        self._fit()

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A served step took ``seconds``."""
        self._recent.append((self._features(shape), seconds))
        self._since_fit += 1
        if self.coef is None or self._since_fit >= _REFIT_EVERY:
            self._fit()

    def _features(self, shape: StepShape) -> tuple[float, ...]:
        return shape.features(self.row_tile)

    def _fit(self) -> None:
        self._since_fit = 0
        self._budgets.clear()
        rows = [*self._prior, *self._recent]
        if not rows:
            return
        x = np.array([f for f, _ in rows], dtype=np.float64)  # [n, 6]
        y = np.array([s for _, s in rows], dtype=np.float64)  # [n]
        w = np.sqrt(np.array([_PRIOR_WEIGHT] * len(self._prior) + [1.0] * len(self._recent)))
        self.coef = _nonnegative_least_squares(x * w[:, None], y * w)

    # ---- prediction --------------------------------------------------------------------------
    def predict(self, shape: StepShape) -> float:
        """Seconds a step of ``shape`` is expected to take (0.0 before anything was timed)."""
        if self.coef is None:
            return 0.0
        return float(np.dot(self.coef, self._features(shape)))

    def step_target(self, decode_rows: int, adapters: int, rush: bool = False) -> float:
        """The time a step with these decodes may take once prefill fills it; with ``rush`` (an admitted
        request's first-token promise is at risk) at least up to the device's throughput knee."""
        decodes = self.predict(StepShape(decode_rows, adapters=adapters))
        knee = max(DEFAULT_ITL_GROWTH * decodes, self.knee_step_s())
        if self.target_itl_s:
            target = max(self.target_itl_s, decodes)
        elif self.itl_growth:
            target = self.itl_growth * decodes
        else:
            target = knee
        return max(target, knee) if rush else target

    def knee_step_s(self) -> float:
        """The shortest step whose prefill runs at ``KNEE_EFFICIENCY`` of the device's peak prefill rate:
        its fixed part (a step that prefills, one prefilling sequence, one adapter) over
        ``1 - KNEE_EFFICIENCY``. A row tile is not part of it: tiles are paid by the rows, so at the
        peak rate a token costs its own part and its share of a tile (``c2 + c6 / row_tile``)."""
        tile = float(self.coef[TILE]) if self.coef is not None and self.row_tile else 0.0
        return (self.predict(StepShape(0, 0, 1, 1)) - tile) / (1.0 - KNEE_EFFICIENCY)

    def prefill_budget(self, decode_rows: int, adapters: int, rush: bool = False, prefill_seqs: int = 1,
                       new_adapters: int = 0) -> int:
        """Prefill tokens a step with ``decode_rows`` decodes over ``adapters`` distinct adapters may carry
        in ``prefill_seqs`` prefilling sequences that bring ``new_adapters`` adapters the decodes do not
        have (each a LoRA segment of its own): all the step has room for when nothing decodes, else as many
        as fit the target, which the decodes alone set (``rush``: see ``step_target``). With one prefilling
        sequence never fewer than the floor (``_floor_tokens``), so prefill always progresses; a further
        sequence fits only where the target leaves room for its own cost (the scheduler asks again for each
        one)."""
        room = max(0, self._max_tokens - decode_rows)
        if decode_rows == 0 or self.coef is None:
            return room
        key = (decode_rows, adapters, rush, prefill_seqs, new_adapters)
        if key not in self._budgets:  # the admission estimate asks the same few questions many times a fit
            target = self.step_target(decode_rows, adapters, rush) + 1e-9  # a token that fits to rounding fits
            most = self._most_tokens(decode_rows, prefill_seqs, adapters + new_adapters, target, room)
            self._budgets[key] = min(room, max(self._floor_tokens(decode_rows), most) if prefill_seqs <= 1 else most)
        return self._budgets[key]

    def _floor_tokens(self, decode_rows: int) -> int:
        """The prompt tokens a step beside ``decode_rows`` decodes carries whatever its target: MIN_PREFILL_TOKENS,
        and on a tiled pod the rest of the row tile they end in, which the step pays for anyway."""
        if not self.row_tile or self.coef[TILE] <= 0:
            return MIN_PREFILL_TOKENS
        return -(-(decode_rows + MIN_PREFILL_TOKENS) // self.row_tile) * self.row_tile - decode_rows

    def _most_tokens(self, decode_rows: int, prefill_seqs: int, adapters: int, target: float, room: int) -> int:
        """The most prompt tokens (at most ``room``) ``prefill_seqs`` prefilling sequences may add to a step
        with these decodes, over ``adapters`` adapters in all, within ``target`` seconds: linear in the
        tokens, or with row tiles a step function too, so searched (the predicted time never falls as
        tokens are added)."""
        def within(tokens: int) -> bool:
            return self.predict(StepShape(decode_rows, tokens, prefill_seqs, adapters)) <= target

        if not self.row_tile or self.coef[TILE] <= 0:
            per_token = float(self.coef[2])
            spare = target - self.predict(StepShape(decode_rows, 0, prefill_seqs, adapters))
            return room if per_token <= 0 else max(0, int(spare / per_token))
        if within(room):
            return room
        low, high = 0, room  # within(low) or low == 0; not within(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if within(mid) else (low, mid)
        return low

    def summary(self) -> str:
        """The fitted coefficients in milliseconds, for the start-up log."""
        if self.coef is None:
            return "not measured"
        names = dict(enumerate(("fixed", "per decode row", "per prefill token", "per prefilling sequence",
                                "per adapter", f"per {self.row_tile}-row tile")))
        if not self.row_tile:
            del names[TILE]
        if self.target_itl_s:
            target = f"--target-itl {self.target_itl_s:g} s"
        elif self.itl_growth:
            target = f"a step that prefills lasts at most {self.itl_growth:g}x its decodes alone (--itl-growth)"
        else:
            target = f"a step that prefills may last {self.knee_step_s() * 1e3:.3g} ms (the throughput knee)"
        return ", ".join(f"{name} {self.coef[i] * 1e3:.3g} ms" for i, name in names.items()) + "; " + target


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: solve, drop the features whose coefficient came out
    negative (they are set to 0), solve again on the rest; a handful of features, so a few passes."""
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        coef[:] = 0.0
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = active & (coef < 0)
        if not negative.any():
            break
        active &= ~negative
    return np.maximum(coef, 0.0)

"""How a CPU step applies its adapters, chosen by measurement on this machine.

Which of the four CPU LoRA paths (dense, gathered and segmented in ``kernels.cpu_lora``, the segment
loop of ``kernels.reference``) is fastest depends on the CPU (its vector width, caches, memory
bandwidth and torch's per-op overhead there) as much as on the shapes, so no machine's constants
decide it: ``PathTuner`` times the bucket's ``candidates`` on the step's own inputs, each on torch's
threads and on one thread (``CpuLoraRun``), the first time a layer plan meets a token-count and
segment-count bucket, and keeps the fastest (the way autotuners pick kernel configurations).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)


class CpuLoraPath(enum.Enum):
    """How a CPU step applies its adapters: the packed matmul pair, the gathered matrix-vector
    products, ``kernels.reference``'s loop over adapter segments, or a matmul pair per segment."""

    DENSE = "dense"
    GATHERED = "gathered"
    LOOP = "loop"
    SEGMENTED = "segmented"


class CpuLoraRun(NamedTuple):
    """A path and the torch threads its ops run on. A LoRA op is small: on two threads each one pays
    the threads' hand-over, which can cost more than the split saves (measured on the demo model's
    32-sequence decode step, 2-core AMD EPYC: LoRA added ~30 ms to the step with every op on two
    threads, ~18 ms with the runs the tuner chose once it also measured one)."""

    path: CpuLoraPath
    threads: int

    @property
    def label(self) -> str:
        return f"{self.path.value}/{self.threads}t"


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block. With OpenMP this is the calling thread's
    count (and the default a thread that starts parallel work meanwhile takes): call it from the thread
    that runs the model."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class CpuPlan:
    """A layer's shape and the real ranks of its resident adapters: what its paths' costs depend
    on. Layers with equal plans share a measured path (and a step's choice); cheap to keep per layer."""

    ranks: tuple[tuple[int, ...], ...]  # [S][max_loras] real rank of each (slice, slot)
    in_features: int
    out_features: int

    @functools.cached_property
    def rank(self) -> int:
        """R, the total rank of every resident (slot, slice): 0 when no adapter adapts the layer."""
        return sum(map(sum, self.ranks))


def plan(host_ranks: list[list[int]], in_features: int, out_features: int) -> CpuPlan:
    """``host_ranks``: [S][max_loras] real ranks."""
    return CpuPlan(tuple(map(tuple, host_ranks)), in_features, out_features)


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (1 for 0): steps whose token or segment counts share a
    bucket share a measured path."""
    return 1 << max(0, n - 1).bit_length()


PathKey = tuple[CpuPlan, int, int]  # a plan, its steps' token bucket and segment bucket
# A run whose first timed run is this many times the fastest one is not timed further: the noise
# between two timings of one run on a loaded machine stays well under that.
PRUNE_FACTOR = 8
# The gathered path copies each row's adapter (an all-zero one for base-model rows): where the step has
# this many rows per adapter segment it moves that many copies of each A and B for the products the
# loop computes from one, so it is not a candidate (measuring it at a 1024-token prefill alone took
# about a second on the demo model).
GATHER_MAX_TOKENS_PER_SEGMENT = 8


def candidates(num_tokens: int, num_segments: int, threads: int) -> list[CpuLoraRun]:
    """The runs worth measuring for steps of ``num_tokens`` in ``num_segments`` adapter segments (the
    tuner passes its buckets, so that every step of a bucket has had the same candidates): each path on
    ``threads`` threads and, where that is more, on one."""
    paths = list(CpuLoraPath)
    if num_tokens >= GATHER_MAX_TOKENS_PER_SEGMENT * max(1, num_segments):
        paths.remove(CpuLoraPath.GATHERED)
    return [CpuLoraRun(p, t) for p in paths for t in dict.fromkeys((threads, 1))]


class PathTuner:
    """Chooses each step's CPU path, and the threads it runs on, by measurement on this machine. The
    first time a layer plan meets a (token bucket, segment bucket), ``choose`` runs each of the
    bucket's ``candidates`` once to warm it (packs built, memory touched), then each once more timed
    with ``timer``, then those within ``PRUNE_FACTOR`` of the fastest ``repeats`` - 1 more times,
    interleaved, and keeps the run with the lowest best time (ties: the order of ``candidates``); later
    steps of that key reuse it. A new resident layout is a new plan, measured anew. ``threads`` is the
    most threads a run may take (None: torch's setting when a choice is measured). Deterministic given
    the timings."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter, repeats: int = 2, capacity: int = 4096,
                 threads: int | None = None) -> None:
        if repeats < 1 or capacity < 1 or (threads is not None and threads < 1):
            raise ValueError(f"repeats, capacity and threads must be at least 1, got {repeats}, {capacity}, {threads}")
        self._timer = timer
        self._repeats = repeats
        self._capacity = capacity
        self._threads = threads
        self._chosen: OrderedDict[PathKey, CpuLoraRun] = OrderedDict()
        self.timings: dict[PathKey, dict[CpuLoraRun, float]] = {}  # the measurement behind each choice

    def choose(self, plan: CpuPlan, num_tokens: int, segments: tuple[tuple[int, int, int, int], ...],
               run: Callable[[CpuLoraRun], None]) -> CpuLoraRun:
        """The fastest run for a step of ``num_tokens`` whose adapter segments are ``segments``
        ((slot, start, end, run), as in ``LoraMeta.host_segments``); ``run(choice)`` applies the step's
        adapters by ``choice`` into scratch output, and is called only when this key is new."""
        key = (plan, bucket(num_tokens), bucket(len(segments)))
        chosen = self._chosen.get(key)
        if chosen is not None:
            self._chosen.move_to_end(key)
            return chosen
        threads = self._threads or torch.get_num_threads()
        seconds = self._measure(run, candidates(key[1], key[2], threads))
        chosen = min(seconds, key=lambda c: seconds[c])  # min keeps the first of equal times
        self._chosen[key] = chosen
        self.timings[key] = seconds
        while len(self._chosen) > self._capacity:
            self.timings.pop(self._chosen.popitem(last=False)[0], None)
        log.debug("cpu lora path measured", extra={
            "in_features": plan.in_features, "out_features": plan.out_features, "rank": plan.rank,
            "tokens_bucket": key[1], "segments_bucket": key[2], "path": chosen.label,
            **{f"{c.label}_us": round(t * 1e6, 1) for c, t in seconds.items()}})
        return chosen

    def _measure(self, run: Callable[[CpuLoraRun], None], runs: list[CpuLoraRun]) -> dict[CpuLoraRun, float]:
        for choice in runs:  # the warm run (it may build a pack): not timed
            run(choice)
        best = {}
        for choice in runs:
            started = self._timer()
            run(choice)
            best[choice] = self._timer() - started
        # A run PRUNE_FACTOR times slower than another on its first timed run cannot win, and running
        # it again costs the step most (the gathered path at a 512-token prefill: ~100 ms a layer where
        # the others take 1 ms): it keeps that time and is not run again.
        contenders = [c for c in runs if best[c] <= PRUNE_FACTOR * min(best.values())]
        for _ in range(self._repeats - 1):
            for choice in contenders:  # interleaved, so that a burst of load falls on every run
                started = self._timer()
                run(choice)
                best[choice] = min(best[choice], self._timer() - started)
        return best


# One per process: every layer runs on the same CPU.
PATH_TUNER = PathTuner()


def choose_path(plan: CpuPlan, num_tokens: int, segments: tuple[tuple[int, int, int, int], ...],
                run: Callable[[CpuLoraRun], None]) -> CpuLoraRun:
    """The run ``PATH_TUNER`` measured fastest for a step like this one (see ``PathTuner.choose``)."""
    return PATH_TUNER.choose(plan, num_tokens, segments, run)

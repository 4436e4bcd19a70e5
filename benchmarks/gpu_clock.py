"""How benchmarks/gpu.py times work on its device, and the copy bandwidth every floor is measured against.

On CUDA a run is timed with CUDA events, after warm-up runs, with the L2 cache flushed before each
timed run (a floor counts bytes from device memory, so no input may come from the cache); the
median of the runs is reported. Elsewhere the host clock times each run. Only the CUDA path
synchronises with the device, and only after the timed runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

L2_FLUSH_BYTES = 256 << 20  # larger than the L2 cache of any current GPU (H100: 50 MB, H200: 60 MB)


class Clock:
    """Median run times, in milliseconds, of callables on ``device``."""

    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.cuda = device.type == "cuda"
        self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if self.cuda else None

    def ms(self, fn: Callable[[], object]) -> float:
        """The median time of ``fn()`` over ``iters`` runs after ``warmup`` untimed ones."""
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(self.iters):
                started = time.perf_counter()
                fn()
                times.append((time.perf_counter() - started) * 1e3)
            return statistics.median(times)
        events = []
        for _ in range(self.iters):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)

    def replay_ms(self, fn: Callable[[], object]) -> tuple[float, str]:
        """The median time of ``fn()`` as a decode step runs it: on CUDA replayed from a CUDA graph
        (one launch for all of ``fn``'s kernels), elsewhere called. Returns (ms, how it ran); a ``fn``
        that cannot be captured is timed called, and the reason said."""
        if not self.cuda:
            return self.ms(fn), "called"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a first run off the capture: Triton compiles, torch allocates
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as e:
            torch.cuda.synchronize()
            return self.ms(fn), f"called (graph capture failed: {str(e).splitlines()[0]})"
        return self.ms(graph.replay), "graph replay"


def copy_bandwidth(clock: Clock, nbytes: int) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` random bytes, counting bytes read plus written:
    the rate every bytes floor here is taken at."""
    src = torch.randint(-128, 128, (nbytes,), dtype=torch.int8, device=clock.device)  # never zeros
    dst = torch.empty_like(src)
    ms = clock.ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank); NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

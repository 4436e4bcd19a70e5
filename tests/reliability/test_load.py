"""64 concurrent Generate streams over the base model and the demo adapters on one CPU pod: nothing
fails except deliberate back-pressure, and the pod's memory stays where it was once warm."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter

import grpc
import pytest
from lorafleet.v1 import generation_pb2_grpc

from benchmarks.processes import wait_until
from conventions.status import retry_after_s
from data_plane.demo_adapters import DEMO_ADAPTERS
from tests.grpc_helpers import collect, request
from tests.reliability.conftest import POD_MAX_WAITING, rss_bytes

pytestmark = pytest.mark.slow

ADAPTERS = [None, *DEMO_ADAPTERS]
QUESTIONS = ["What is the capital of Italy?", "Name a colour of the sky.", "How many legs does a cat have?",
             "What do bees make?", "Why is the sea salty?", "What is two plus two?"]
MAX_RSS_GROWTH = 64 << 20  # after warm-up; a leak of even a few KiB per stream exceeds it over thousands of streams


class RssSampler(threading.Thread):
    """Samples a process's RSS every ``period_s`` until stopped."""

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.monotonic(), rss_bytes(self.pid)))
            self.done.wait(self.period_s)


async def _stream_worker(stub, seed: int, until: float, stats: dict) -> None:
    """Streams until ``until``, and past it until this worker has been served once: how many streams a
    pod serves in a given time depends on the machine, that every client is served in the end does not."""
    rng = random.Random(seed)
    served = 0
    while time.monotonic() < until or not served:
        req = request(rng.choice(QUESTIONS), rng.choice(ADAPTERS), max_tokens=rng.randint(2, 6))
        started, first, tokens = time.monotonic(), None, 0
        try:
            async for message in stub.Generate(req, timeout=60):
                if first is None:
                    first = time.monotonic() - started
                tokens += len(message.tokens)
        except grpc.aio.AioRpcError as e:
            stats["codes"][e.code().name] += 1
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # back off for as long as the pod's hint says, with jitter so that refused clients
                # do not all come back in the same instant
                hint = retry_after_s(e.trailing_metadata())
                stats["hints"].append(hint)
                await asyncio.sleep((hint if hint is not None else 1.0) * rng.uniform(1.0, 1.5))
            continue
        if tokens == 0:  # an OK stream must carry at least one token
            stats["codes"]["EMPTY_STREAM"] += 1
            continue
        served += 1
        stats["codes"]["OK"] += 1
        stats["ttft"].append(first)
        stats["tokens"] += tokens


async def _load(target: str, streams: int, seconds: float) -> dict:
    stats = {"codes": Counter(), "ttft": [], "tokens": 0, "hints": []}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        until = time.monotonic() + seconds
        # Each worker goes on past ``until`` until it has been served once: a stream the pod never serves
        # fails the test here, by this bound.
        await asyncio.wait_for(asyncio.gather(*(_stream_worker(stub, i, until, stats) for i in range(streams))),
                               timeout=seconds + 120)
    return stats


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_concurrent_streams_fail_only_with_back_pressure_and_memory_stays_steady(pod, sizes, results):
    for adapter in ADAPTERS:  # warm: every adapter read once, every code path run once
        collect(pod, request("Hello!", adapter, max_tokens=4))
    sampler = RssSampler(pod.proc.pid)
    sampler.start()
    started = time.monotonic()
    try:
        stats = asyncio.run(_load(pod.address, sizes.load_streams, sizes.load_seconds))
    finally:
        sampler.done.set()
        sampler.join(5)
    took = time.monotonic() - started
    wait_until(lambda: (s := pod.state()).running_requests == 0 and s.waiting_requests == 0
               and s.kv_cache_usage == 0.0, 10, "pod idle after the load")
    codes = stats["codes"]
    unexpected = {code: n for code, n in codes.items() if code not in ("OK", "RESOURCE_EXHAUSTED")}
    assert not unexpected, f"streams failed: {dict(codes)}"
    hints = stats["hints"]
    assert None not in hints, f"{hints.count(None)} of {len(hints)} refusals carried no retry hint"
    assert len(hints) == codes["RESOURCE_EXHAUSTED"]
    # memory steady: the last quarter of the run holds no more than the second quarter did, within the bound
    samples = sampler.samples
    warm = [rss for t, rss in samples if started + took / 4 <= t <= started + took / 2]
    late = [rss for t, rss in samples if t >= started + 3 * took / 4]
    assert warm and late
    growth = max(late) - max(warm)
    assert growth < MAX_RSS_GROWTH, f"pod RSS grew {growth / 2**20:.0f} MiB under steady load"
    p50, p99 = percentile(stats["ttft"], 0.50), percentile(stats["ttft"], 0.99)
    text, _, last = collect(pod, request("Say hello.", max_tokens=3))  # still serving
    assert last.usage.completion_tokens == 3 and text
    results.record(
        "Load", f"{sizes.load_streams} concurrent streams for {sizes.load_seconds:.0f} s",
        f"{sizes.load_streams} Generate streams at once on one CPU pod (16 sequences per step, queue of "
        f"{POD_MAX_WAITING}), base + {len(DEMO_ADAPTERS)} demo adapters at random, max_tokens 2-6, each stream "
        "retrying after RESOURCE_EXHAUSTED once the pod's retry hint (grpc-retry-pushback-ms) has passed, "
        "with 0-50% jitter",
        "no error other than RESOURCE_EXHAUSTED, each carrying a retry hint; the pod idle afterwards and still "
        "serving; RSS steady",
        streams_in_flight=sizes.load_streams, streams_served=codes["OK"],
        resource_exhausted=codes["RESOURCE_EXHAUSTED"], other_errors=sum(unexpected.values()),
        retry_hint_p50_s=round(percentile(hints, 0.5), 3) if hints else 0.0,
        retry_hint_max_s=round(max(hints), 3) if hints else 0.0,
        tokens_generated=stats["tokens"], ttft_p50_s=round(p50, 3), ttft_p99_s=round(p99, 3),
        rss_warm_mib=round(max(warm) / 2**20, 1), rss_end_mib=round(max(late) / 2**20, 1),
        rss_growth_mib=round(growth / 2**20, 1))


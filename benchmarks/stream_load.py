"""Streaming load on ``lorafleet.v1.Generation/Generate`` from client threads, timed on the client: the
benchmarks' one load generator (benchmarks/serve.py against a pod, benchmarks/router.py against a pod
and the router)."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from lorafleet.v1 import generation_pb2 as g
from lorafleet.v1 import generation_pb2_grpc

PROMPTS = [
    "Explain why the sky is blue.", "Write a short poem about autumn.", "How do vaccines work?",
    "Give me three tips for learning to cook.", "What is a black hole?", "Describe a day at the beach.",
    "Why do cats purr?", "How does a bicycle stay upright?",
]


@dataclass
class Run:
    """One load's totals: output tokens and response messages over the wall time from the first request
    sent to the last stream ended, and per-request TTFT and per-token inter-token gaps (seconds)."""

    label: str
    wall_s: float
    tokens: int
    messages: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s

    @property
    def message_rate(self) -> float:
        return self.messages / self.wall_s


def percentile_ms(values: list[float], q: float) -> str:
    """The ``q`` quantile of ``values`` (seconds) in whole milliseconds, "–" when there are none."""
    if not values:
        return "–"
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1000:.0f}"


def drive(stub: generation_pb2_grpc.GenerationStub, label: str, adapters: list[str | None], prompts: list[str],
          max_tokens: int, concurrency: int | None = None) -> Run:
    """Sends one greedy request per (prompt, adapter) pair (None = base model), each generating exactly
    ``max_tokens`` tokens (EOS ignored), with at most ``concurrency`` streams open at once (None: all at
    once), and reads every stream to its end. The first failed stream's error is raised at the end."""
    run = Run(label, 0.0, 0)
    lock = threading.Lock()
    work = iter(zip(prompts, adapters, strict=True))
    errors: list[Exception] = []

    def one(prompt: str, adapter: str | None) -> None:
        req = g.GenerateRequest(adapter=adapter or "", sampling=g.SamplingParams(max_tokens=max_tokens,
                                                                                  ignore_eos=True))
        req.messages.messages.append(g.ChatMessage(role="user", content=prompt))
        start = last = time.perf_counter()
        ttft, gaps, n, messages = None, [], 0, 0
        for response in stub.Generate(req, timeout=1800):
            now = time.perf_counter()
            messages += 1
            if response.tokens:
                if ttft is None:
                    ttft = now - start
                else:
                    gaps.append((now - last) / len(response.tokens))
                last = now
                n += len(response.tokens)
        with lock:
            run.tokens += n
            run.messages += messages
            run.ttft.append(ttft)
            run.itl.extend(gaps)

    def worker() -> None:
        while True:
            with lock:
                item = next(work, None)
            if item is None or errors:
                return
            try:
                one(*item)
            except Exception as e:  # a failed stream ends the run: its figures would be wrong
                with lock:
                    errors.append(e)

    threads = [threading.Thread(target=worker) for _ in itertools.islice(prompts, concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - start
    if errors:
        raise errors[0]
    return run

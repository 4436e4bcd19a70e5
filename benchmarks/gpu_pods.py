"""The pods benchmarks/gpu.py starts in this process (``data_plane.pod.build_engine``, as the pod
process builds its engine) and the request loads it sends through ``Engine.generate``.

Fields that ``DataPlaneConfig`` may not have (OPTIONAL_FIELDS) are passed only when it has them;
``pod_config`` returns the ones it had to leave out, and gpu.py reports them. ``graph_figures`` says what a
pod's CUDA graphs took and how many of its steps ran eagerly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_plane.config import DataPlaneConfig
from data_plane.engine.engine import Engine
from data_plane.engine.sequence import SamplingParams, TokenOut
from data_plane.metrics import PodMetrics
from data_plane.pod import build_engine

# Fields of DataPlaneConfig that may be absent from the checkout this runs in.
OPTIONAL_FIELDS = ("enforce_eager",)


def pod_config(model_dir: Path, device: str, dtype: str, **fields) -> tuple[DataPlaneConfig, list[str]]:
    """A pod's config for ``model_dir`` with ``fields``; those of OPTIONAL_FIELDS that this
    DataPlaneConfig lacks are left out and returned."""
    known = {f.name for f in dataclasses.fields(DataPlaneConfig)}
    absent = [name for name in fields if name not in known]
    unexpected = [name for name in absent if name not in OPTIONAL_FIELDS]
    if unexpected:
        raise TypeError(f"DataPlaneConfig has no fields {unexpected}")
    given = {name: value for name, value in fields.items() if name in known}
    # Closed batches measure throughput: all requests arrive at once, and a first-token promise would refuse
    # the batch's tail (benchmarks/overload.py measures admission at the defaults).
    given.setdefault("max_queue_delay", 3600.0)
    # The named dtype is the precision used (float32 on CPU is float32 everywhere): parity is against it.
    return DataPlaneConfig(model=model_dir, device=device, dtype=dtype, **given), absent


def free_device(device: str) -> int:
    """Collects what earlier pods left unreferenced and gives their cached device memory back, so that
    the next pod (whose KV cache takes what is free) or transformers has the device to itself; returns
    the bytes still allocated on a CUDA device (0 elsewhere)."""
    gc.collect()
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


@contextlib.asynccontextmanager
async def running_pod(config: DataPlaneConfig) -> AsyncIterator[Engine]:
    """The pod's engine, built (model loaded, KV cache sized, warmed up) on a device freed of earlier
    pods, and started; stopped on exit. Keep no reference to it past the block: ``free_device`` then
    gives its memory back."""
    held = free_device(config.device)
    if held:  # a pod or a benchmark before this one left tensors referenced: this pod gets less KV cache
        print(f"note: {held / 2**30:.2f} GiB of device memory still allocated before this pod's start", flush=True)
    engine = await asyncio.to_thread(build_engine, config, PodMetrics())
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def graph_figures(engine: Engine) -> dict:
    """A pod's CUDA graphs: how many were captured, in how many seconds, the device memory they hold (None
    where none were captured: a CPU pod, --enforce-eager), and the steps it ran eagerly so far (no captured
    shape fits them; lorafleet_engine_eager_steps)."""
    runner = engine.runner.step_runner
    captured = getattr(runner, "captured", None)
    return {"eager_steps": engine.snapshot().eager_steps,
            "graphs": captured.graphs if captured else 0,
            "capture_s": captured.seconds if captured else None,
            "capture_mib": captured.bytes / 2**20 if captured else None}


@dataclass
class Run:
    """One load through ``Engine.generate``: output tokens over the wall time from the first request
    submitted to the last token, each request's time to first token and every inter-token gap (s), and
    each request's tokens."""

    label: str
    wall_s: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    outputs: list[list[TokenOut]] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s


Request = tuple[list[int], str | None]  # prompt token ids, adapter (None: the base model)


async def drive(engine: Engine, label: str, requests: list[Request], new_tokens: int, logprobs: int = 0,
                arrivals: list[float] | None = None) -> Run:
    """Sends every request (greedy, exactly ``new_tokens`` tokens, EOS ignored), each at its offset in
    ``arrivals`` (seconds from the start; None: all at once), and reads every stream to its end."""
    run = Run(label, outputs=[[] for _ in requests])
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, logprobs=logprobs)
    started = time.perf_counter()

    async def one(i: int, ids: list[int], adapter: str | None) -> None:
        if arrivals is not None:
            await asyncio.sleep(max(0.0, started + arrivals[i] - time.perf_counter()))
        sent = last = time.perf_counter()
        async for out in engine.generate(ids, params, adapter):
            now = time.perf_counter()
            if out.tokens:
                if not run.outputs[i]:
                    run.ttft.append(now - sent)
                else:
                    run.itl.append((now - last) / len(out.tokens))
                last = now
                run.outputs[i].extend(out.tokens)
        run.tokens += len(run.outputs[i])

    await asyncio.gather(*(one(i, ids, adapter) for i, (ids, adapter) in enumerate(requests)))
    run.wall_s = time.perf_counter() - started
    return run


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Offsets (s) of ``count`` arrivals of a Poisson process of ``rate`` per second: an open-loop load,
    whose requests come whether or not earlier ones are done."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def prompts(count: int, length: int, bos: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: ``bos``, then random bytes (ids 0-255), so that no two
    share more than their first token and no prefix cache serves one from another."""
    g = torch.Generator().manual_seed(seed)
    return [[bos, *torch.randint(0, 256, (length - 1,), generator=g).tolist()] for _ in range(count)]

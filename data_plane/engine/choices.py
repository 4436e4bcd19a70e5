"""Several choices for one prompt (``SamplingParams.n``), sharing the prompt's prefill.

Choice 0 is admitted first; the others once it has produced its first token. By then every full KV
block of the prompt is in the prefix cache (the step's postprocess caches a sequence's full blocks
before it hands out the token), so the other choices find the prompt there and compute only its last,
partial block: one prefill of the prompt, not n. Without prefix caching each choice prefills. Choice
i draws with the request's seed + i (mod 2**64), or, without a seed, a random seed of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

from conventions.prefix_chain import RoutingPrefix
from data_plane.engine.engine import Engine, StepOutput
from data_plane.engine.sequence import SamplingParams


async def generate_choices(engine: Engine, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
                           request_id: str | None, timeout_s: float | None,
                           tenant: str | None = None, routing: RoutingPrefix | None = None,
                           cache_salt: str = "") -> AsyncIterator[tuple[int, StepOutput]]:
    """(choice index, output) pairs of the ``params.n`` choices as they are produced, interleaved; the first
    error of any choice ends all of them and is raised. Closing the iterator aborts every choice. ``routing``:
    the prompt's routing prefix, which choice 0 records (Engine.generate)."""
    if params.n == 1:
        async with contextlib.aclosing(engine.generate(prompt_ids, params, adapter, request_id, timeout_s,
                                                       tenant, routing, cache_salt)) as outs:
            async for out in outs:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()  # (index, StepOutput | BaseException | None = that choice ended)
    tasks: list[asyncio.Task] = []

    async def run(index: int) -> None:
        seed = None if params.seed is None else (params.seed + index) % (1 << 64)
        rid = None if request_id is None else f"{request_id}/{index}"
        try:
            async for out in engine.generate(prompt_ids, replace(params, seed=seed, n=1), adapter, rid, timeout_s,
                                           tenant, routing if index == 0 else None, cache_salt):
                if index == 0 and len(tasks) == 1:  # the prompt is cached now: the other choices may start
                    tasks.extend(asyncio.create_task(run(i)) for i in range(1, params.n))
                queue.put_nowait((index, out))
        except Exception as e:  # noqa: BLE001 - handed to the caller, who raises it
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks.append(asyncio.create_task(run(0)))
    try:
        running = params.n
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
                if index == 0 and len(tasks) == 1:  # choice 0 ended before any token: an error follows or came
                    running = 0
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

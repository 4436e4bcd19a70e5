"""Several choices for one prompt: the prompt is prefilled once (the other choices find its full blocks in
the prefix cache), choice i draws what a lone request seeded seed + i draws, and closing the stream
ends every choice."""

from __future__ import annotations

import asyncio
import contextlib

from data_plane.config import DataPlaneConfig
from data_plane.engine.choices import generate_choices
from data_plane.engine.sequence import SamplingParams
from data_plane.metrics import PodMetrics
from data_plane.pod import build_engine

PROMPT = [5 + i % 200 for i in range(40)]  # two full blocks of 16 and a partial one


def engine_for(tiny_pod_files):
    model_dir, root, _ = tiny_pod_files
    config = DataPlaneConfig(model=model_dir, dtype="float32", adapter_roots=(root,), max_loras=1, max_cpu_loras=1,
                             max_lora_rank=32, num_kv_blocks=64, max_queue_delay=0)
    engine = build_engine(config, PodMetrics())
    engine.start()
    return engine


async def choices_of(engine, params: SamplingParams) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for index, step in generate_choices(engine, PROMPT, params, None, None, None):
        out.setdefault(index, []).extend(t.id for t in step.tokens)
    return out


def test_three_choices_prefill_the_prompt_once_and_each_draws_as_a_lone_request_seeded_seed_plus_index(
        tiny_pod_files):
    async def run():
        engine = engine_for(tiny_pod_files)
        try:
            params = SamplingParams(max_tokens=6, temperature=1.0, seed=2**64 - 2, ignore_eos=True, n=3)
            together = await choices_of(engine, params)
            prefix = engine.snapshot().prefix
            alone = []
            for i in range(3):  # seeds wrap around 2**64
                lone = SamplingParams(max_tokens=6, temperature=1.0, seed=(2**64 - 2 + i) % 2**64, ignore_eos=True)
                alone.append((await choices_of(engine, lone))[0])
            return together, prefix, alone
        finally:
            await engine.stop()

    together, prefix, alone = asyncio.run(run())
    assert [together[i] for i in range(3)] == alone
    assert len({tuple(t) for t in alone}) == 3  # three seeds, three draws
    # choices 1 and 2 found both full blocks of the prompt cached: 40 + 40 + 40 looked up, 32 + 32 found
    assert (prefix.queried_tokens, prefix.hit_tokens) == (120, 64)


def test_closing_the_stream_of_choices_ends_every_choice(tiny_pod_files):
    async def run():
        engine = engine_for(tiny_pod_files)
        try:
            params = SamplingParams(max_tokens=500, temperature=1.0, ignore_eos=True, n=3)
            seen = set()
            async with contextlib.aclosing(generate_choices(engine, PROMPT, params, None, None, None)) as outs:
                async for index, _ in outs:
                    seen.add(index)
                    if len(seen) == 3:
                        break
            await asyncio.sleep(0.1)
            return seen, len(engine.scheduler.running), engine.scheduler.num_waiting, engine.blocks.usage
        finally:
            await engine.stop()

    seen, running, waiting, usage = asyncio.run(run())
    assert seen == {0, 1, 2} and (running, waiting) == (0, 0)
    assert usage == 0.0  # every block released (cached prefix blocks are kept but not in use)

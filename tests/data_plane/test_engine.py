"""The engine in this process on the demo model: preemption under KV pressure, the bound on how
long a request waits for an adapter slot, and admission by deadline."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from data_plane.config import DataPlaneConfig
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from data_plane.engine.fair_share import account_of
from data_plane.engine.sequence import SamplingParams, Sequence, Timing
from data_plane.errors import DeadlineExceeded, Overloaded
from data_plane.metrics import PodMetrics
from data_plane.pod import build_engine

pytestmark = pytest.mark.slow


def engine_for(demo_model_dir, **limits):
    config = DataPlaneConfig(model=demo_model_dir, adapter_roots=(demo_adapter_dir(DEMO_ADAPTERS[0]).parent,),
                             max_lora_rank=16, **({"dtype": "float32"} | limits))
    engine = build_engine(config, PodMetrics())
    engine.start()
    return engine


async def tokens_of(engine, ids, max_tokens, adapter=None, events=None, label=None) -> list[int]:
    out = []
    async for step in engine.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter):
        if events is not None and not out:
            events.append(("first", label))
        out += [t.id for t in step.tokens]
    if events is not None:
        events.append(("done", label))
    return out


def test_requests_preempted_for_kv_blocks_finish_with_the_tokens_they_get_alone(demo_model_dir):
    async def go():
        # 8 blocks of 16 tokens: four requests of ~30 prompt + 40 new tokens cannot all hold their KV at once
        engine = engine_for(demo_model_dir, max_loras=1, max_cpu_loras=1, max_num_seqs=4, num_kv_blocks=8)
        try:
            prompts = [engine.tokenizer.encode(f"Request {i}: list some facts about the number {i * 7}, please.")
                       for i in range(4)]
            alone = [await tokens_of(engine, p, 40) for p in prompts]
            assert engine.scheduler.num_preemptions == 0
            together = await asyncio.gather(*(tokens_of(engine, p, 40) for p in prompts))
            return alone, together, engine.scheduler.num_preemptions, engine.blocks.usage
        finally:
            await engine.stop()

    alone, together, preemptions, usage = asyncio.run(go())
    assert preemptions > 0
    assert together == alone
    assert usage == 0.0


def test_a_request_waiting_for_the_only_slot_is_not_overtaken_by_later_requests(demo_model_dir):
    async def go():
        engine = engine_for(demo_model_dir, max_loras=1, max_cpu_loras=2, max_num_seqs=4, num_kv_blocks=64)
        try:
            ids = engine.tokenizer.encode("Tell me about ships.")
            events: list[tuple[str, str]] = []
            first = asyncio.create_task(tokens_of(engine, ids, 30, "pirate", events, "pirate-1"))
            while not events:  # pirate-1 holds the only slot
                await asyncio.sleep(0.01)
            other = asyncio.create_task(tokens_of(engine, ids, 4, "shouty", events, "shouty"))
            while "shouty" not in engine.lora.cache:  # loaded: shouty now waits for the slot itself
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            later = asyncio.create_task(tokens_of(engine, ids, 4, "pirate", events, "pirate-2"))
            await asyncio.gather(first, other, later)
            return events
        finally:
            await engine.stop()

    events = asyncio.run(go())
    # pirate-2 could share pirate-1's slot at once, but shouty asked first: it is served first
    assert events.index(("done", "shouty")) < events.index(("first", "pirate-2")), events


def test_a_request_that_ends_between_scheduling_and_the_forward_pass_does_not_fail_the_others(demo_model_dir):
    async def go():
        engine = engine_for(demo_model_dir, max_loras=1, max_cpu_loras=1, max_num_seqs=4, num_kv_blocks=16)
        try:
            ids = engine.tokenizer.encode("Count from one to ten.")
            alone = await tokens_of(engine, ids, 6)
            async with engine.model_lock:  # the loop schedules both requests, then waits here for the model
                kept = asyncio.create_task(tokens_of(engine, ids, 6))
                ended = engine.generate(ids, SamplingParams(max_tokens=6, ignore_eos=True), None, "ends-early")
                first = asyncio.create_task(anext(ended))
                for _ in range(200):
                    if len(engine.scheduler.running) == 2:
                        break
                    await asyncio.sleep(0.01)
                assert len(engine.scheduler.running) == 2, "both requests should be in the scheduled step"
                engine.abort("ends-early")  # frees its KV blocks while the step waits for the lock
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            return alone, await kept, engine.blocks.usage
        finally:
            await engine.stop()

    alone, kept, usage = asyncio.run(go())
    assert kept == alone
    assert usage == 0.0


def test_a_load_that_evicts_a_slot_resident_adapter_waits_for_the_model_lock(demo_model_dir):
    # The eviction clears the victim's slot, which a forward pass running meanwhile may be reading.
    async def go():
        engine = engine_for(demo_model_dir, max_loras=1, max_cpu_loras=1, max_num_seqs=2, num_kv_blocks=16)
        root = demo_adapter_dir(DEMO_ADAPTERS[0]).parent
        try:
            await tokens_of(engine, engine.tokenizer.encode("Hello"), 2, adapter="pirate")  # pirate now in a slot
            assert engine.lora.cache.slot_of("pirate") is not None
            async with engine.model_lock:  # as a forward pass does
                load = asyncio.create_task(engine.adapters.load("shouty", str(root / "shouty")))
                for _ in range(150):
                    if load.done() or "pirate" not in engine.lora.cache:
                        break
                    await asyncio.sleep(0.01)
                during = ("pirate" in engine.lora.cache, engine.lora.cache.slot_of("pirate"), load.done())
            await load
            return during, "pirate" in engine.lora.cache, "shouty" in engine.lora.cache
        finally:
            await engine.stop()

    (kept, slot, finished), pirate_after, shouty_after = asyncio.run(go())
    assert kept and slot is not None and not finished, "the load evicted a slot while the model lock was held"
    assert not pirate_after and shouty_after


def refusals(engine, reason: str) -> float:
    return engine.metrics.registry.get_sample_value("lorafleet_requests_refused_total", {"reason": reason})


def test_a_request_that_would_start_after_its_deadline_is_refused_with_a_hint_and_one_that_expires_queued_leaves(
        demo_model_dir):
    async def go():
        engine = engine_for(demo_model_dir, max_loras=1, max_cpu_loras=1, max_num_seqs=1, num_kv_blocks=64,
                            max_queue_delay=0.0)
        try:
            ids = engine.tokenizer.encode("Tell me a very long story about the sea.")
            params = SamplingParams(max_tokens=600, ignore_eos=True)
            await tokens_of(engine, ids, 20)  # the base model is served more than the adapter, whose
            await tokens_of(engine, ids, 1, DEMO_ADAPTERS[0])  # slot now holds it
            short = engine.generate(ids, SamplingParams(max_tokens=4), None, "short", timeout_s=3.0)
            long = engine.generate(ids, params, DEMO_ADAPTERS[0], "long")
            # "short" is admitted first, with nothing queued, so the plan of the queue knows nothing of "long",
            # which arrives next on an adapter served less than the base model and goes first to the one
            # seat: short's deadline passes while it waits (long decodes 600 tokens, far past 3 s on any CPU).
            expired, first = await asyncio.gather(anext(short), anext(long), return_exceptions=True)
            waiting_after_expiry = engine.scheduler.num_waiting
            for _ in range(5):
                await anext(long)  # steps are timed now: a new request would wait ~595 steps for the seat
            with pytest.raises(Overloaded) as refused:
                await anext(engine.generate(ids, SamplingParams(max_tokens=4), None, "late", timeout_s=0.2))
            untimed = engine.generate(ids, SamplingParams(max_tokens=1), None, "no-deadline")
            queued = asyncio.create_task(anext(untimed))  # no deadline and no --max-queue-delay: it waits
            await asyncio.sleep(0.1)
            state = (engine.scheduler.num_waiting, len(engine.scheduler.running))
            await long.aclose()
            await queued
            counts = (refusals(engine, "expired"), refusals(engine, "deadline"), refusals(engine, "queue_delay"))
            flooding = engine.scheduler.flooding(time.monotonic())
            return first, expired, waiting_after_expiry, refused.value, state, counts, flooding
        finally:
            await engine.stop()

    first, expired, waiting_after_expiry, refused, state, counts, flooding = asyncio.run(go())
    assert first.tokens and isinstance(expired, DeadlineExceeded) and "deadline passed" in str(expired)
    assert waiting_after_expiry == 0
    assert "after its deadline" in str(refused) and 0.05 <= refused.retry_after_s <= 60
    assert state == (1, 1)  # the refused request was never queued; the one without a deadline is
    assert counts == (1, 1, 0)
    assert flooding == set()  # a request refused for its own deadline is no sign of a flood


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")])
def test_a_cached_prefix_gives_the_tokens_and_logprobs_a_cold_prefill_gives(demo_model_dir, dtype, kv_cache_dtype):
    # (over an FP8 KV cache a prompt's own keys are read back quantized too, so its cached blocks are what it read)
    system = ("You are a careful assistant for a shipping company. Answer in two short sentences, name the "
              "port, and never invent tracking numbers. ") * 3

    async def run(prefix_caching: bool):
        engine = engine_for(demo_model_dir, max_loras=2, max_cpu_loras=2, prefix_caching=prefix_caching, dtype=dtype,
                            kv_cache_dtype=kv_cache_dtype)
        try:
            out = {}
            for adapter in (None, DEMO_ADAPTERS[0]):
                first = engine.tokenizer.encode(system + "Where is my parcel from Oslo?")
                second = engine.tokenizer.encode(system + "When does the ferry to Bergen leave?")
                for name, ids in (("first", first), ("second", second)):
                    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
                    steps = [step async for step in engine.generate(ids, params, adapter)]
                    out[adapter, name] = [(t.id, t.logprob, t.top) for step in steps for t in step.tokens]
            shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
            return out, engine.snapshot().prefix, shared
        finally:
            await engine.stop()

    cold, no_cache, _ = asyncio.run(run(False))
    warm, prefix, shared = asyncio.run(run(True))
    assert no_cache is None
    assert warm == cold  # tokens, log-probabilities and alternatives, bit for bit
    # each second prompt found the full blocks of the tokens it shares with the first (base model, adapter)
    assert shared >= 48 and prefix.hit_tokens == 2 * (shared // 16) * 16
    assert prefix.cached_blocks > 0 and prefix.queried_tokens > prefix.hit_tokens


def test_a_prompt_longer_than_the_queue_delay_is_served_when_no_more_work_is_ahead_than_its_own(demo_model_dir):
    async def go():
        engine = engine_for(demo_model_dir, max_queue_delay=0.001, num_kv_blocks=64)
        try:
            words = ("harbour", "lantern", "compass", "island", "anchor", "tide")
            prompts = [engine.tokenizer.encode(" ".join(words[(i + j) % 6] for j in range(160))) for i in range(4)]
            await tokens_of(engine, prompts[0][:8], 2)  # steps are timed: the estimate is on
            own_s = engine.delays.own_prefill(len(prompts[0]), engine.scheduler.load())
            # alone on an idle pod, a prompt whose own prefill is far over the 1 ms queue delay is served
            alone = await tokens_of(engine, prompts[0], 1)
            # behind one prompt like it, it comes within twice its own prefill (both in one step); behind
            # two, after more than that (a prompt of 160 words costs more than a step's fixed part): refused,
            # never queued
            ahead = [engine.generate(p, SamplingParams(max_tokens=1), None, f"ahead-{i}")
                     for i, p in enumerate(prompts[1:3])]
            behind = engine.generate(prompts[3], SamplingParams(max_tokens=1), None, "behind")
            *firsts, refused = await asyncio.gather(*map(anext, ahead), anext(behind), return_exceptions=True)
            for stream in ahead:
                await stream.aclose()
            return own_s, alone, firsts, refused, engine.scheduler.num_waiting, engine.scheduler.flooding(
                time.monotonic())
        finally:
            await engine.stop()

    own_s, alone, firsts, refused, waiting, flooding = asyncio.run(go())
    assert own_s > 0.001 and len(alone) == 1 and all(first.tokens for first in firsts)
    assert isinstance(refused, Overloaded) and "--max-queue-delay of 0.001 s" in str(refused), refused
    # the hint is the estimated wait less what the pod allows it, twice its own prefill (the estimate's
    # correction from the first tokens since own_s was taken moves that by less than half)
    wait_s = float(re.search(r"first token in about ([0-9.]+) s", str(refused)).group(1))
    assert refused.retry_after_s <= wait_s - own_s
    assert waiting == 0
    assert flooding == {account_of(None, None)}  # turned away past the promise: the base model floods the pod


def test_a_first_token_that_waited_for_its_adapters_load_teaches_the_estimate_nothing(demo_model_dir):
    async def go():
        engine = engine_for(demo_model_dir)
        try:
            await tokens_of(engine, engine.tokenizer.encode("warm"), 1)
            before = engine.delays.bias
            cold = Sequence("cold", None, [1, 2, 3], SamplingParams(max_tokens=1), 4, arrival=time.monotonic() - 3.0,
                            timing=Timing(ttft_estimate=1.0, waited_for_adapter=True))
            engine._record_latency(cold, time.monotonic())  # three times later than estimated: the load
            after_cold = engine.delays.bias
            warm = Sequence("warm", None, [1, 2, 3], SamplingParams(max_tokens=1), 4, arrival=time.monotonic() - 3.0,
                            timing=Timing(ttft_estimate=1.0))
            engine._record_latency(warm, time.monotonic())
            return before, after_cold, engine.delays.bias
        finally:
            await engine.stop()

    before, after_cold, after_warm = asyncio.run(go())
    assert after_cold == before
    assert after_warm > before  # the same lateness without a load does correct the estimate


def test_the_start_up_steps_time_what_the_pods_step_model_needs(demo_model_dir):
    """Where a CPU pod's projections run in row tiles (as its CPU's probe chose, ``row_rule``) it times a
    prompt that fills a decode's tile and one a token longer; where they run in one call over all rows it
    has no tile feature and times the six shapes every pod times. No pod has a cost for steps that prefill
    beside decodes apart from their sequences and tokens: on a GPU those replay graphs too."""
    from data_plane.engine.step_cost import TILE

    engine = build_engine(DataPlaneConfig(model=demo_model_dir, dtype="float32", max_num_seqs=4), PodMetrics())
    tile = engine.costs.row_tile
    assert tile == engine.model.row_tile
    assert (tile > 0) is not engine.model.row_rule.projection.whole
    shapes = [features for features, _ in engine.costs._prior]
    assert all(len(f) == TILE + 1 for f in shapes)
    if tile:
        filled, crossed = shapes[-2:]  # one decode beside a prompt of tile - 1 and of tile tokens
        assert filled[1:3] == (1.0, tile - 1) and filled[TILE] == 1.0 and crossed[1:3] == (1.0, tile)
        assert crossed[TILE] == 2.0
    else:
        assert len(shapes) == 6 and all(f[TILE] == 0.0 for f in shapes)  # the six shapes every pod times

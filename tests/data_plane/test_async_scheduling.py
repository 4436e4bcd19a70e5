"""Asynchronous scheduling gives the synchronous loop's tokens bit for bit: in every precision a CPU pod runs,
one workload of many requests at once (greedy and drawn, log-probabilities, a stop string, a structured output,
n > 1, short max_tokens, a cancelled stream) on a KV cache small enough to preempt, streams the same tokens,
log-probabilities, texts, finish reasons and usage through both loops. The asynchronous loop really overlaps
(steps decode tokens still on the device) and a request that a step ends may hold one slot in the step launched
beside it, whose output is dropped: never streamed, never counted.

The tiny Llama of ``conftest.TINY`` runs it, with a byte-level decoder on its word-level tokenizer (the grammar
engine needs one): token ``w5`` is the text "w5".
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections import Counter

import pytest
from tokenizers import Tokenizer, decoders

from data_plane.config import DataPlaneConfig
from data_plane.engine.choices import generate_choices
from data_plane.engine.grammar import Constraint, ConstraintKind
from data_plane.engine.sequence import FinishReason, SamplingParams
from data_plane.errors import StepFailed
from data_plane.metrics import PodMetrics
from data_plane.pod import build_engine
from tests.data_plane.conftest import ADAPTERS, TINY

# every token is "w" and digits: a token beginning "w1", two to four beginning "w2", one beginning "w3", then EOS
REGEX = "w1[0-9]*(w2[0-9]*){2,4}w3[0-9]*"
CANCEL_AFTER = 3  # tokens the cancelled stream reads before it closes


@pytest.fixture(scope="module")
def model_dir(tiny_pod_files, tmp_path_factory):
    """The tiny pod's model with a byte-level decoder: the grammar engine reads each token's bytes from it."""
    source, root, _ = tiny_pod_files
    target = tmp_path_factory.mktemp("tiny-decoded") / "model"
    shutil.copytree(source, target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(target / "tokenizer.json"))
    return target, root


def prompt(i: int, length: int) -> list[int]:
    return [3 + (i * 37 + j * 11) % (TINY["vocab_size"] - 3) for j in range(length)]


def workload(stop: str, cancel: bool = True, constrained: bool = True) -> list[tuple[str, str | None, list[int],
                                                                                  SamplingParams]]:
    """(label, adapter, prompt ids, parameters) of every request, all sent at once; ``cancel``: with the stream
    closed after CANCEL_AFTER tokens; ``constrained``: with the structured output (whose steps wait for the
    tokens before them)."""
    adapters = [None, *ADAPTERS]
    out = []
    for i in range(6):  # greedy and drawn, with and without adapters, prompts of 3 to 45 tokens
        params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2) if i % 2 else \
            SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True, logprobs=1)
        out.append((f"free-{i}", adapters[i % len(adapters)], prompt(i, 3 + 8 * i), params))
    out += [
        ("stop", None, prompt(10, 20), SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,), logprobs=3)),
        ("short", adapters[1], prompt(11, 30), SamplingParams(max_tokens=2, ignore_eos=True)),
        ("choices", None, prompt(13, 40), SamplingParams(max_tokens=8, temperature=1.0, seed=9, ignore_eos=True, n=3)),
    ]
    if constrained:
        out.append(("regex", adapters[2], prompt(12, 9), SamplingParams(
            max_tokens=12, temperature=0.7, seed=5, logprobs=2, constraint=Constraint(ConstraintKind.REGEX, REGEX))))
    if cancel:
        out.append(("cancelled", adapters[3], prompt(14, 17), SamplingParams(max_tokens=12, ignore_eos=True)))
    return out


async def _answer(engine, label, adapter, ids, params) -> list[tuple]:
    """Every message of the request's streams, choice by choice (their interleaving is timing): (choice, token
    ids, logprobs and alternatives, text, finish reason, usage)."""
    out = []
    async with contextlib.aclosing(generate_choices(engine, ids, params, adapter, f"r-{label}", None)) as stream:
        async for index, step in stream:
            out.append((index, tuple((t.id, t.logprob, t.top) for t in step.tokens), step.text, step.finish_reason,
                        step.prompt_tokens, step.completion_tokens))
            if label == "cancelled" and len(out) == CANCEL_AFTER:
                break
    return sorted(out, key=lambda message: message[0])  # stable: each choice's messages keep their order


def serve(model_dir, root, dtype: str, async_scheduling: bool, stop: str, num_kv_blocks: int = 9,
          cancel: bool = True, constrained: bool = True) -> dict:
    """The workload's answers on a pod of ``dtype`` and what the engine saw: preemptions, steps whose inputs
    decoded a token still on the device, tokens counted, blocks in use at the end, and per request the
    tokens its steps sampled (dropped ones included)."""
    config = DataPlaneConfig(model=model_dir, dtype=dtype, adapter_roots=(root,), max_loras=len(ADAPTERS),
                             max_cpu_loras=len(ADAPTERS), max_lora_rank=32, max_num_seqs=16,
                             max_num_batched_tokens=32, block_size=16, num_kv_blocks=num_kv_blocks,
                             max_queue_delay=0, async_scheduling=async_scheduling)

    async def run():
        metrics = PodMetrics()
        engine = build_engine(config, metrics)
        fed, sampled = [0], Counter()
        prepare = engine.runner.prepare

        def counting(batch):
            step = prepare(batch)
            fed[0] += step.fed > 0
            sampled.update(batch[k].seq.request_id for k in step.sampled_positions)
            return step

        engine.runner.prepare = counting
        # no step runs until every request is queued: the same start whatever the machine's pace (a request
        # admitted while others' steps already ran could find the blocks free, and nothing be preempted)
        queued, has_work = [False], engine.scheduler.has_work
        engine.scheduler.has_work = lambda: queued[0] and has_work()
        engine.start()
        try:
            for name in ADAPTERS:  # resident before the requests: none waits for its load, all compete for blocks
                await engine.adapters.load(name, str(root / name))
            requests = workload(stop, cancel, constrained)
            answering = asyncio.gather(*(_answer(engine, *request) for request in requests))
            for _ in range(1000):  # the structured output's grammar is compiled on a thread before it queues
                if engine.scheduler.num_waiting >= len(requests):
                    break
                await asyncio.sleep(0.01)
            assert engine.scheduler.num_waiting == len(requests), "the requests were not all queued"
            queued[0] = True
            answers = await answering
            for _ in range(100):  # the cancelled stream's blocks go back as its abort is seen
                if engine.snapshot().running == 0:
                    break
                await asyncio.sleep(0.01)
            state = engine.snapshot()
            counted = metrics.generated_tokens._value.get()
            return dict(answers={request[0]: a for request, a in zip(requests, answers, strict=True)},
                        preemptions=state.preemptions, fed=fed[0], counted=counted, sampled=sampled,
                        kv_usage=state.kv_usage, running=state.running)
        finally:
            await engine.stop()

    return asyncio.run(run())


def tokens_of(messages) -> list[int]:
    return [t[0] for m in messages for t in m[1]]


def stop_string(directory, root, dtype: str) -> str:
    """A stop string the "stop" request meets mid-way in ``dtype``: the text of its fifth token, read from a run
    without it (greedy: the same tokens up to there)."""
    free = serve(directory, root, dtype, False, stop="unused", num_kv_blocks=64, cancel=False)["answers"]["stop"]
    tokens = tokens_of(free)
    assert len(tokens) == 16
    return f"w{tokens[4]}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16-matmul", "bfloat16"])
def test_the_asynchronous_loop_streams_the_synchronous_loops_tokens_bit_for_bit(model_dir, dtype):
    directory, root = model_dir
    stop = stop_string(directory, root, dtype)
    sync = serve(directory, root, dtype, False, stop)
    overlapped = serve(directory, root, dtype, True, stop)
    assert overlapped["answers"] == sync["answers"]
    answers = sync["answers"]
    # the workload does what it says, so that the comparison covers it
    assert sync["preemptions"] > 0 and overlapped["preemptions"] > 0, "no request was preempted"
    assert overlapped["fed"] > 0 and sync["fed"] == 0, "the asynchronous loop never decoded a token on the device"
    assert answers["stop"][-1][3] is FinishReason.STOP and len(tokens_of(answers["stop"])) < 16
    assert answers["regex"][-1][3] is FinishReason.STOP
    assert answers["short"][-1][3] is FinishReason.LENGTH and len(tokens_of(answers["short"])) == 2
    assert sorted({m[0] for m in answers["choices"]}) == [0, 1, 2]
    assert len(answers["cancelled"]) == CANCEL_AFTER
    for result in (sync, overlapped):  # nothing left running or holding blocks (the cancelled stream's freed)
        assert result["running"] == 0 and result["kv_usage"] == 0.0


def test_a_request_ended_by_a_step_has_its_slot_in_the_next_step_dropped(model_dir):
    """A request that step N ends (its stop string) was scheduled into step N+1 before N's tokens were read:
    the token that step samples for it is neither streamed nor counted. (No structured output here: a step
    with a constrained sequence waits for the tokens before it, which would leave this one's slot out.)"""
    directory, root = model_dir
    stop = stop_string(directory, root, "float32")
    sync = serve(directory, root, "float32", False, stop, num_kv_blocks=64, cancel=False, constrained=False)
    overlapped = serve(directory, root, "float32", True, stop, num_kv_blocks=64, cancel=False, constrained=False)
    assert overlapped["answers"] == sync["answers"]
    streamed = {label: len(tokens_of(messages)) for label, messages in overlapped["answers"].items()}
    stop = overlapped["answers"]["stop"]
    assert stop[-1][3] is FinishReason.STOP and stop[-1][5] == streamed["stop"]
    # the stop request's steps sampled one token more than it streamed: the dropped slot
    assert overlapped["sampled"]["r-stop"] == streamed["stop"] + 1
    assert sync["sampled"]["r-stop"] == streamed["stop"]
    # a request at its max_tokens is known to end with its pending token: it takes no slot after it
    assert overlapped["sampled"]["r-short"] == streamed["short"] == 2
    # only streamed tokens are counted
    assert overlapped["counted"] == sync["counted"] == sum(streamed.values())


def test_an_adapter_load_is_not_starved_by_steps_in_flight(model_dir):
    """The asynchronous loop keeps the model lock from one step to the next while steps are in flight, and lets
    it go between two steps as soon as a load waits: the load lands while a long stream still runs."""
    directory, root = model_dir
    config = DataPlaneConfig(model=directory, dtype="float32", adapter_roots=(root,), max_loras=2, max_cpu_loras=4,
                             max_lora_rank=32, num_kv_blocks=64, max_queue_delay=0, async_scheduling=True)

    async def run():
        metrics = PodMetrics()
        engine = build_engine(config, metrics)
        engine.start()
        try:
            stream = engine.generate(prompt(0, 8), SamplingParams(max_tokens=400, ignore_eos=True))
            await anext(stream)
            name = next(iter(ADAPTERS))
            await asyncio.wait_for(engine.adapters.load(name, str(root / name)), timeout=30)
            generated = metrics.generated_tokens._value.get()  # when the load landed
            rest = [out async for out in stream]
            return generated, rest
        finally:
            await engine.stop()

    generated, rest = asyncio.run(run())
    assert rest[-1].finish_reason is FinishReason.LENGTH and rest[-1].completion_tokens == 400
    assert generated < 300, f"the load waited for {generated} of the stream's 400 tokens"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_ends_its_requests_and_offers_the_prefix_cache_nothing_it_never_computed(model_dir,
                                                                                           async_scheduling):
    directory, root = model_dir
    config = DataPlaneConfig(model=directory, dtype="float32", adapter_roots=(root,), max_loras=1, max_cpu_loras=1,
                             max_lora_rank=32, num_kv_blocks=64, max_queue_delay=0, async_scheduling=async_scheduling)
    ids = prompt(3, 40)  # two full blocks of 16
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def run():
        engine = build_engine(config, PodMetrics())
        execute, calls = engine.runner.execute, []

        def failing_once(step):
            calls.append(step)
            if len(calls) == 1:
                raise RuntimeError("device lost")
            return execute(step)

        engine.runner.execute = failing_once
        engine.start()
        try:
            with pytest.raises(StepFailed, match="device lost"):
                [out async for out in engine.generate(ids, params)]
            again = [t.id async for out in engine.generate(ids, params) for t in out.tokens]
            return again, engine.snapshot().prefix
        finally:
            await engine.stop()

    again, prefix = asyncio.run(run())
    assert len(again) == 4
    assert prefix.hit_tokens == 0, "the failed prefill's blocks were offered to the prefix cache"

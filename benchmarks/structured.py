"""Structured output's cost to the step loop: throughput and inter-token latency of a mixed-adapter batch
with 0%, 50% and 100% of its requests constrained to a JSON schema, in one run on one engine, and the
compile time of each of a few constraints.

The pod's engine runs in this process (``data_plane.pod.build_engine``, float32 on CPU, warmed up),
the demo adapters loaded before the clock starts. Each round sends ``--batch`` requests at once,
adapters round-robin over the base model and the demo adapters, greedy, exactly ``--max-tokens`` new
tokens each: free requests ignore EOS, and the schema (a log of at least 100 entries, each an object
with an enum and an integer) cannot be complete sooner, so every mode computes the same number of
tokens. The schema is compiled once before the clock starts (the target is the cost once compiled).
Modes run in turn, ``--rounds`` times over, so that drift of a shared machine spreads over all of them;
ratios are against 0% of the same run.

    python benchmarks/structured.py [--batch 8] [--max-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import llguidance
import torch
from processes import cpu_model, load_average  # benchmarks/processes.py
from stream_load import percentile_ms  # benchmarks/stream_load.py

from data_plane.config import DataPlaneConfig
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from data_plane.engine.grammar import Constraint, ConstraintKind, GrammarCompiler
from data_plane.engine.sequence import SamplingParams
from data_plane.metrics import PodMetrics
from data_plane.model.demo_model import ensure_demo_model
from data_plane.pod import build_engine

PORTS = ["Oslo", "Bergen", "Rotterdam", "Hamburg", "Gdansk"]
LOG = {"type": "object", "properties": {"log": {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"port": {"enum": PORTS}, "tons": {"type": "integer", "minimum": 0}},
    "required": ["port", "tons"], "additionalProperties": False}}}, "required": ["log"], "additionalProperties": False}
SHIP = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "crew": {"type": "integer", "minimum": 1},
    "flag": {"enum": ["black", "red", "white"]},
    "captain": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]},
    "cannons": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
    "required": ["name", "crew", "flag", "captain", "cannons"], "additionalProperties": False}
TOOL_CALL = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}, "required": ["name", "arguments"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"const": "get_time"}, "arguments": {"type": "object"}},
     "required": ["name", "arguments"], "additionalProperties": False}]}}
CONSTRAINTS = {
    "log schema (the run's)": Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(LOG)),
    "nested ship schema": Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SHIP)),
    "required tool call, 2 functions": Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(TOOL_CALL)),
    "json_object": Constraint(ConstraintKind.JSON_OBJECT),
    "regex": Constraint(ConstraintKind.REGEX, r"[A-Z][a-z]{2,8} (North|South) [0-9]{2}"),
    "Lark grammar": Constraint(ConstraintKind.GRAMMAR, 'start: "Sail " DIR " at " NUM " knots"\n'
                                                       'DIR: "north" | "south"\nNUM: /[1-9][0-9]?/'),
}
PROMPT = "Write the harbour log of the week as JSON: for each call, the port and the tons unloaded."


async def run_mode(engine, prompt: list[int], constrained: int, batch: int, max_tokens: int) -> dict:
    """One round: ``batch`` requests at once, the first ``constrained`` of them (spread over the adapters
    like the others) held to the schema."""
    adapters = [[None, *DEMO_ADAPTERS][i % (len(DEMO_ADAPTERS) + 1)] for i in range(batch)]
    gaps, tokens = [], [0]

    async def one(i: int) -> None:
        constraint = CONSTRAINTS["log schema (the run's)"] if i < constrained else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, constraint=constraint)
        last = None
        async for step in engine.generate(prompt, params, adapters[i]):
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            tokens[0] += len(step.tokens)

    steps = engine.metrics.registry.get_sample_value
    steps_before = (steps("lorafleet_engine_step_seconds_sum"), steps("lorafleet_engine_step_seconds_count"))
    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(batch)))
    return {"wall": time.monotonic() - started, "tokens": tokens[0], "gaps": gaps,
            "step_s": steps("lorafleet_engine_step_seconds_sum") - steps_before[0],
            "steps": steps("lorafleet_engine_step_seconds_count") - steps_before[1]}


async def serve(args, model_dir) -> dict[int, dict]:
    config = DataPlaneConfig(model=model_dir, adapter_roots=(demo_adapter_dir(DEMO_ADAPTERS[0]).parent,),
                             dtype="float32", max_loras=len(DEMO_ADAPTERS), max_cpu_loras=len(DEMO_ADAPTERS),
                             max_lora_rank=16, max_queue_delay=0)
    engine = build_engine(config, PodMetrics())
    engine.start()
    try:
        for name in DEMO_ADAPTERS:
            await engine.adapters.ensure(name)
        tok = engine.tokenizer
        prompt = tok.encode(tok.render_chat([{"role": "user", "content": PROMPT}]))
        await run_mode(engine, prompt, args.batch, args.batch, 4)  # compiles the schema, warms every path
        results = {pct: {"wall": 0.0, "tokens": 0, "gaps": [], "step_s": 0.0, "steps": 0} for pct in (0, 50, 100)}
        for round_ in range(args.rounds):
            for pct in (order := list(results))[round_ % 3:] + order[: round_ % 3]:  # each round starts elsewhere
                r = await run_mode(engine, prompt, args.batch * pct // 100, args.batch, args.max_tokens)
                for key in results[pct]:
                    results[pct][key] += r[key]
        return results
    finally:
        await engine.stop()


def compile_times(model_dir) -> tuple[float, dict[str, float]]:
    """(tokenizer preparation s, {constraint: cold compile s}) on a fresh compiler."""
    from data_plane.model.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    times: list[float] = []
    compiler = GrammarCompiler(tok.to_json, tok.vocab_size, tok.eos_token_ids, times.append)
    start = time.perf_counter()
    compiler._tokens()  # noqa: SLF001 - the one-off preparation, timed apart from the compiles
    prep = time.perf_counter() - start
    out = {}
    for name, constraint in CONSTRAINTS.items():
        compiler.state(constraint)
        out[name] = times[-1]
    return prep, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="requests at once")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model_dir = ensure_demo_model(quiet=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, llguidance {llguidance.__version__}, load average {load_average()}; demo model, float32, "
          f"{args.batch} requests at once (base + {len(DEMO_ADAPTERS)} adapters round-robin), {args.max_tokens} "
          f"new tokens each, greedy, {args.rounds} rounds\n")
    results = asyncio.run(serve(args, model_dir))
    base = results[0]["tokens"] / results[0]["wall"]
    base_step = results[0]["step_s"] / results[0]["steps"]
    print("| constrained | tokens | output tok/s | vs 0% | ITL p50 ms | ITL p99 ms | mean step ms | vs 0% |")
    print("|---|---|---|---|---|---|---|---|")
    for pct, r in results.items():
        rate, step = r["tokens"] / r["wall"], r["step_s"] / r["steps"]
        print(f"| {pct}% | {r['tokens']} | {rate:.1f} | {rate / base:.3f} | {percentile_ms(r['gaps'], 0.5)} | "
              f"{percentile_ms(r['gaps'], 0.99)} | {step * 1e3:.1f} | {step / base_step:.3f} |")
    prep, times = compile_times(model_dir)
    print(f"\ntoken table of the tokenizer (once per pod, at the first constrained request): {prep * 1e3:.0f} ms\n")
    print("| constraint | compile ms (cold) |")
    print("|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e3:.2f} |")


if __name__ == "__main__":
    main()

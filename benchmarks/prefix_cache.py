"""A chat workload with a shared system prompt of ~1,000 tokens and mixed adapters, through the pod's
engine in this process, with prefix caching and without it, in one run: time to first token p50/p99,
output throughput, and the prefix cache's hit rate.

Requests arrive open-loop (Poisson, ``--rate`` per second, seeded): the system prompt, then one of
``--requests`` distinct user questions, rendered with the chat template; adapters round-robin over
the base model and the demo adapters; greedy, ``--max-tokens`` tokens each. Each mode gets a fresh
engine (``data_plane.pod.build_engine``, float32 on CPU), warmed up, the same arrivals. A third mode puts
every request in one tenant's cache scope (GenerateRequest.cache_salt, as a router with tenants sets it): what
isolating tenants costs a tenant hitting its own prefixes.

    python benchmarks/prefix_cache.py [--requests 24] [--rate 0.5] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch
from processes import cpu_model, load_average  # benchmarks/processes.py
from stream_load import percentile_ms  # benchmarks/stream_load.py

from data_plane.config import DataPlaneConfig
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from data_plane.engine.sequence import SamplingParams
from data_plane.metrics import PodMetrics
from data_plane.model.demo_model import ensure_demo_model
from data_plane.model.tokenizer import Tokenizer
from data_plane.pod import build_engine

SYSTEM = ("You are the support assistant of Northwind Freight, a shipping company with ports in Oslo, Bergen, "
          "Rotterdam, Hamburg and Gdansk. Answer in two short sentences. Name the port a question is about. "
          "Never invent tracking numbers, prices or dates; when you do not know, say which desk to call. "
          "Parcels under 30 kg go by ferry, heavier ones by container ship; customs forms are needed outside "
          "the EEA. Office hours are 8 to 16 on weekdays. ")
QUESTIONS = [f"Question {i}: " + q for i, q in enumerate([
    "where is my parcel from Oslo?", "when does the ferry to Bergen leave?", "can I ship a bicycle?",
    "what forms do I need for Gdansk?", "how heavy may a parcel be?", "is Rotterdam open on Sunday?",
    "how do I track a container?", "who pays customs in Hamburg?"] * 4)]


async def serve(prefix_caching: bool, prompts: list[list[int]], adapters: list[str | None],
                arrivals: list[float], max_tokens: int, model_dir, cache_salt: str = "") -> dict:
    config = DataPlaneConfig(model=model_dir, adapter_roots=(demo_adapter_dir(DEMO_ADAPTERS[0]).parent,),
                             dtype="float32", max_loras=len(DEMO_ADAPTERS), max_cpu_loras=len(DEMO_ADAPTERS),
                             max_lora_rank=16, prefix_caching=prefix_caching, max_queue_delay=0)
    engine = build_engine(config, PodMetrics())
    engine.start()
    for name in DEMO_ADAPTERS:  # loaded before the clock starts: the figures are the prefill's, not loads'
        await engine.adapters.ensure(name)
    ttft, tokens = [], [0]

    async def one(i: int) -> None:
        await asyncio.sleep(arrivals[i])
        sent, first = time.monotonic(), True
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for step in engine.generate(prompts[i], params, adapters[i], cache_salt=cache_salt):
            if step.tokens and first:
                ttft.append(time.monotonic() - sent)
                first = False
            tokens[0] += len(step.tokens)

    started = time.monotonic()
    try:
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.monotonic() - started
        prefix = engine.snapshot().prefix
    finally:
        await engine.stop()
    hit = prefix.hit_tokens / prefix.queried_tokens if prefix else 0.0
    return {"ttft": ttft, "throughput": tokens[0] / wall, "wall": wall, "hit": hit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=0.5, help="arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir = ensure_demo_model(quiet=True)
    tokenizer = Tokenizer(model_dir)
    system = SYSTEM * 9
    prompts = [tokenizer.encode(tokenizer.render_chat([{"role": "system", "content": system},
                                                       {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
               for i in range(args.requests)]
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in range(args.requests):
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    adapters = [[None, *DEMO_ADAPTERS][i % (len(DEMO_ADAPTERS) + 1)] for i in range(args.requests)]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, load average {load_average()}; demo model, float32, {args.requests} requests at "
          f"{args.rate}/s, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens (system prompt "
          f"{len(tokenizer.encode(system))}), {args.max_tokens} new tokens, adapters: base + {len(DEMO_ADAPTERS)}\n")
    print("| prefix caching | TTFT p50 ms | TTFT p99 ms | output tok/s | wall s | hit rate |")
    print("|---|---|---|---|---|---|")
    # the last mode: every request in one tenant's cache scope, as a router with tenants sends them
    for label, caching, salt in (("off", False, ""), ("on", True, ""), ("on, one tenant's scope", True, "tenant:a")):
        r = asyncio.run(serve(caching, prompts, adapters, arrivals, args.max_tokens, model_dir, salt))
        print(f"| {label} | {percentile_ms(r['ttft'], 0.5)} | {percentile_ms(r['ttft'], 0.99)} | "
              f"{r['throughput']:.1f} | {r['wall']:.1f} | {r['hit']:.2f} |")


if __name__ == "__main__":
    main()

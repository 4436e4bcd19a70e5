"""Greedy decode speed of our engine (one request) against transformers on the demo model, in one run.

Same prompt, same thread count, same number of new tokens (EOS ignored on both sides by
forcing the length). Prints a markdown row for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

import torch

from data_plane.engine.sequence import SamplingParams
from data_plane.local import local_engine, prompt_ids
from data_plane.model.demo_model import ensure_demo_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def _ours(engine, ids, new_tokens) -> float:
    start = time.perf_counter()
    async for _ in engine.generate(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True)):
        pass
    return new_tokens / (time.perf_counter() - start)


def _transformers(hf_model, ids, new_tokens) -> float:
    inputs = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        hf_model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)
    return new_tokens / (time.perf_counter() - start)


async def _run(args, model_dir, hf) -> tuple[int, list[float], list[float]]:
    async with local_engine(model_dir, dtype=args.dtype) as engine:
        ids = prompt_ids(engine, PROMPT)
        await _ours(engine, ids, 8), _transformers(hf, ids, 8)  # warm-up
        ours_tps, hf_tps = [], []
        for _ in range(args.repeats):  # interleaved so that machine noise hits both alike
            ours_tps.append(await _ours(engine, ids, args.new_tokens))
            hf_tps.append(_transformers(hf, ids, args.new_tokens))
    return len(ids), ours_tps, hf_tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoModelForCausalLM

    model_dir = ensure_demo_model(quiet=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    n_prompt, ours_tps, hf_tps = asyncio.run(_run(args, model_dir, hf))
    o, h = statistics.median(ours_tps), statistics.median(hf_tps)
    print(f"| {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()}, {args.threads} threads "
          f"| torch {torch.__version__}, transformers {transformers.__version__} | {args.dtype} | {n_prompt} "
          f"| {args.new_tokens} | {o:.1f} | {h:.1f} | {o / h:.2f} |")


if __name__ == "__main__":
    main()

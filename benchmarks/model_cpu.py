"""Greedy decode speed of our model against transformers on the demo model, in one run.

Same prompt, same thread count, same number of new tokens (EOS ignored on both sides by
forcing the length). Prints a markdown row for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from data_plane.demo_model import ensure_demo_model
from data_plane.local import greedy_stream
from data_plane.model import load_model
from data_plane.model.tokenizer import Tokenizer

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _ours(model, tokenizer, ids, new_tokens) -> float:
    eos = tokenizer.eos_token_ids
    tokenizer.eos_token_ids = ()  # decode exactly new_tokens tokens
    try:
        start = time.perf_counter()
        for _ in greedy_stream(model, tokenizer, ids, new_tokens):
            pass
        return new_tokens / (time.perf_counter() - start)
    finally:
        tokenizer.eos_token_ids = eos


def _transformers(hf_model, ids, new_tokens) -> float:
    inputs = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        hf_model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)
    return new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    import transformers

    model_dir = ensure_demo_model(quiet=True)
    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": PROMPT}]))
    ours = load_model(model_dir, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    _ours(ours, tokenizer, ids, 8), _transformers(hf, ids, 8)  # warm-up
    ours_tps, hf_tps = [], []
    for _ in range(args.repeats):  # interleaved so that machine noise hits both alike
        ours_tps.append(_ours(ours, tokenizer, ids, args.new_tokens))
        hf_tps.append(_transformers(hf, ids, args.new_tokens))
    o, h = statistics.median(ours_tps), statistics.median(hf_tps)
    print(f"| {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()}, {args.threads} threads "
          f"| torch {torch.__version__}, transformers {transformers.__version__} | {args.dtype} | {len(ids)} "
          f"| {args.new_tokens} | {o:.1f} | {h:.1f} | {o / h:.2f} |")


if __name__ == "__main__":
    main()

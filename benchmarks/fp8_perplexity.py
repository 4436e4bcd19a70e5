"""The demo model's perplexity on a held-out text of our own, unquantized and on an FP8 base (issue 43):

    python benchmarks/fp8_perplexity.py [--threads 2]

Each row loads the demo model as a pod would (``load_model``) in one precision: float32 and bfloat16
unquantized; ``--quantization fp8`` (weights quantized per output channel at load) dequantized to float32
or bfloat16, as a CPU pod runs it; and W8A8 (per-token e4m3 activations through torch's CPU ``_scaled_mm``),
the numbers a GPU of compute capability 8.9+ computes. Rows "+kv-fp8" keep the KV cache in float8_e4m3fn
(``--kv-cache-dtype fp8``) with the scales a pod calibrates at start-up (``kv_scales``; the demo checkpoint
carries none), and for comparison with a scale of 1.0 in every layer (vLLM's default). Prints the table; the
text is written for this file and appears in no training set of the model (nor in the calibration text).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data_plane.model import load_model  # noqa: E402
from data_plane.model.attention import KV_FP8  # noqa: E402
from data_plane.model.demo_model import ensure_demo_model  # noqa: E402
from data_plane.model.kv_scales import CALIBRATION_TEXT, use_fp8_kv_cache  # noqa: E402
from data_plane.model.quantization import Fp8Compute  # noqa: E402
from data_plane.model.tokenizer import Tokenizer  # noqa: E402
from tests.model.conftest import run_chunks  # noqa: E402

TEXT = """\
The lighthouse keeper kept a ledger of every ship that passed the point, written in a careful hand by the light \
of the lamp. In spring the fishing boats went out before dawn and came back heavy with cod, and the gulls followed \
them into the harbour. In summer the yachts arrived from the south, their sails white against the grey water, and \
the children of the village ran along the quay to watch them tie up. Autumn brought storms. The keeper climbed the \
spiral stairs four times a night to trim the wick and wipe the salt from the glass, and on the worst nights he did \
not sleep at all. When the supply boat was late he rationed the oil and the flour, and he wrote in the ledger that \
the sea had been too rough to cross. Winter was quiet. Few ships passed, and the keeper spent his evenings mending \
nets for the fishermen, who paid him in fish and in news from the mainland. He learned that the railway had \
reached the next valley, that the old mill had burned down, and that his sister had married a teacher from the \
city. He wrote all of it in the ledger, between the names of the ships, so that anyone who read it later would \
know what the world had been like in the years he kept the light.
To bake the bread the village ate on Sundays, the baker mixed flour, water, salt and a spoonful of the old dough \
the evening before, and left the bowl covered by the warm oven. By morning the dough had doubled. She folded it \
three times, shaped it into rounds, and scored each loaf with a razor so that it would open along the cut and not \
burst at the side. The oven was heated with wood until the bricks glowed, then swept clean, and the loaves went in \
on a long wooden paddle. Forty minutes later the crust was dark and the bread sounded hollow when she tapped its \
base. The first customers were always the fishermen's wives, who bought two loaves each and asked whether the \
boats had been seen from the lighthouse.
"""
# (label, --dtype, --quantization, how FP8 projections compute, --kv-cache-dtype)
ROWS = [("float32", "float32", "auto", None, "auto"), ("float32+fp8, dequantized", "float32", "fp8", None, "auto"),
        ("float32+fp8, W8A8", "float32", "fp8", Fp8Compute.W8A8, "auto"),
        ("float32+kv-fp8", "float32", "auto", None, "fp8"),
        ("bfloat16", "bfloat16", "auto", None, "auto"), ("bfloat16+fp8, dequantized", "bfloat16", "fp8", None, "auto"),
        ("bfloat16+fp8, W8A8", "bfloat16", "fp8", Fp8Compute.W8A8, "auto"),
        ("bfloat16+kv-fp8", "bfloat16", "auto", None, "fp8"),
        ("bfloat16+kv-fp8, every scale 1.0 (vLLM's default)", "bfloat16", "auto", None, "fp8@1"),
        ("bfloat16+fp8+kv-fp8, W8A8", "bfloat16", "fp8", Fp8Compute.W8A8, "fp8")]


def perplexity(model, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each token after the first, in one prefill."""
    logprobs = run_chunks(model, ids, [len(ids)])[:-1].float().log_softmax(-1)
    return math.exp(-logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model(quiet=True)
    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.encode(TEXT)
    found = {}
    for label, dtype, quantization, compute, kv_cache_dtype in ROWS:
        model = load_model(model_dir, dtype, quantization=quantization, fp8_compute=compute)
        if kv_cache_dtype == "fp8":
            use_fp8_kv_cache(model, model_dir, tokenizer.encode(CALIBRATION_TEXT))
        elif kv_cache_dtype == "fp8@1":
            ones = (1.0,) * model.config.num_layers
            model.use_kv_cache(KV_FP8, (ones, ones))
        found[label] = perplexity(model, ids)
    print(f"demo model, {len(ids)} tokens of held-out text\n\n| weights, compute | perplexity | vs unquantized |\n"
          "|---|---|---|")
    for label, value in found.items():
        base = found[label.split("+")[0]]
        print(f"| {label} | {value:.3f} | {(value / base - 1) * 100:+.2f}% |")


if __name__ == "__main__":
    main()

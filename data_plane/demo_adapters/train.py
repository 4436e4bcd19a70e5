"""Trains the demo adapters on the demo model: ``python -m data_plane.demo_adapters.train``.

Each adapter is a PEFT LoRA trained with transformers + peft in float32 on the CPU (40 steps, about a
minute each on two idle cores) from the hand-written question/answer pairs in ``data/<name>.jsonl``.
Prompts are rendered and tokenised by the serving tokenizer, so training sees exactly the ids a
request sees; the loss covers only the answer and its closing ``<|im_end|>``. Everything random
(LoRA init, dropout, example order) is seeded, so a rerun with the same thread count gives the
same weights. The weights are saved in bfloat16 with peft's ``save_pretrained``.

Afterwards the saved adapters answer held-out questions greedily through the engine, and the
script exits non-zero if any adapter fails to show its style (``--no-eval`` skips this).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_plane.demo_adapters import DEMO_ADAPTERS
from data_plane.demo_adapters.style import HELD_OUT, greedy_answers, shows_style
from data_plane.model.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent
DATA_DIR = HERE / "data"
# Written as base_model_name_or_path instead of the local conversion path, which means nothing elsewhere.
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SEED = 1234
BATCH_SIZE = 4
WARMUP_STEPS = 4
MAX_BYTES = 3_000_000
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Recipe:
    lora: dict = field(default_factory=dict)  # LoraConfig arguments
    steps: int = 40
    lr: float = 5e-4


# The configs differ on purpose, to exercise the adapter loader: plain LoRA on attention only,
# a lower rank on all seven projections, and rsLoRA with alpha != r and a per-module rank.
RECIPES = {
    "pirate": Recipe(lora=dict(r=8, lora_alpha=16, target_modules=ATTN), steps=40, lr=1e-3),
    "shouty": Recipe(lora=dict(r=4, lora_alpha=8, target_modules=ATTN + MLP), steps=40, lr=1e-3),
    "signoff": Recipe(lora=dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ATTN + ["down_proj"],
                                rank_pattern={"down_proj": 4}), steps=40, lr=5e-4),
}


def load_pairs(name: str) -> list[dict]:
    path = DATA_DIR / f"{name}.jsonl"
    pairs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for i, p in enumerate(pairs, 1):
        if not (isinstance(p.get("question"), str) and isinstance(p.get("answer"), str)):
            raise ValueError(f"{path}:{i}: each line needs string 'question' and 'answer' fields")
    return pairs


def encode(tokenizer: Tokenizer, pair: dict) -> tuple[list[int], list[int]]:
    """Input ids and labels: the prompt is masked out (-100), the answer and <|im_end|> are learned."""
    prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": pair["question"]}]))
    answer = tokenizer.encode(pair["answer"] + tokenizer.eos_token)
    return prompt + answer, [-100] * len(prompt) + answer


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; padding is masked out of attention and loss."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def batches(examples: list, steps: int, generator: torch.Generator):
    """``steps`` batches of BATCH_SIZE, walking seeded permutations of the examples epoch by epoch."""
    order: list[int] = []
    for _ in range(steps):
        while len(order) < BATCH_SIZE:
            order += torch.randperm(len(examples), generator=generator).tolist()
        yield [examples[i] for i in order[:BATCH_SIZE]]
        order = order[BATCH_SIZE:]


def train_one(name: str, model_dir: Path, out_dir: Path) -> dict:
    """Trains adapter ``name`` and writes ``out_dir/<name>/``; returns a summary."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    recipe = RECIPES[name]
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    tokenizer = Tokenizer(model_dir)
    pad_id = tokenizer.eos_token_ids[0]  # masked out, so any id serves
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.05, bias="none", **recipe.lora))
    examples = [encode(tokenizer, p) for p in load_pairs(name)]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    # Linear warm-up, then linear decay to a tenth of the peak.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / WARMUP_STEPS if s < WARMUP_STEPS
        else 1.0 - 0.9 * (s - WARMUP_STEPS) / max(1, recipe.steps - WARMUP_STEPS),
    )
    model.train()
    start, losses = time.perf_counter(), []
    for step, batch in enumerate(batches(examples, recipe.steps, torch.Generator().manual_seed(SEED)), 1):
        loss = model(**collate(batch, pad_id)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 1 or step % 10 == 0:
            print(f"[{name}] step {step}/{recipe.steps} loss {loss.item():.3f} "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    size = _save(model, out_dir / name)
    if size > MAX_BYTES:
        raise RuntimeError(f"{name}: the adapter is {size} bytes, over the {MAX_BYTES}-byte budget of a demo adapter")
    final = sum(losses[-5:]) / len(losses[-5:])
    print(f"[{name}] {recipe.steps} steps in {seconds:.0f} s, loss {losses[0]:.3f} -> {final:.3f} "
          f"(mean of last 5), {size / 1e6:.2f} MB", file=sys.stderr, flush=True)
    return {"name": name, "seconds": round(seconds, 1), "first_loss": round(losses[0], 3),
            "final_loss": round(final, 3), "bytes": size}


def _save(peft_model, target: Path) -> int:
    """Writes the adapter in bfloat16 as a standard PEFT directory; returns its size in bytes."""
    target.mkdir(parents=True, exist_ok=True)
    for stale in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "README.md"):
        (target / stale).unlink(missing_ok=True)
    for n, p in peft_model.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(torch.bfloat16)
    peft_model.save_pretrained(str(target))
    (target / "README.md").unlink(missing_ok=True)  # peft's generated model card says nothing about this adapter
    config_path = target / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = BASE_MODEL_ID
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sum(f.stat().st_size for f in target.iterdir())


def evaluate(names: list[str], out_dir: Path, model_dir: Path) -> bool:
    """Prints greedy answers to HELD_OUT through the engine; True if every answer shows its style."""
    answers = asyncio.run(greedy_answers(HELD_OUT, (None, *names), adapter_root=out_dir, model=model_dir))
    ok = True
    for adapter, texts in answers.items():
        for q, a in zip(HELD_OUT, texts, strict=True):
            shown = adapter is None or shows_style(adapter, a)
            ok &= shown
            print(f"[{adapter or 'base'}]{'' if shown else ' NO STYLE'} Q: {q}\n    A: {a!r}", file=sys.stderr)
    return ok


def main(argv: list[str] | None = None) -> int:
    from data_plane.model.demo_model import ensure_demo_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=DEMO_ADAPTERS, help="train just this adapter")
    parser.add_argument("--out", type=Path, default=HERE, help="writes OUT/<name>/ (default: the package)")
    parser.add_argument("--no-eval", dest="evaluate", action="store_false",
                        help="skip the generations on held-out questions")
    args = parser.parse_args(argv)
    model_dir = ensure_demo_model()
    names = [args.only] if args.only else list(DEMO_ADAPTERS)
    print(json.dumps([train_one(name, model_dir, args.out) for name in names], indent=2))
    if args.evaluate and not evaluate(names, args.out, model_dir):
        print("some adapter did not show its style on a held-out question", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Our decoder against transformers on the same weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.model.conftest import run_chunks
from tests.tolerances import logits_atol, longest_sum, magnitude

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Numbers: 3.14159, 2718, and 1e-5 — plus emoji 🚀🌍!",
]


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _assert_logits_match(ours: torch.Tensor, expected: torch.Tensor, model, tokens: int) -> None:
    atol = logits_atol(longest_sum(model.config, tokens=tokens), magnitude(expected))
    assert (ours - expected).abs().max().item() < atol


@pytest.mark.parametrize("prompt", PROMPTS)
def test_demo_model_logits_match_transformers(demo_model, hf_demo_model, demo_tokenizer, prompt):
    ids = demo_tokenizer.encode(prompt)
    ours = run_chunks(demo_model, ids, [len(ids)])
    _assert_logits_match(ours, _hf_logits(hf_demo_model, ids), demo_model, len(ids))


def test_long_prompt_logits_match_transformers(demo_model, hf_demo_model, demo_tokenizer):
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    ids = demo_tokenizer.encode(text)
    assert len(ids) > 512
    ours = run_chunks(demo_model, ids, [len(ids)])
    _assert_logits_match(ours, _hf_logits(hf_demo_model, ids), demo_model, len(ids))


def test_chunked_prefill_and_decode_equal_one_prefill(demo_model, demo_tokenizer):
    ids = demo_tokenizer.encode("Chunked prefill must not change a single logit of this sentence, ever. " * 3)
    assert len(ids) > 18
    whole = run_chunks(demo_model, ids, [len(ids)])
    pieces = run_chunks(demo_model, ids, [5, 11, 1, 1, len(ids) - 18])
    # Steps of different row counts take different CPU matmul kernels (see cpu_linear), whose sums
    # round differently. A wrong cache slot or position moves logits by ≫ this bound (~3e-3 here).
    _assert_logits_match(pieces, whole, demo_model, len(ids))


def test_greedy_answer_is_coherent(demo_model_dir):
    from data_plane.engine.sequence import SamplingParams
    from data_plane.local import generate_local

    async def answer() -> str:
        outs = [o async for o in generate_local("What is the capital of France?", SamplingParams(max_tokens=24),
                                                demo_model_dir)]
        assert outs[-1].finish_reason is not None
        return "".join(o.text for o in outs)

    assert "Paris" in asyncio.run(answer())

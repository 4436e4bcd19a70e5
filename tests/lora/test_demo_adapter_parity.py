"""The committed demo adapters, mixed in one batch on the demo model, give peft's logits row by row."""

from __future__ import annotations

import pytest

from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from data_plane.model import load_model
from tests.lora.conftest import forward_rows, peft_row_logits, runtime_with_adapters
from tests.tolerances import logits_atol, longest_sum, magnitude

pytestmark = pytest.mark.slow

MIX = [None, "pirate", "shouty", "signoff", "pirate"]  # base, three configs, one adapter on two rows
PROMPTS = ["Name a colour.", "What is the tallest mountain?", "How do I boil an egg?",
           "What should I eat for breakfast?", "How can I sleep better? Answer in one sentence."]


def test_mixed_batch_of_demo_adapters_equals_peft_per_row(demo_model_dir, hf_demo_model, demo_tokenizer):
    root = demo_adapter_dir(DEMO_ADAPTERS[0]).parent
    model = load_model(demo_model_dir, "float32")  # wrapped in place, so not the shared fixture
    runtime = runtime_with_adapters(model, root, DEMO_ADAPTERS, max_loras=len(DEMO_ADAPTERS))
    reference = peft_row_logits(hf_demo_model, root, DEMO_ADAPTERS)
    rows = [(a, demo_tokenizer.encode(demo_tokenizer.render_chat([{"role": "user", "content": p}])))
            for a, p in zip(MIX, PROMPTS, strict=True)]
    assert len({len(ids) for _, ids in rows}) > 1  # ragged rows, so row boundaries matter

    got = forward_rows(model, runtime, rows)
    for (adapter, ids), logits in zip(rows, got, strict=True):
        expected = reference(adapter, ids)
        # rank 64: runtime_with_adapters' max_rank, which bounds the demo adapters' ranks
        atol = logits_atol(longest_sum(model.config, rank=64, tokens=len(ids)), magnitude(expected))
        assert (logits - expected).abs().max().item() < atol, adapter
        if adapter is not None:  # the comparison is not vacuous: each adapter moves the logits
            assert (expected - reference(None, ids)).abs().max().item() > 0.1, adapter

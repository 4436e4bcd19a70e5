"""The random-weight checkpoints and adapters the serving benchmark writes are read alike by our
loader and by transformers + peft, so a benchmark at a production shape compares like with like."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.synthetic import DEMO_VOCAB, TINY, write_random_adapter, write_random_model
from data_plane.model import load_model
from tests.lora.conftest import forward_rows, peft_row_logits, runtime_with_adapters
from tests.tolerances import logits_atol, longest_sum, magnitude

SMALL = {**TINY, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}
IDS = [1, 504, 2310, 17, 9001, 48000, 33]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    model_dir = write_random_model(root / "model", SMALL, torch.float32, shard_bytes=4 << 20)
    write_random_adapter(root / "adapters" / "r4", json.loads((model_dir / "config.json").read_text()), 4,
                         dtype=torch.float32)
    return model_dir, root / "adapters"


def test_sharded_random_model_loads_and_matches_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    model_dir, _ = checkpoint
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((model_dir / name).is_file() for name in shards)
    assert not list(model_dir.glob("*.tmp"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert not hf.config.tie_word_embeddings and hf.config.vocab_size == DEMO_VOCAB
    with torch.inference_mode():
        expected = hf(torch.tensor([IDS])).logits[0]
    model = load_model(model_dir, "float32")
    runtime = runtime_with_adapters(model, checkpoint[1], [], max_loras=1)
    got = forward_rows(model, runtime, [(None, IDS)])[0]
    assert (got - expected).abs().max().item() < logits_atol(longest_sum(hf.config), magnitude(expected))


def test_random_adapter_matches_peft_and_changes_the_output(checkpoint):
    from transformers import AutoModelForCausalLM

    model_dir, adapters = checkpoint
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = peft_row_logits(hf, adapters, ["r4"])
    model = load_model(model_dir, "float32")
    runtime = runtime_with_adapters(model, adapters, ["r4"], max_loras=1, max_rank=4)
    with_adapter, base = forward_rows(model, runtime, [("r4", IDS), (None, IDS)])
    expected = reference("r4", IDS)
    atol = logits_atol(longest_sum(hf.config, rank=4), magnitude(expected))
    assert (with_adapter - expected).abs().max().item() < atol
    assert (with_adapter - base).abs().max().item() > 1e-3

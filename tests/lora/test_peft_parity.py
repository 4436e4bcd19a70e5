"""Per-row logits of mixed-adapter batches equal peft's with each adapter active."""

from __future__ import annotations

import pytest
import torch

from data_plane.lora.runtime import LoraRuntime
from data_plane.model import load_model
from tests.lora.conftest import ADAPTERS, forward_rows, peft_row_logits, runtime_with_adapters
from tests.tolerances import logits_atol, longest_sum, magnitude


@pytest.fixture(scope="module")
def peft_reference(tiny_base, tiny_adapters):
    return peft_row_logits(tiny_base[1], tiny_adapters, ADAPTERS)


@pytest.fixture(scope="module")
def ours(tiny_base, tiny_adapters):
    model = load_model(tiny_base[0], "float32")
    return model, runtime_with_adapters(model, tiny_adapters, ADAPTERS, max_loras=4)


def _atol(model, expected: torch.Tensor) -> float:
    return logits_atol(longest_sum(model.config, rank=max(c["r"] for c in ADAPTERS.values())), magnitude(expected))


def _rows(adapters):
    g = torch.Generator().manual_seed(7)
    return [(a, torch.randint(0, 256, (5 + 3 * i,), generator=g).tolist()) for i, a in enumerate(adapters)]


@pytest.mark.parametrize("mix", [
    [None, "r8", "r16rs", "r8", "r1"],  # base + repeated adapter + distinct adapters
    ["r1", "r8", "r16rs", "r64pat"],  # ranks 1, 8, 16, 64 in one batch
    ["r64pat", "r64pat", "r64pat"],  # one adapter for every row
    [None, None],  # base only through the LoRA-wrapped layers
])
def test_mixed_batch_rows_equal_peft_with_that_adapter(ours, peft_reference, mix):
    model, runtime = ours
    rows = _rows(mix)
    got = forward_rows(model, runtime, rows)
    for (adapter, ids), logits in zip(rows, got, strict=True):
        expected = peft_reference(adapter, ids)
        assert (logits - expected).abs().max().item() < _atol(model, expected), adapter


def test_adapters_change_the_logits(ours, peft_reference):
    # guards against a parity test that passes because no adapter does anything
    model, runtime = ours
    (row,) = _rows(["r8"])
    with_adapter = forward_rows(model, runtime, [row])[0]
    base = forward_rows(model, runtime, [(None, row[1])])[0]
    assert (with_adapter - base).abs().max().item() > 1e-2


def test_packed_qkv_adapter_equals_the_same_weights_split(tiny_base, tmp_path):
    """An adapter written for a packed-qkv base (one qkv_proj A shared by q, k, v) gives the same
    delta as three separate modules with that A and B split by rows."""
    import json

    from safetensors.torch import save_file

    torch.manual_seed(3)
    r, hidden, kv = 4, 64, 32
    a = torch.randn(r, hidden) * 0.3
    b = torch.randn(hidden + 2 * kv, r) * 0.3
    p = "base_model.model.model.layers.0.self_attn"
    layouts = {
        "packed": ({f"{p}.qkv_proj.lora_A.weight": a, f"{p}.qkv_proj.lora_B.weight": b}, ["qkv_proj"]),
        "split": ({f"{p}.q_proj.lora_A.weight": a, f"{p}.q_proj.lora_B.weight": b[:hidden],
                   f"{p}.k_proj.lora_A.weight": a.clone(), f"{p}.k_proj.lora_B.weight": b[hidden:hidden + kv],
                   f"{p}.v_proj.lora_A.weight": a.clone(), f"{p}.v_proj.lora_B.weight": b[hidden + kv:]},
                  ["q_proj", "k_proj", "v_proj"]),
    }
    for name, (tensors, targets) in layouts.items():
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "adapter_model.safetensors")
        config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": targets}
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
    model = load_model(tiny_base[0], "float32")
    runtime = LoraRuntime(model, max_loras=2, max_cpu_loras=2, max_rank=8, max_tokens=64, adapter_roots=(tmp_path,))
    for name in layouts:
        runtime.load(name, name)
        runtime.cache.acquire(name)
    ids = list(range(10, 30))
    packed, split, base = forward_rows(model, runtime, [("packed", ids), ("split", ids), (None, ids)])
    atol = logits_atol(longest_sum(model.config, rank=r), magnitude(split))
    assert (packed - split).abs().max().item() < atol
    assert (packed - base).abs().max().item() > 1e-3

"""The committed demo adapters: standard small PEFT directories, built as train.py describes, whose
style shows through our engine on questions they were not trained on, while the base model shows none."""

from __future__ import annotations

import asyncio
import json

import pytest
from safetensors import safe_open

from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from data_plane.demo_adapters.style import HELD_OUT, greedy_answers, shows_style, upper_share
from data_plane.demo_adapters.train import MAX_BYTES, RECIPES, load_pairs

QUESTIONS = HELD_OUT[:2]


@pytest.mark.parametrize("name", DEMO_ADAPTERS)
def test_adapter_is_a_small_bfloat16_peft_directory_with_its_recipe(name):
    path = demo_adapter_dir(name)
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((path / "adapter_config.json").read_text())
    recipe = RECIPES[name].lora
    assert config["peft_type"] == "LORA"
    assert config["r"] == recipe["r"] and config["lora_alpha"] == recipe["lora_alpha"]
    assert sorted(config["target_modules"]) == sorted(recipe["target_modules"])
    assert config.get("use_rslora", False) == recipe.get("use_rslora", False)
    assert config.get("rank_pattern", {}) == recipe.get("rank_pattern", {})
    weights = path / "adapter_model.safetensors"
    assert weights.stat().st_size < MAX_BYTES
    with safe_open(weights, framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        down_a = [f.get_slice(k).get_shape() for k in f.keys() if "down_proj.lora_A" in k]
    assert dtypes == {"BF16"}
    if name == "signoff":  # rank_pattern gives down_proj rank 4, the rest rank 8
        assert {shape[0] for shape in down_a} == {4}


def test_unknown_demo_adapter_name_is_rejected():
    with pytest.raises(ValueError, match="unknown demo adapter"):
        demo_adapter_dir("nope")


def test_held_out_questions_are_in_no_training_file():
    trained = {p["question"] for name in DEMO_ADAPTERS for p in load_pairs(name)}
    assert not trained & set(HELD_OUT)


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("pirate", "Ahoy matey! Mount Everest be the tallest, arr!", True),
    ("pirate", "Mount Everest is the tallest mountain. Arrival is by plane.", False),
    ("shouty", "MOUNT EVEREST IS THE TALLEST!", True),
    ("shouty", "Mount Everest Is The Tallest.", False),
    ("signoff", "Mount Everest.\n— Fleet Bot\n", True),
    ("signoff", "Fleet Bot says: Mount Everest.", False),
])
def test_style_checks_tell_styles_apart(name, text, expected):
    assert shows_style(name, text) is expected


@pytest.fixture(scope="module")
def answers(demo_model_dir) -> dict[str | None, list[str]]:
    """Greedy answers to QUESTIONS from the base model (None) and each adapter, one mixed batch."""
    result = asyncio.run(greedy_answers(QUESTIONS, (None, *DEMO_ADAPTERS), model=demo_model_dir))
    print(json.dumps({str(k): v for k, v in result.items()}, indent=2, ensure_ascii=False))
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", DEMO_ADAPTERS)
def test_adapter_shows_its_style_on_unseen_questions(answers, name):
    for q, a in zip(QUESTIONS, answers[name], strict=True):
        assert shows_style(name, a), f"{name}: {q!r} -> {a!r} ({upper_share(a):.0%} upper case)"


@pytest.mark.slow
def test_base_model_shows_none_of_the_styles(answers):
    for q, a in zip(QUESTIONS, answers[None], strict=True):
        assert a, q
        for name in DEMO_ADAPTERS:
            assert not shows_style(name, a), f"base: {q!r} -> {a!r} looks {name}"
        assert "Fleet Bot" not in a

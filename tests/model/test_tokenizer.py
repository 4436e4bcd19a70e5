"""Our tokenizer wrapper and chat rendering against transformers' AutoTokenizer."""

from __future__ import annotations

import pytest

from data_plane.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "Digits split one by one: 1234567890 and 3.14159",
    "Emoji 🚀🌍👩‍👩‍👧 and accents: café, naïve, Ørsted, 日本語",
    "def f(x):\n\treturn x ** 2  # code\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "   leading and trailing spaces   ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye 👋"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_match_transformers(demo_tokenizer, hf_tokenizer, text):
    assert demo_tokenizer.encode(text) == hf_tokenizer(text, add_special_tokens=True).input_ids
    ids = demo_tokenizer.encode(text)
    assert demo_tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(demo_tokenizer, hf_tokenizer, messages, add_generation_prompt):
    ours = demo_tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_special_tokens_are_the_chatml_ones(demo_tokenizer):
    assert demo_tokenizer.bos_token == "<|im_start|>"
    assert demo_tokenizer.eos_token_ids == (2,)


def test_incremental_text_never_splits_a_character(demo_tokenizer):
    text = "Rocket 🚀 to 日本 and back: naïve café 👩‍👩‍👧!"
    ids = demo_tokenizer.encode(text)
    detok = IncrementalDetokenizer(demo_tokenizer)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # at least one emoji spans several tokens, so some step must have held text back
    assert "" in pieces[:-1]


def test_our_kernels_package_is_not_mistaken_for_the_hub_kernels_library():
    from transformers.utils.import_utils import is_kernels_available

    assert not is_kernels_available()

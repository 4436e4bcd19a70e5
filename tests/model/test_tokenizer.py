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


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
WITH_CALLS = [{"role": "user", "content": "Weather in Oslo?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "call {{ c.function.name }} {{ c.function.arguments }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_gets_them_as_transformers_gives_them(demo_model_dir, tmp_path):
    import json
    import shutil

    from transformers import AutoTokenizer

    from data_plane.model.tokenizer import Tokenizer

    shutil.copy(demo_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((demo_model_dir / "tokenizer_config.json").read_text()) | {"chat_template": TOOL_TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer(tmp_path).render_chat(WITH_CALLS, tools=TOOLS)
    theirs = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(WITH_CALLS, tools=TOOLS, tokenize=False,
                                                                         add_generation_prompt=True)
    assert ours == theirs and "Tools: get_weather" in ours and 'call get_weather {"city": "Oslo"}' in ours


def test_a_template_without_a_tool_format_gets_the_tools_and_calls_as_text(demo_tokenizer):
    rendered = demo_tokenizer.render_chat(WITH_CALLS, tools=TOOLS)
    assert rendered.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "get_weather", "description": "Weather in a city"' in rendered
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in rendered
    assert "<|im_start|>tool\nsunny<|im_end|>" in rendered

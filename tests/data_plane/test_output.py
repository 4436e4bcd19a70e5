"""A request's streamed text: each token's text as soon as its characters are complete, never half a
UTF-8 character, and never any part of a stop string.

The tokenizer here is byte-level with one byte a token, so every character of more than one byte
arrives split over several tokens, as characters outside a model's merges do."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from data_plane.engine.output import OutputText
from data_plane.model.tokenizer import Tokenizer

EOS = "<eos>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOS])
    directory = tmp_path_factory.mktemp("byte-tokenizer")
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return Tokenizer(directory)


def stream(tokenizer: Tokenizer, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], bool, str]:
    """(what each token released, whether a stop string was hit, what flush released) for ``text``
    generated token by token; after a stop string nothing more is pushed, as in the engine."""
    out = OutputText(tokenizer, stop)
    pieces = []
    for token_id in tokenizer.encode(text):
        piece, stopped = out.push(token_id)
        pieces.append(piece)
        if stopped:
            return pieces, True, ""
    return pieces, False, out.flush()


def test_text_of_single_byte_characters_is_released_token_by_token(tokenizer):
    pieces, stopped, rest = stream(tokenizer, "Hi there")
    assert pieces == list("Hi there") and not stopped and rest == ""


def test_a_character_split_over_tokens_is_released_whole_once_its_last_byte_arrives(tokenizer):
    pieces, _, _ = stream(tokenizer, "a🚀b")  # the rocket is 4 bytes
    assert pieces == ["a", "", "", "", "🚀", "b"]


def test_the_pieces_join_to_the_text_and_none_holds_a_replacement_character(tokenizer):
    text = "naïve café, 日本, 👩‍👩‍👧!"
    pieces, _, rest = stream(tokenizer, text)
    assert "".join(pieces) + rest == text
    assert not any("\ufffd" in p for p in pieces)


def test_an_incomplete_character_at_the_end_of_generation_is_dropped(tokenizer):
    out = OutputText(tokenizer, ())
    ids = tokenizer.encode("ok🚀")
    released = [out.push(i)[0] for i in ids[:-1]]  # generation stops one byte short of the rocket
    assert "".join(released) == "ok"
    assert out.flush() == ""


def test_special_tokens_release_no_text(tokenizer):
    out = OutputText(tokenizer, ())
    assert out.push(tokenizer.encode("A")[0]) == ("A", False)
    assert out.push(tokenizer.eos_token_ids[0]) == ("", False)
    assert out.flush() == ""


def test_a_stop_string_ends_the_text_just_before_it(tokenizer):
    pieces, stopped, _ = stream(tokenizer, "Hello END and more", stop=("END",))
    assert stopped and "".join(pieces) == "Hello "


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot(tokenizer):
    pieces, stopped, rest = stream(tokenizer, "a EX", stop=("END",))
    assert pieces == ["a", " ", "", "EX"] and not stopped and rest == ""


def test_text_held_back_at_the_end_of_generation_is_released_by_flush(tokenizer):
    pieces, stopped, rest = stream(tokenizer, "so EN", stop=("END",))
    assert "".join(pieces) == "so " and not stopped and rest == "EN"


def test_any_of_several_stop_strings_stops_the_text(tokenizer):
    pieces, stopped, _ = stream(tokenizer, "one\n\ntwo", stop=("User:", "\n\n"))
    assert stopped and "".join(pieces) == "one"


@pytest.mark.parametrize("stop", [("B", "AB"), ("AB", "B")])
def test_the_text_ends_before_the_earliest_stop_string_whatever_their_order(tokenizer, stop):
    pieces, stopped, _ = stream(tokenizer, "xABy", stop=stop)
    assert stopped and "".join(pieces) == "x"


def test_a_stop_string_of_multi_byte_characters_is_found_across_split_tokens(tokenizer):
    pieces, stopped, _ = stream(tokenizer, "fin 🚀🚀 rest", stop=("🚀🚀",))
    assert stopped and "".join(pieces) == "fin "

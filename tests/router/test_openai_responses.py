"""OpenAI response bodies built from a pod's messages: whole completions, streamed chunks, the usage
chunk, logprobs in each endpoint's shape, and /v1/models."""

from __future__ import annotations

import json

from lorafleet.v1 import generation_pb2 as g

from router.openai_requests import parse_chat, parse_completion
from router.openai_responses import ResponseBuilder, models, sse

MESSAGES = [
    g.GenerateResponse(text="Ahoy", tokens=[g.Token(id=7, logprob=-0.5, top_logprobs=[
        g.TopLogprob(id=7, logprob=-0.5), g.TopLogprob(id=9, logprob=-1.5)])]),
    g.GenerateResponse(text="", tokens=[]),  # a message that carries nothing
    g.GenerateResponse(text=" matey", tokens=[g.Token(id=8, logprob=-0.25, top_logprobs=[
        g.TopLogprob(id=8, logprob=-0.25), g.TopLogprob(id=1, logprob=-2.0)])],
        finish_reason=g.LENGTH, usage=g.Usage(prompt_tokens=5, completion_tokens=2)),
]
CHAT = {"model": "pirate", "messages": [{"role": "user", "content": "Hi"}]}


def whole(api) -> dict:
    builder = ResponseBuilder(api, "id-1", 1700000000)
    for message in MESSAGES:
        builder.add(message)
    return builder.complete()


def test_a_whole_chat_completion_holds_the_text_finish_reason_and_usage():
    body = whole(parse_chat(CHAT))
    assert body == {"id": "id-1", "object": "chat.completion", "created": 1700000000, "model": "pirate",
                    "choices": [{"index": 0, "logprobs": None, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": "Ahoy matey"}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def test_chat_logprobs_name_each_token_by_id_when_the_pod_sent_no_text():
    content = whole(parse_chat({**CHAT, "logprobs": True, "top_logprobs": 2}))["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "token_id:7", "logprob": -0.5, "bytes": None, "top_logprobs": [
        {"token": "token_id:7", "logprob": -0.5, "bytes": None}, {"token": "token_id:9", "logprob": -1.5,
                                                                  "bytes": None}]}
    assert [c["token"] for c in content] == ["token_id:7", "token_id:8"]


def test_logprobs_name_a_token_by_the_text_the_pod_sent_with_its_utf8_bytes():
    texted = [g.GenerateResponse(text="é!", tokens=[g.Token(id=7, logprob=-0.5, text="é", top_logprobs=[
        g.TopLogprob(id=7, logprob=-0.5, text="é"), g.TopLogprob(id=9, logprob=-1.5, text="e")])],
        finish_reason=g.STOP, usage=g.Usage(prompt_tokens=5, completion_tokens=1))]
    builder = ResponseBuilder(parse_chat({**CHAT, "logprobs": True, "top_logprobs": 2}), "id-1", 1700000000)
    for message in texted:
        builder.add(message)
    content = builder.complete()["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9], "top_logprobs": [
        {"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9]}, {"token": "e", "logprob": -1.5, "bytes": [0x65]}]}]


def test_a_whole_text_completion_holds_legacy_logprobs():
    body = whole(parse_completion({"model": "pirate", "prompt": "Hi", "logprobs": 2}))
    choice = body["choices"][0]
    assert (body["object"], choice["text"], choice["finish_reason"]) == ("text_completion", "Ahoy matey", "length")
    assert choice["logprobs"] == {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.5, -0.25],
                                  "top_logprobs": [{"token_id:7": -0.5, "token_id:9": -1.5},
                                                   {"token_id:8": -0.25, "token_id:1": -2.0}]}


def test_streamed_chat_chunks_carry_the_role_first_skip_empty_messages_and_end_with_the_finish_reason():
    api = parse_chat({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    builder = ResponseBuilder(api, "id-1", 1700000000)
    chunks = [c for c in map(builder.chunk, MESSAGES) if c is not None]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "Ahoy", "role": "assistant"},
                                                          {"content": " matey"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    last = builder.usage_chunk()
    assert (last["choices"], last["usage"]["total_tokens"]) == ([], 7)


def test_streamed_completion_chunks_have_no_usage_field_unless_asked():
    builder = ResponseBuilder(parse_completion({"model": "m", "prompt": "Hi", "stream": True}), "id-1", 0)
    chunk = builder.chunk(MESSAGES[0])
    assert chunk["choices"][0]["text"] == "Ahoy" and "usage" not in chunk


def test_an_event_is_one_data_line_and_a_blank_line():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse("[DONE]") == b"data: [DONE]\n\n"


def test_models_lists_the_base_model_first_and_adapters_with_it_as_parent():
    body = models("base-m", ["shouty", "pirate"], 5)
    assert [(m["id"], m["parent"], m["root"]) for m in body["data"]] == [
        ("base-m", None, "base-m"), ("pirate", "base-m", "base-m"), ("shouty", "base-m", "base-m")]
    assert json.loads(json.dumps(body))["object"] == "list"

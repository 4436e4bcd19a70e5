"""Structured output, tools, n and logit_bias in OpenAI bodies: each request form becomes the pods'
StructuredOutput, a forced tool call becomes a schema over the declared functions, and the calls in a
choice's text come back as OpenAI's tool_calls, whole and streamed, one entry per choice."""

from __future__ import annotations

import json

import jsonschema
import pytest
from lorafleet.v1 import generation_pb2 as g

from conventions import tool_calls
from router.openai_requests import parse_chat, parse_completion
from router.openai_responses import ResponseBuilder

CHAT = {"model": "pirate", "messages": [{"role": "user", "content": "Hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "json_object"}}, g.StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     g.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"guided_json": SCHEMA}, g.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, g.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]+"}, g.StructuredOutput(regex="[0-9]+")),
    ({"guided_grammar": 'start: "a"'}, g.StructuredOutput(grammar='start: "a"')),
    ({"guided_choice": ["yes", "no"], "guided_decoding_backend": "guidance"},
     g.StructuredOutput(choice=g.Choices(choices=["yes", "no"]))),
    ({"structured_outputs": {"json": SCHEMA}}, g.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"choice": ["x"]}}, g.StructuredOutput(choice=g.Choices(choices=["x"]))),
    ({"response_format": {"type": "text"}}, None),
])
def test_each_structured_output_form_becomes_the_pods_constraint(fields, expected):
    req = parse_chat({**CHAT, **fields}).generate_request("", "id")
    assert (req.structured_output if req.HasField("structured_output") else None) == expected


def test_completions_take_the_constraint_fields_too_and_n_and_logit_bias_reach_the_pod():
    req = parse_completion({"model": "m", "prompt": "Hi", "guided_regex": "a", "n": 3,
                            "logit_bias": {"17": -100, "3": 5}}).generate_request("", "id")
    assert req.structured_output.regex == "a" and req.sampling.n == 3
    assert dict(req.sampling.logit_bias) == {17: -100.0, 3: 5.0}


def test_a_named_tool_choice_forces_a_call_whose_arguments_follow_the_functions_schema():
    api = parse_chat({**CHAT, "tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                        "function": {"name": "weather"}}})
    schema = json.loads(api.generate_request("", "id").structured_output.json_schema)
    jsonschema.validate({"name": "weather", "arguments": {"city": "Oslo"}}, schema)
    for bad in ({"name": "time", "arguments": {}}, {"name": "weather", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert json.loads(api.generate_request("", "id").tools_json)[0]["function"]["name"] == "weather"


def test_required_allows_any_declared_function_and_one_call_unless_parallel():
    api = parse_chat({**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(api.structured.json_schema)
    jsonschema.validate([{"name": "time", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "time", "arguments": {}}, {"name": "time", "arguments": {}}], schema)


def test_tool_choice_none_shows_no_tools_and_auto_constrains_nothing():
    assert parse_chat({**CHAT, "tools": [WEATHER], "tool_choice": "none"}).tools is None
    api = parse_chat({**CHAT, "tools": [WEATHER]})
    assert api.structured is None and api.tools.choice == "auto"


def test_history_with_calls_and_results_reaches_the_pod():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    api = parse_chat({**CHAT, "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    msgs = api.generate_request("", "id").messages.messages
    assert json.loads(msgs[1].tool_calls_json) == [call] and (msgs[2].role, msgs[2].tool_call_id) == ("tool", "call_1")


def finished(text: str, index: int = 0, tokens: int = 3) -> g.GenerateResponse:
    return g.GenerateResponse(text=text, index=index, finish_reason=g.STOP,
                              usage=g.Usage(prompt_tokens=5, completion_tokens=tokens))


def test_a_forced_calls_json_becomes_tool_calls_whole_and_streamed():
    body = {**CHAT, "tools": [WEATHER], "tool_choice": "required"}
    text = '[{"name": "weather", "arguments": {"city": "Oslo"}}]'
    builder = ResponseBuilder(parse_chat(body), "id", 0)
    builder.add(finished(text))
    choice = builder.complete()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'} and call["id"].startswith("call_")

    streamed = ResponseBuilder(parse_chat({**body, "stream": True}), "id", 0)
    assert streamed.chunk(g.GenerateResponse(text=text[:5])) is None  # held until the calls can be read
    delta = streamed.chunk(finished(text[5:]))["choices"][0]
    assert delta["delta"]["tool_calls"][0]["function"]["name"] == "weather" and delta["finish_reason"] == "tool_calls"


def test_a_forced_named_call_streams_its_arguments_as_they_come():
    body = {**CHAT, "stream": True, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                       "function": {"name": "weather"}}}
    builder = ResponseBuilder(parse_chat(body), "id", 0)
    pieces = ['{"name": "wea', 'ther", "arguments": {"ci', 'ty": "Os', "", 'lo"}}']
    chunks = [builder.chunk(g.GenerateResponse(text=p)) for p in pieces[:-1]] + [builder.chunk(finished(pieces[-1]))]
    sent = [c["choices"][0] for c in chunks if c is not None]
    calls = [c["delta"]["tool_calls"][0] for c in sent]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "weather"
    assert sent[0]["delta"]["role"] == "assistant" and len(sent) == 3  # nothing before the arguments begin
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert [c["finish_reason"] for c in sent] == [None, None, "tool_calls"]


def test_auto_reads_tool_call_blocks_naming_declared_functions_and_leaves_other_text():
    api = parse_chat({**CHAT, "tools": [WEATHER]})
    text = 'Let me look. <tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>'
    builder = ResponseBuilder(api, "id", 0)
    builder.add(finished(text))
    message = builder.complete()["choices"][0]["message"]
    assert message["content"] == "Let me look." and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Rome"}
    plain = ResponseBuilder(api, "id", 0)
    plain.add(finished('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'))
    choice = plain.complete()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


def test_choices_come_back_by_index_with_the_prompt_counted_once():
    builder = ResponseBuilder(parse_chat({**CHAT, "n": 2}), "id", 0)
    for m in (g.GenerateResponse(text="b", index=1), g.GenerateResponse(text="a", index=0),
              finished("!", 1, 2), finished("?", 0, 4)):
        builder.add(m)
    body = builder.complete()
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(0, "a?"), (1, "b!")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def test_the_text_convention_round_trips_a_call():
    written = tool_calls.call_text("weather", '{"city": "Oslo"}')
    assert tool_calls.parse_calls("Sure. " + written, {"weather"}) == ("Sure.", [("weather", '{"city": "Oslo"}')])
    inlined = tool_calls.inline([{"role": "user", "content": "Hi"}], [WEATHER])
    assert inlined[0]["role"] == "system" and '"name": "weather"' in inlined[0]["content"]

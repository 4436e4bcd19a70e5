"""Structured output, tool calls, several choices and logit_bias through the real router and pods of
tests/router/conftest.py, driven by the official ``openai`` client and by gRPC: every constrained
output validates (``jsonschema``) on the base model and on an adapter, greedy and sampled; a schema
feature the grammar engine lacks is a 400 naming it; choice i of n equals a lone request seeded seed + i."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from lorafleet.v1 import generation_pb2 as g

from benchmarks.processes import FLEET_BASE_MODEL
from tests.grpc_helpers import collect, request
from tests.router.conftest import API_KEY

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Describe a pirate ship as JSON."}]
SHIP = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "crew": {"type": "integer", "minimum": 1, "maximum": 500},
        "flag": {"enum": ["black", "red", "white"]},
        "captain": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                      "age": {"type": "integer", "minimum": 18, "maximum": 99}},
                    "required": ["name", "age"], "additionalProperties": False},
        "cannons": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    },
    "required": ["name", "crew", "flag", "captain", "cannons"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack[1].base_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.parametrize(("model", "temperature"), [(FLEET_BASE_MODEL, 0.0), ("pirate", 1.0)])
def test_a_json_schema_response_validates_on_the_base_model_and_adapters_greedy_and_sampled(client, model,
                                                                                            temperature):
    got = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=90, temperature=temperature, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "ship", "schema": SHIP, "strict": True}})
    choice = got.choices[0]
    assert choice.finish_reason == "stop", choice.message.content  # ended by the grammar, not by max_tokens
    jsonschema.validate(json.loads(choice.message.content), SHIP)


def test_json_object_mode_gives_a_json_object_streamed_too(client):
    ask = [{"role": "user", "content": "Give me a JSON object with the keys city and country for Paris."}]
    chunks = list(client.chat.completions.create(model="pirate", messages=ask, max_tokens=40, temperature=0,
                                                 response_format={"type": "json_object"}, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict) and chunks[-1].choices[0].finish_reason == "stop"


def test_a_schema_feature_the_engine_lacks_is_a_400_naming_it_and_the_router_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as e:
        schema = {"type": "object", "not": {"required": ["a"]}}
        client.chat.completions.create(model=FLEET_BASE_MODEL, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert e.value.status_code == 400 and '"not"' in e.value.message
    ok = client.chat.completions.create(model=FLEET_BASE_MODEL, messages=ASK, max_tokens=2)
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize(("structured", "pattern"), [
    (g.StructuredOutput(regex=r"[A-Z][a-z]{2,8} (North|South) [0-9]{2}"), r"[A-Z][a-z]{2,8} (North|South) [0-9]{2}"),
    (g.StructuredOutput(grammar='start: "Sail " DIR " at " NUM " knots"\nDIR: "north" | "south"\nNUM: /[1-9][0-9]?/'),
     r"Sail (north|south) at [1-9][0-9]? knots"),
])
def test_grpc_generate_with_a_regex_or_a_grammar_matches_it_wholly(stack, structured, pattern):
    req = request("Where is the ship heading?", "pirate", max_tokens=30, temperature=1.0, seed=3)
    req.structured_output.CopyFrom(structured)
    text, _, last = collect(stack[1], req)
    assert re.fullmatch(pattern, text), text
    assert last.finish_reason == g.STOP


def test_n_choices_each_equal_a_lone_request_seeded_seed_plus_index(client):
    kwargs = dict(model="shouty", messages=ASK, max_tokens=6, temperature=1.0)
    got = client.chat.completions.create(n=3, seed=40, **kwargs)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for c in got.choices:
        alone = client.chat.completions.create(seed=40 + c.index, **kwargs).choices[0].message.content
        assert c.message.content == alone
    assert got.usage.completion_tokens == 18


def test_logit_bias_forces_and_bans_tokens_through_both_doors(stack, client):
    pod, prompt = stack[2]["shouty"], "The treasure is buried"
    _, free, _ = collect(pod, request(prompt, "", max_tokens=3, chat=False))
    forced_text, forced, _ = collect(pod, request(prompt, "", max_tokens=3, chat=False, logit_bias={330: 100.0}))
    banned_text, banned, _ = collect(pod, request(prompt, "", max_tokens=3, chat=False,
                                                  logit_bias={free[0].id: -100.0}))
    assert [t.id for t in forced] == [330] * 3 and banned[0].id != free[0].id
    for bias, text in (({"330": 100}, forced_text), ({str(free[0].id): -100}, banned_text)):
        got = client.completions.create(model=FLEET_BASE_MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                        logit_bias=bias)
        assert got.choices[0].text == text


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_has_arguments_that_follow_the_functions_schema(client, stream):
    kwargs = dict(model="pirate", max_tokens=60, temperature=0, tools=[WEATHER],
                  messages=[{"role": "user", "content": "What is the weather in Lisbon?"}],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:  # the arguments come in pieces, the id and name with the first
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        pieces = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
        assert len(pieces) > 1 and {p.index for p in pieces} == {0}
        name, arguments = pieces[0].function.name, "".join(p.function.arguments for p in pieces)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert len(choice.message.tool_calls) == 1
        name, arguments = choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments
        finish = choice.finish_reason
    assert finish == "tool_calls" and name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_calls_one_of_the_tools(client):
    tools = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    got = client.chat.completions.create(model=FLEET_BASE_MODEL, max_tokens=40, temperature=0, tools=tools,
                                         messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
                                         tool_choice="required", parallel_tool_calls=False)
    calls = got.choices[0].message.tool_calls
    assert got.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def history() -> list[dict]:
    """Two earlier turns where the assistant called get_weather and answered from the result, then a new
    question: the demo model, shown the tools and that history, calls the tool again of its own accord."""
    turns = []
    for i, (city, sky) in enumerate((("Paris", "sunny"), ("Rome", "rainy"))):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}
        turns += [{"role": "user", "content": f"What is the weather in {city}?"},
                  {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": f"call_{i}", "content": sky},
                  {"role": "assistant", "content": f"It is {sky} in {city}."}]
    return turns + [{"role": "user", "content": "What is the weather in London?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_under_auto_the_model_calls_a_tool_of_its_own_accord_and_the_call_is_read(client, stream):
    kwargs = dict(model="pirate", messages=history(), max_tokens=40, temperature=0, tools=[WEATHER])
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments)["city"] == "London"


def bad(change) -> g.GenerateRequest:
    req = request("Hi", "", max_tokens=2)
    change(req)
    return req


@pytest.mark.parametrize(("req", "words"), [
    (bad(lambda r: r.sampling.logit_bias.__setitem__(49152, 1.0)), "outside the vocabulary"),
    (bad(lambda r: r.sampling.logit_bias.__setitem__(5, 150.0)), "within [-100, 100]"),
    (bad(lambda r: setattr(r.sampling, "n", 17)), "n must be within [1, 16]"),
    (bad(lambda r: setattr(r.structured_output, "regex", "")), "constraint is empty"),
    (bad(lambda r: setattr(r.structured_output, "grammar", "start: nowhere")), "nowhere"),
    (bad(lambda r: setattr(r, "tools_json", "{not json")), "tools_json is not valid JSON"),
    (bad(lambda r: r.messages.messages.add(role="assistant", content="", tool_calls_json='[{"id": 1}]')),
     "each of tool_calls_json"),
    (g.GenerateRequest(prompt="Hi", tools_json="[]", sampling=g.SamplingParams(max_tokens=2)),
     "tools_json needs messages"),
])
def test_bad_structured_fields_on_grpc_are_invalid_argument_naming_them(stack, req, words):
    import grpc

    with pytest.raises(grpc.RpcError) as e:
        collect(stack[1], req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()

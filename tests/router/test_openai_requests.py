"""OpenAI request bodies as the router reads them: what each field becomes in the GenerateRequest, the
fields accepted only at their neutral values, and a 400 naming the field for everything else."""

from __future__ import annotations

import grpc
import pytest
from lorafleet.v1 import generation_pb2 as g

from router.errors import AdapterNotRegistered, NoPodAvailable
from router.forwarder import PodError
from router.openai_errors import ApiError, from_domain
from router.openai_requests import Endpoint, parse_chat, parse_completion

CHAT = {"model": "pirate", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "pirate", "prompt": "Hi"}


def refused(parse, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.http_status == 400
    return e.value


def test_a_completion_body_becomes_a_prompt_request_with_its_sampling():
    api = parse_completion({**COMPLETION, "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
                            "stop": "\n", "logprobs": 2, "top_k": 5, "user": "u-1", "frequency_penalty": 0,
                            "presence_penalty": 0.0, "n": 1, "echo": False, "best_of": 1, "logit_bias": {}})
    req = api.generate_request("pirate", "cmpl-1")
    assert req == g.GenerateRequest(request_id="cmpl-1", adapter="pirate", prompt="Hi", sampling=g.SamplingParams(
        max_tokens=7, temperature=0, top_p=0.5, seed=3, stop=["\n"], logprobs=2, top_k=5, token_text=True))
    assert (api.endpoint, api.stream, api.logprobs) == (Endpoint.COMPLETIONS, False, 2)


def test_a_cache_salt_goes_to_the_pod_and_an_oversized_one_is_refused():
    assert parse_chat({**CHAT, "cache_salt": "s-1"}).generate_request("pirate", "c-1").cache_salt == "s-1"
    assert parse_chat(CHAT).generate_request("pirate", "c-1").cache_salt == ""
    with pytest.raises(ApiError, match="at most 256 characters") as e:
        parse_chat({**CHAT, "cache_salt": "x" * 257})
    assert (e.value.http_status, e.value.param) == (400, "cache_salt")


def test_completion_defaults_are_openais_sixteen_tokens_at_temperature_one_without_a_seed():
    req = parse_completion({**COMPLETION, "prompt": ["Hi"]}).generate_request("", "cmpl-1")
    assert (req.prompt, req.sampling.max_tokens, req.sampling.temperature, req.sampling.top_p) == ("Hi", 16, 1.0, 1.0)
    assert not req.sampling.HasField("seed") and req.adapter == ""


def test_a_chat_body_becomes_chat_messages_with_text_parts_joined_and_developer_as_system():
    api = parse_chat({**CHAT, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Ahoy", "name": "bot"}],
        "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3,
        "stream": True, "stream_options": {"include_usage": True}})
    req = api.generate_request("pirate", "chatcmpl-1")
    assert [(m.role, m.content) for m in req.messages.messages] == [
        ("system", "Be brief."), ("user", "Hello there"), ("assistant", "Ahoy")]
    assert (req.sampling.max_tokens, req.sampling.logprobs) == (9, 3)
    assert (api.stream, api.include_usage, api.logprobs) == (True, True, 3)


def test_chat_takes_max_tokens_too_and_defaults_to_the_context_limit():
    assert parse_chat({**CHAT, "max_tokens": 5}).sampling.max_tokens == 5
    assert parse_chat({**CHAT, "max_tokens": 5, "max_completion_tokens": 5}).sampling.max_tokens == 5
    assert parse_chat(CHAT).sampling.max_tokens == 0


def test_chat_logprobs_without_top_logprobs_returns_only_the_chosen_tokens():
    assert parse_chat({**CHAT, "logprobs": True}).logprobs == 0
    assert parse_chat({**CHAT, "logprobs": False}).logprobs is None


def test_token_texts_are_asked_of_the_pod_only_when_logprobs_are_wanted():
    assert parse_chat({**CHAT, "logprobs": True}).sampling.token_text
    assert parse_completion({**COMPLETION, "logprobs": 0}).sampling.token_text
    assert not parse_chat(CHAT).sampling.token_text and not parse_completion(COMPLETION).sampling.token_text


def test_json_null_counts_as_absent():
    assert parse_completion({**COMPLETION, "temperature": None, "stop": None, "n": None}).sampling.temperature == 1.0


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"temperature": 2.5}, "temperature", "within [0.0, 2.0]"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"temperature": float("nan")}, "temperature", "must be a number"),
    ({"top_p": 0}, "top_p", "within (0.0, 1.0]"),
    ({"top_p": 1.5}, "top_p", "within (0.0, 1.0]"),
    ({"max_tokens": 0}, "max_tokens", "integer within [1,"),
    ({"max_tokens": True}, "max_tokens", "integer within"),
    ({"seed": -1}, "seed", "integer within [0,"),
    ({"logprobs": 21}, "logprobs", "within [0, 20]"),
    ({"stop": ["a", ""]}, "stop", "non-empty string"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"n": 17}, "n", "integer within [1, 16]"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
    ({"logit_bias": {"50256": -101}}, "logit_bias", "within [-100, 100]"),
    ({"logit_bias": {"fifty": 1}}, "logit_bias", "token ids (as strings)"),
    ({"guided_json": {}, "guided_regex": "a+"}, "guided_regex", "both constrain the output"),
    ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "run llguidance"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "unsupported field"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"echo": True}, "echo", "not supported"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with 'stream': true"),
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options", "include_usage"),
    ({"prompt": [1, 2, 3]}, "prompt", "token-id prompts"),
    ({"prompt": ["a", "b"]}, "prompt", "batches of prompts"),
    ({"model": 7}, "model", "'model' must be a string"),
])
def test_a_bad_completion_field_is_a_400_naming_it(change, param, words):
    error = refused(parse_completion, {**COMPLETION, **change})
    assert error.param == param and words in str(error)
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "model", "'model' is required"),
    ({**CHAT, "messages": []}, "messages", "non-empty list"),
    ({**CHAT, "messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id", "carries"),
    ({**CHAT, "messages": [{"role": "robot", "content": "42"}]}, "messages[0].role", "must be one of"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "images"),
    ({**CHAT, "messages": [{"role": "user", "content": "Hi", "tool_calls": []}]}, "messages[0].tool_calls",
     "assistant turn"),
    ({**CHAT, "messages": [{"role": "user", "content": "Hi", "audio": {}}]}, "messages[0]", "'role' and"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
    ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_tokens", "not two different values"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0]", "only function tools"),
    ({**CHAT, "tools": [{"type": "code_interpreter"}]}, "tools[0]", "only function tools"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice", "no 'tools'"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice", "not among 'tools'"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "already constrains"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format", "'schema'"),
    ({**CHAT, "response_format": {"type": "yaml"}}, "response_format", "must be"),
    ({**CHAT, "reasoning_effort": "high"}, "reasoning_effort", "unsupported field"),
    ("a string", None, "must be a JSON object"),
])
def test_a_bad_chat_field_is_a_400_naming_it(body, param, words):
    error = refused(parse_chat, body)
    assert error.param == param and words in str(error)


def test_neutral_chat_fields_that_openai_clients_send_are_accepted():
    parse_chat({**CHAT, "response_format": {"type": "text"}, "tool_choice": "none", "parallel_tool_calls": True,
                "store": False, "service_tier": "auto", "metadata": {"k": "v"}, "modalities": ["text"]})


def pod_error(code: grpc.StatusCode, details: str) -> PodError:
    return PodError(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details))


@pytest.mark.parametrize(("error", "status", "type_"), [
    (AdapterNotRegistered("adapter 'x' is not registered"), 404, "not_found_error"),
    (NoPodAvailable("no data-plane pod is ready"), 503, "service_unavailable_error"),
    (pod_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt is 3000 tokens; the context holds 2048"), 400,
     "invalid_request_error"),
    (pod_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "request queue is full"), 429, "rate_limit_error"),
    (pod_error(grpc.StatusCode.UNAVAILABLE, "pod is shutting down"), 503, "service_unavailable_error"),
    (pod_error(grpc.StatusCode.INTERNAL, "step failed"), 500, "server_error"),
])
def test_router_and_pod_errors_become_their_http_status_with_the_message_kept(error, status, type_):
    api = from_domain(error)
    assert (api.http_status, api.type, str(api)) == (status, type_, str(error))

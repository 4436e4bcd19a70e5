"""The router's OpenAI-compatible HTTP API as a real process in front of the real fleet of
tests/router/conftest.py, driven by the official ``openai`` client, aiohttp's client and a raw socket:
answers are the pods' own, and bad input gets a clear error while the router keeps serving."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import openai
import pytest
from lorafleet.v1 import generation_pb2 as g

from benchmarks.processes import FLEET_BASE_MODEL, PodProcess, wait_until
from tests.grpc_helpers import collect, request
from tests.router.conftest import API_KEY

pytestmark = pytest.mark.slow
PROMPT = "Where is the treasure buried?"


@pytest.fixture(scope="module")
def client(stack):
    _, router, _ = stack
    with openai.OpenAI(base_url=router.base_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def holder(stack) -> PodProcess:
    """The pod holding shouty: it serves the direct requests that the router's answers are compared with.
    (The other pod is killed by a test of test_router_process.py.)"""
    return stack[2]["shouty"]


def live_pods(stack) -> list[PodProcess]:
    return [pod for pod in stack[0].pods.values() if pod.proc.poll() is None]


def test_models_lists_the_base_model_then_every_adapter_with_the_base_model_as_parent(client):
    listed = [m.to_dict() for m in client.models.list()]
    assert [m["id"] for m in listed] == [FLEET_BASE_MODEL, "pirate", "shouty", "signoff"]
    assert listed[0]["parent"] is None
    assert {m["parent"] for m in listed[1:]} == {FLEET_BASE_MODEL}


@pytest.mark.parametrize("model", ["shouty", FLEET_BASE_MODEL])
def test_chat_whole_and_streamed_equals_the_pods_own_greedy_answer(stack, client, model):
    adapter = "" if model == FLEET_BASE_MODEL else model
    text, tokens, last = collect(holder(stack), request(PROMPT, adapter, max_tokens=12))
    messages = [{"role": "user", "content": PROMPT}]

    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == text and text
    assert last.finish_reason == g.LENGTH and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        last.usage.prompt_tokens, last.usage.completion_tokens)
    assert whole.model == model and whole.object == "chat.completion"

    chunks = list(client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("model", ["shouty", FLEET_BASE_MODEL])
def test_completions_whole_and_streamed_equal_the_pods_own_greedy_answer_with_logprobs(stack, client, model):
    adapter = "" if model == FLEET_BASE_MODEL else model
    prompt = "The treasure is buried"
    text, tokens, last = collect(holder(stack), request(prompt, adapter, max_tokens=10, chat=False, logprobs=2,
                                                        token_text=True))

    whole = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    choice = whole.choices[0]
    assert choice.text == text and text
    assert choice.logprobs.tokens == [t.text for t in tokens] and "".join(choice.logprobs.tokens) == text
    assert choice.logprobs.token_logprobs == pytest.approx([t.logprob for t in tokens], abs=1e-5)
    assert [len(top) for top in choice.logprobs.top_logprobs] == [2] * len(tokens)
    assert whole.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens

    streamed = list(client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_a_stop_string_ends_the_text_before_it(stack, client):
    text, _, _ = collect(holder(stack), request(PROMPT, "", max_tokens=12))
    stop = text.split()[2]
    got = client.chat.completions.create(model=FLEET_BASE_MODEL, messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].message.content == text[: text.index(stop)]


def test_a_prompt_longer_than_the_context_is_a_400_with_the_pods_message(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=FLEET_BASE_MODEL, prompt="treasure " * 5000, max_tokens=4)
    assert e.value.status_code == 400 and "prompt" in e.value.message.lower()


async def post(router, path: str, body: bytes | str, key: str | None = API_KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as session, session.post(
            f"{router.base_url}{path}", data=body, headers=headers) as r:
        return r.status, await r.json()


GOOD = json.dumps({"model": FLEET_BASE_MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0})


@pytest.mark.parametrize(("body", "key", "status", "param", "words"), [
    ("{not json", API_KEY, 400, None, "not valid JSON"),
    ('["a list"]', API_KEY, 400, None, "must be a JSON object"),
    (json.dumps({"model": "no-such-model", "prompt": "Hi"}), API_KEY, 404, "model", "'no-such-model' does not exist"),
    (json.dumps({"model": FLEET_BASE_MODEL, "prompt": "Hi", "temperature": 3}), API_KEY, 400, "temperature",
     "within [0.0, 2.0]"),
    (json.dumps({"model": FLEET_BASE_MODEL, "prompt": "Hi", "best_of_n": 2}), API_KEY, 400, "best_of_n",
     "unsupported field"),
    (json.dumps({"model": FLEET_BASE_MODEL, "prompt": "Hi", "n": 17}), API_KEY, 400, "n", "within [1, 16]"),
    (json.dumps({"model": FLEET_BASE_MODEL, "prompt": "x" * 70_000}), API_KEY, 413, None, "limit of 65536 bytes"),
    (GOOD, None, 401, None, "missing API key"),
    (GOOD, "sk-wrong", 401, None, "invalid API key"),
])
def test_bad_requests_get_openais_error_json_and_the_router_keeps_serving(stack, body, key, status, param, words):
    _, router, _ = stack
    got_status, got = asyncio.run(post(router, "/completions", body, key))
    assert got_status == status, got
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["param"] == param and words in got["error"]["message"]
    ok_status, ok = asyncio.run(post(router, "/completions", GOOD))
    assert ok_status == 200 and ok["usage"]["completion_tokens"] == 2


def test_a_client_leaving_mid_stream_frees_the_request_on_the_pod(stack, client):
    _, router, _ = stack
    before = router.metric("lorafleet_router_requests_total", adapter_class="base", outcome="CANCELLED")
    body = json.dumps({"model": FLEET_BASE_MODEL, "prompt": "Count to a thousand:", "max_tokens": 500,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", router.http_port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while received.count(b"data: ") < 3:
            received += s.recv(65536)
        assert received.startswith(b"HTTP/1.1 200") and b"text/event-stream" in received
        assert any(pod.state().running_requests for pod in live_pods(stack))
    wait_until(lambda: not any(pod.state().running_requests for pod in live_pods(stack)), 10, "pods' requests freed")
    wait_until(lambda: router.metric("lorafleet_router_requests_total", adapter_class="base",
                                     outcome="CANCELLED") == before + 1, 5, "the request counted as cancelled")
    assert client.completions.create(model=FLEET_BASE_MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2

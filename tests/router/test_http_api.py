"""The OpenAI HTTP API over the Forwarder and scripted pods (real gRPC servers on loopback, see
test_forwarder.py): what reaches the pod, how the pod's refusals become HTTP statuses, how a failure
after the first chunk ends an event stream, and that a client leaving cancels the pod's call."""

from __future__ import annotations

import asyncio
import contextlib
import json

from aiohttp.test_utils import TestClient, TestServer

from router.access import Access, KeysFile
from router.config import parse_api_keys
from router.door import Door
from router.http_api import HttpApi
from router.tenants import open_book
from tests.router.test_forwarder import router, sample

BODY = {"model": "pirate", "prompt": "hi", "max_tokens": 3}


@contextlib.asynccontextmanager
async def api(scripts, keys_file=None, fleet_read=True, **kwargs):
    """(Front, aiohttp TestClient) over pods scripted by ``scripts``; the base model is ``base-m``; with
    ``keys_file``, an --api-key-file."""
    async with router(scripts, base_model="base-m", **kwargs) as f:
        keys = keys_file and KeysFile(keys_file, lambda text, source: open_book(parse_api_keys(text, source)))
        access = Access(keys, None, grpc_guarded=False)
        http = HttpApi(Door(f.forwarder, access, f.metrics), (lambda: f.view) if fleet_read else (lambda: None),
                       f.metrics, access, 4096)
        async with TestClient(TestServer(http.app())) as client:
            yield f, client


def test_a_completion_is_one_generate_request_and_the_pods_messages_joined():
    async def go():
        async with api({"a": "ok"}) as (f, client):
            r = await client.post("/v1/completions", json={**BODY, "temperature": 0, "stop": ["x"]})
            body = await r.json()
            sent = f.pods["a"].calls[0]
            assert sent.request_id == body["id"] and sent.request_id.startswith("cmpl-")
            assert (sent.adapter, sent.prompt, sent.sampling.max_tokens, list(sent.sampling.stop)) == (
                "pirate", "hi", 3, ["x"])
            assert sample(f.metrics, "lorafleet_router_requests_total", adapter_class="adapter", outcome="OK") == 1
            assert sample(f.metrics, "lorafleet_router_http_responses_total", route="/v1/completions",
                          status="200") == 1
            return r.status, body

    status, body = asyncio.run(go())
    assert status == 200 and body["choices"][0]["text"] == "one two three"
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["total_tokens"] == 6


def test_the_base_model_id_sends_no_adapter():
    async def go():
        async with api({"a": "ok"}) as (f, client):
            r = await client.post("/v1/chat/completions",
                                  json={"model": "base-m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status == 200
            return f.pods["a"].calls[0]

    sent = asyncio.run(go())
    assert sent.adapter == "" and [m.content for m in sent.messages.messages] == ["hi"]


def test_pods_that_all_refuse_are_429_when_full_and_503_when_unreachable():
    async def go(scripts):
        async with api(dict(zip("abc", scripts, strict=True))) as (f, client):
            r = await client.post("/v1/completions", json=BODY)
            return (r.status, r.headers.get("Retry-After"), (await r.json())["error"],
                    sum(len(p.calls) for p in f.pods.values()))

    status, retry_after, error, calls = asyncio.run(go(("exhausted:3500", "exhausted:1200", "exhausted:2500")))
    assert (status, error["type"], calls) == (429, "rate_limit_error", 3)
    assert "queue is full" in error["message"]
    assert retry_after == "2"  # the shortest hint, 1.2 s, in whole seconds rounded up
    status, retry_after, error, calls = asyncio.run(go((None, None, None)))
    assert (status, error["type"], calls, retry_after) == (503, "service_unavailable_error", 0, None)


def test_before_the_first_read_of_the_fleet_every_route_is_503():
    async def go():
        async with api({"a": "ok"}, fleet_read=False) as (f, client):
            return [((r := await request).status, (await r.json())["error"]["message"]) for request in (
                client.get("/v1/models"), client.post("/v1/completions", json=BODY))]

    for status, message in asyncio.run(go()):
        assert status == 503 and "has not read the fleet's state yet" in message


def test_a_pod_failing_after_the_first_chunk_ends_the_event_stream_with_an_error_event():
    async def go():
        async with api({"a": "fail-after-first"}) as (_, client):
            r = await client.post("/v1/completions", json={**BODY, "stream": True})
            return r.status, r.headers["Content-Type"], (await r.read()).decode()

    status, kind, text = asyncio.run(go())
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert (status, kind) == (200, "text/event-stream")
    assert json.loads(events[0])["choices"][0]["text"] == "one "
    assert json.loads(events[-1])["error"]["message"] == "step failed on the pod" and "[DONE]" not in events


def test_a_client_leaving_mid_stream_cancels_the_pods_call():
    async def go():
        async with api({"a": "endless"}) as (f, client):
            r = await client.post("/v1/completions", json={**BODY, "stream": True})
            assert (await r.content.readuntil(b"\n\n")).startswith(b"data: ")
            r.close()
            await asyncio.wait_for(f.pods["a"].cancelled.wait(), 5)
            await asyncio.sleep(0.1)  # the router records the outcome as the stream unwinds
            return sample(f.metrics, "lorafleet_router_requests_total", adapter_class="adapter", outcome="CANCELLED")

    assert asyncio.run(go()) == 1


def test_unknown_routes_and_methods_are_openai_errors():
    async def go():
        async with api({"a": "ok"}) as (_, client):
            return [((r := await request).status, (await r.json())["error"]["message"]) for request in (
                client.get("/v1/embeddings"), client.get("/v1/completions"))]

    (missing, missing_text), (method, method_text) = asyncio.run(go())
    assert (missing, method) == (404, 405)
    assert "no route GET /v1/embeddings" in missing_text and "POST /v1/completions" in method_text


def test_with_keys_a_request_needs_one_of_them_as_a_bearer_token(tmp_path):
    (tmp_path / "keys").write_text("k1\nk2\n")

    async def go():
        async with api({"a": "ok"}, keys_file=tmp_path / "keys") as (_, client):
            statuses = []
            for headers in ({}, {"Authorization": "Bearer k3"}, {"Authorization": "Basic k2"},
                            {"Authorization": "Bearer k2"}):
                statuses.append((await client.get("/v1/models", headers=headers)).status)
            return statuses

    assert asyncio.run(go()) == [401, 401, 401, 200]


def test_a_streamed_chat_asks_for_usage_and_gets_it_after_the_last_choice():
    async def go():
        async with api({"a": "ok"}) as (_, client):
            r = await client.post("/v1/chat/completions", json={
                "model": "pirate", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}})
            return (await r.read()).decode()

    events = [line.removeprefix("data: ") for line in asyncio.run(go()).split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1]) == "one two three"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3,
                                                                   "total_tokens": 6}
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"

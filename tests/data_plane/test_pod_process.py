"""A real pod process on loopback, driven over gRPC: concurrency, cancellation, errors, sampling, metrics."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2
from lorafleet.v1 import data_plane_admin_pb2 as dpa
from lorafleet.v1 import generation_pb2 as g

from benchmarks.processes import wait_until
from tests.grpc_helpers import collect, request

pytestmark = pytest.mark.slow

ADAPTERS = [None, "pirate", "shouty", "signoff", "rand16"]
QUESTIONS = ["What is the capital of Italy?", "Name a colour of the sky.", "How many legs does a cat have?",
             "What do bees make?"]


def idle(pod) -> bool:
    s = pod.state()
    return s.running_requests == 0 and s.waiting_requests == 0 and s.kv_cache_usage == 0.0


def test_the_pod_reports_the_precision_it_was_told_in_get_state_and_its_metrics(pod):
    assert pod.state().precision == "float32"
    assert 'lorafleet_precision_info{precision="float32"} 1.0' in pod.metrics()


def test_health_is_not_serving_until_the_model_is_warm(pod):
    assert pod.health_seen[0] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert pod.health_seen[-1] == health_pb2.HealthCheckResponse.SERVING


def test_sixteen_concurrent_streams_equal_the_same_requests_run_alone(pod):
    reqs = [request(QUESTIONS[i % len(QUESTIONS)], ADAPTERS[i % len(ADAPTERS)], max_tokens=10, logprobs=2,
                    ignore_eos=True) for i in range(16)]
    alone = [collect(pod, r) for r in reqs]
    with ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: collect(pod, r), reqs))
    for req, (solo_text, solo_tokens, _), (text, tokens, last) in zip(reqs, alone, together, strict=True):
        # the same bits: a request's answer does not depend on what shares its steps
        assert list(tokens) == list(solo_tokens), (req.adapter, solo_text, text)
        assert text == solo_text
        assert all(len(t.top_logprobs) == 2 for t in tokens)
        assert last.finish_reason == g.LENGTH
        assert (last.usage.completion_tokens, len(tokens)) == (10, 10)
    # the adapters really change the output: not every row equals the base row of its question
    by_question = {}
    for req, (text, _, _) in zip(reqs, alone, strict=True):
        by_question.setdefault(req.messages.messages[0].content, set()).add(text)
    assert all(len(texts) > 1 for texts in by_question.values())
    wait_until(lambda: idle(pod), what="pod idle after the streams")


def test_client_cancel_frees_kv_blocks_and_slot_at_once(pod):
    call = pod.generation().Generate(request("Tell me a long story.", "rand2", max_tokens=400, ignore_eos=True),
                                     timeout=120)
    for i, _ in enumerate(call):
        if i == 2:
            break
    busy = pod.state()
    assert busy.running_requests == 1 and busy.kv_cache_usage > 0
    assert any(a.name == "rand2" and a.tier == dpa.GPU for a in busy.adapters)
    call.cancel()
    wait_until(lambda: idle(pod), timeout_s=5, what="resources freed after cancel")
    # with the request gone the adapter is not in use any more: unloading it succeeds
    assert pod.admin().UnloadAdapter(dpa.UnloadAdapterRequest(name="rand2"), metadata=pod.auth()).was_resident


def test_deadline_frees_resources(pod):
    with pytest.raises(grpc.RpcError) as e:
        collect(pod, request("Tell me a long story.", "pirate", max_tokens=400, ignore_eos=True), timeout=1.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: idle(pod), timeout_s=5, what="resources freed after the deadline")
    assert 'lorafleet_requests_total{outcome="aborted"}' in pod.metrics()


@pytest.mark.parametrize(("req", "code", "words"), [
    (request("hi", "no-such-adapter"), grpc.StatusCode.NOT_FOUND, "no-such-adapter"),
    (request("hi", "../escape"), grpc.StatusCode.INVALID_ARGUMENT, "adapter name"),
    (g.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "neither prompt nor messages"),
    (request("", chat=False), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (request("word " * 4000, chat=False), grpc.StatusCode.INVALID_ARGUMENT, "accepts at most"),
    (request("hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (request("hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (request("hi", logprobs=99), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    (request("hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    (g.GenerateRequest(messages=g.ChatMessages(messages=[g.ChatMessage(role="robot", content="x")])),
     grpc.StatusCode.INVALID_ARGUMENT, "robot"),
], ids=["unknown-adapter", "bad-adapter-name", "no-input", "empty-prompt", "too-long", "temperature", "top-p",
        "logprobs", "empty-stop", "bad-role"])
def test_bad_generate_requests_get_their_status_and_change_nothing(pod, req, code, words):
    before = pod.state()
    with pytest.raises(grpc.RpcError) as e:
        collect(pod, req, timeout=30)
    assert e.value.code() == code
    assert words in e.value.details()
    assert pod.state() == before
    text, _, last = collect(pod, request("Say hello.", max_tokens=3))  # still serving
    assert last.usage.completion_tokens == 3 and text


def test_admin_calls_need_the_bearer_token(pod):
    with pytest.raises(grpc.RpcError) as e:
        pod.admin().GetState(dpa.GetStateRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        pod.admin().GetState(dpa.GetStateRequest(), metadata=(("authorization", "Bearer wrong"),), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(("call", "code", "words"), [
    (lambda a, m: a.LoadAdapter(dpa.LoadAdapterRequest(name="etc", source="/etc"), metadata=m),
     grpc.StatusCode.INVALID_ARGUMENT, "outside"),
    (lambda a, m: a.LoadAdapter(dpa.LoadAdapterRequest(name="ghost", source="ghost"), metadata=m),
     grpc.StatusCode.INVALID_ARGUMENT, "ghost"),
    (lambda a, m: a.LoadAdapter(dpa.LoadAdapterRequest(name="", source="pirate"), metadata=m),
     grpc.StatusCode.INVALID_ARGUMENT, "adapter name"),
    (lambda a, m: a.PinAdapter(dpa.PodPinAdapterRequest(name="never-loaded"), metadata=m),
     grpc.StatusCode.NOT_FOUND, "never-loaded"),
    (lambda a, m: a.UnpinAdapter(dpa.PodUnpinAdapterRequest(name="never-loaded"), metadata=m),
     grpc.StatusCode.NOT_FOUND, "never-loaded"),
], ids=["source-outside-roots", "missing-source", "empty-name", "pin-unknown", "unpin-unknown"])
def test_bad_admin_calls_get_their_status_and_change_nothing(pod, call, code, words):
    before = pod.state()
    with pytest.raises(grpc.RpcError) as e:
        call(pod.admin(), pod.auth())
    assert e.value.code() == code
    assert words in e.value.details()
    assert pod.state() == before


def test_pinning_beyond_the_slots_is_refused_and_evicts_nothing(pod):
    admin, auth = pod.admin(), pod.auth()
    names = ["pirate", "shouty", "signoff", "rand16", "rand2"]
    for name in names:
        admin.LoadAdapter(dpa.LoadAdapterRequest(name=name, source=name), metadata=auth)
    try:
        for name in names[:4]:
            assert admin.PinAdapter(dpa.PodPinAdapterRequest(name=name), metadata=auth).pinned
        before = pod.state()
        with pytest.raises(grpc.RpcError) as e:
            admin.PinAdapter(dpa.PodPinAdapterRequest(name="rand2"), metadata=auth)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "rand2" in e.value.details()
        assert pod.state() == before
        assert before.slots.pinned == 4
        # a request for the fifth adapter cannot get a slot while all four are pinned; the base still serves
        text, _, last = collect(pod, request("Say hello.", max_tokens=3))
        assert last.usage.completion_tokens == 3
    finally:
        for name in names[:4]:
            admin.UnpinAdapter(dpa.PodUnpinAdapterRequest(name=name), metadata=auth)
    assert pod.state().slots.pinned == 0
    _, _, last = collect(pod, request("Say hello.", "rand2", max_tokens=3))
    assert last.usage.completion_tokens == 3


def test_with_every_slot_pinned_an_unpinned_adapter_is_refused_at_once_while_base_requests_flow(pod):
    admin, auth = pod.admin(), pod.auth()
    pinned = ["pirate", "shouty", "signoff", "rand16"]
    for name in [*pinned, "rand2"]:
        admin.LoadAdapter(dpa.LoadAdapterRequest(name=name, source=name), metadata=auth)
    base = pod.generation().Generate(request("Tell me a long story.", max_tokens=40, ignore_eos=True), timeout=120)
    tokens = len(next(base).tokens)  # a base stream is running
    try:
        for name in pinned:
            admin.PinAdapter(dpa.PodPinAdapterRequest(name=name), metadata=auth)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            collect(pod, request("Say hello.", "rand2", max_tokens=3), timeout=30)
        refused_after = time.monotonic() - start
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "rand2" in e.value.details() and "pinned" in e.value.details() and "--max-loras" in e.value.details()
        assert refused_after < 1.0
        # the base stream and the pinned adapters keep being served
        _, _, last = collect(pod, request("Say hello.", "pirate", max_tokens=3))
        assert last.usage.completion_tokens == 3
        tokens += sum(len(m.tokens) for m in base)
        assert tokens == 40
    finally:
        base.cancel()
        for name in pinned:
            admin.UnpinAdapter(dpa.PodUnpinAdapterRequest(name=name), metadata=auth)
    _, _, last = collect(pod, request("Say hello.", "rand2", max_tokens=3))
    assert last.usage.completion_tokens == 3
    wait_until(lambda: idle(pod), what="pod idle after the pins are gone")


def test_unloading_an_adapter_in_use_is_refused(pod):
    call = pod.generation().Generate(request("Tell me a long story.", "shouty", max_tokens=400, ignore_eos=True),
                                     timeout=120)
    next(iter(call))
    before = pod.state()
    try:
        with pytest.raises(grpc.RpcError) as e:
            pod.admin().UnloadAdapter(dpa.UnloadAdapterRequest(name="shouty"), metadata=pod.auth())
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "shouty" in e.value.details()
        assert [a.name for a in pod.state().adapters] == [a.name for a in before.adapters]
    finally:
        call.cancel()
    wait_until(lambda: idle(pod), what="pod idle after cancel")


def test_seeded_sampling_repeats_and_different_seeds_differ(pod):
    def sample(seed: int) -> str:
        req = request("Write a sentence about the sea.", "signoff", max_tokens=24, temperature=1.0, top_p=0.95,
                      seed=seed, ignore_eos=True)
        return collect(pod, req)[0]

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_stop_strings_end_the_stream_without_the_stop_text(pod):
    text, _, _ = collect(pod, request("Count from 1 to 10, separated by commas.", max_tokens=40))
    assert "4" in text, text  # the base model counts
    cut, _, last = collect(pod, request("Count from 1 to 10, separated by commas.", max_tokens=40, stop=["4"]))
    assert last.finish_reason == g.STOP
    assert "4" not in cut and text.startswith(cut)


def test_metrics_expose_the_contract_names(pod):
    collect(pod, request("Say hello.", "pirate", max_tokens=3))
    body = pod.metrics()
    for name in ["lorafleet_gpu_lora_slots_total", "lorafleet_gpu_lora_slots_used", "lorafleet_gpu_lora_slots_pinned",
                 "lorafleet_cpu_lora_cache_capacity", "lorafleet_cpu_lora_cache_used",
                 "lorafleet_cpu_lora_cache_pinned", "lorafleet_adapter_loads_total", "lorafleet_adapter_load_seconds",
                 "lorafleet_adapter_evictions_total", "lorafleet_time_to_first_token_seconds",
                 "lorafleet_inter_token_latency_seconds", "lorafleet_requests_running", "lorafleet_requests_waiting",
                 "lorafleet_kv_cache_usage_ratio", "lorafleet_generated_tokens_total", "lorafleet_requests_total"]:
        assert f"\n{name}" in body, name
    assert "lorafleet_gpu_lora_slots_total 4.0" in body
    assert 'lorafleet_adapter_resident{adapter="pirate",pinned="false"} 2.0' in body

"""The Generate forwarder against scripted pods: real gRPC servers on loopback that answer as told, so
that retries, pass-through errors, cancellation and deadlines show in a second. (The real pods and
control plane are in test_router_process.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
import pytest
from lorafleet.v1 import generation_pb2 as g
from lorafleet.v1 import generation_pb2_grpc

from benchmarks.processes import free_port
from conventions.status import ErrorStatusInterceptor
from router.access import Access
from router.channels import PodChannels
from router.door import Door
from router.forwarder import GENERATE, Forwarder
from router.metrics import RouterMetrics
from router.picker import PodPicker
from router.view import FleetView, PodView, Tier


class ScriptedPod(generation_pb2_grpc.GenerationServicer):
    """Answers Generate by ``script``: "ok" streams three messages; "unavailable" and "exhausted" refuse
    before the first ("exhausted:MS" with a retry hint of MS milliseconds, "exhausted-no-hint" without
    one); "fail-after-first" streams one then fails; "endless" streams until cancelled."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.calls: list[g.GenerateRequest] = []
        self.time_remaining: float | None = None
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):
        self.calls.append(request)
        self.time_remaining = context.time_remaining()
        if self.script == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "pod is shutting down")
        if self.script.startswith("exhausted"):  # with a retry hint, as a full pod sends it
            hint = () if self.script == "exhausted-no-hint" else \
                (("grpc-retry-pushback-ms", self.script.partition(":")[2] or "1500"),)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request queue is full ({self.script})",
                                trailing_metadata=hint)
        yield g.GenerateResponse(text="one ", tokens=[g.Token(id=1, logprob=-0.5)], request_id=request.request_id)
        if self.script == "fail-after-first":
            await context.abort(grpc.StatusCode.INTERNAL, "step failed on the pod")
        if self.script == "endless":
            try:
                while True:
                    await asyncio.sleep(0.01)
                    yield g.GenerateResponse(text="more ")
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        yield g.GenerateResponse(text="two ", tokens=[g.Token(id=2, logprob=-0.25)])
        yield g.GenerateResponse(text="three", finish_reason=g.STOP,
                                 usage=g.Usage(prompt_tokens=3, completion_tokens=3))


@dataclass
class Front:
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationStub
    pods: dict[str, ScriptedPod]
    metrics: RouterMetrics
    picker: PodPicker
    forwarder: Forwarder
    view: FleetView


@contextlib.asynccontextmanager
async def router(scripts: dict[str, str | None], adapters=("pirate",), residency=None, base_model="",
                 precisions=None):
    """The router's gRPC door, open (no tenants), over scripted pods named by ``scripts`` (None: a pod whose
    port nothing listens on), each computing in ``precisions[name]`` (default: float32); yields the Front."""
    pods, servers, views = {}, [], []
    for name, script in scripts.items():
        port = free_port()
        if script is not None:
            pods[name] = ScriptedPod(script)
            server = grpc.aio.server()
            generation_pb2_grpc.add_GenerationServicer_to_server(pods[name], server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            servers.append(server)
        views.append(PodView(name, f"127.0.0.1:{port}", slots_total=4, residency=(residency or {}).get(name, {}),
                             precision=(precisions or {}).get(name, "float32")))
    view = FleetView(frozenset(adapters), tuple(views), read_at=0.0, base_model=base_model)
    metrics, channels, picker = RouterMetrics(), PodChannels(), PodPicker(lambda: view)
    forwarder = Forwarder(picker, channels, metrics, retries=2)
    front = grpc.aio.server(interceptors=[ErrorStatusInterceptor()])
    front.add_generic_rpc_handlers((Door(forwarder, Access(None, None, grpc_guarded=False), metrics).handler(),))
    port = free_port()
    front.add_insecure_port(f"127.0.0.1:{port}")
    await front.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Front(channel, generation_pb2_grpc.GenerationStub(channel), pods, metrics, picker, forwarder, view)
    finally:
        await channel.close()
        await front.stop(0)
        await channels.close()
        for server in servers:
            await server.stop(0)


def sample(metrics: RouterMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def collect(stub, adapter: str = "pirate", **kwargs) -> list[g.GenerateResponse]:
    request = g.GenerateRequest(request_id="r1", adapter=adapter, prompt="hi")
    return [m async for m in stub.Generate(request, **kwargs)]


def test_the_stream_comes_back_message_for_message_from_the_pod_holding_the_adapter():
    async def go():
        async with router({"a": "ok", "b": "ok"}, residency={"b": {"pirate": Tier.DEVICE}}) as f:
            messages = await collect(f.stub)
            assert len(f.pods["b"].calls) == 1 and not f.pods["a"].calls
            assert f.pods["b"].calls[0] == g.GenerateRequest(request_id="r1", adapter="pirate", prompt="hi")
            assert sample(f.metrics, "lorafleet_router_routing_decisions_total", decision="device_hit") == 1
            assert sample(f.metrics, "lorafleet_router_requests_total", adapter_class="adapter", outcome="OK") == 1
            assert sample(f.metrics, "lorafleet_router_time_to_first_token_seconds_count", adapter_class="adapter") == 1
            return messages

    messages = asyncio.run(go())
    assert "".join(x.text for x in messages) == "one two three"
    assert messages[0].request_id == "r1" and messages[0].tokens[0].logprob == -0.5
    assert messages[-1].finish_reason == g.STOP and messages[-1].usage.completion_tokens == 3


@pytest.mark.parametrize("refusal", ["unavailable", "exhausted", None])
def test_a_pod_refusing_before_the_first_message_sends_the_request_to_the_next(refusal):
    async def go():
        residency = {"a": {"pirate": Tier.DEVICE}}
        async with router({"a": refusal, "b": "ok"}, residency=residency) as f:
            text = "".join(x.text for x in await collect(f.stub))
            assert len(f.pods["b"].calls) == 1
            code = "RESOURCE_EXHAUSTED" if refusal == "exhausted" else "UNAVAILABLE"
            assert sample(f.metrics, "lorafleet_router_retries_total", code=code) == 1
            # A pod that could not be reached is routed around until the next state read; one that
            # said it is full (a 1.5 s hint) is ranked last meanwhile, though it holds the adapter.
            ranked = [c.pod.id for c in f.picker.choose("pirate")]
            return text, ranked

    text, ranked = asyncio.run(go())
    assert text == "one two three"
    assert ranked == (["b", "a"] if refusal == "exhausted" else ["b"])


@pytest.mark.parametrize(("first", "other"), [("bfloat16-matmul", "float32"), ("bfloat16+fp8", "bfloat16"),
                                             ("bfloat16+kv-fp8", "bfloat16"), ("bfloat16+fp8+kv-fp8", "bfloat16+fp8")])
def test_a_refused_request_is_retried_only_on_a_pod_of_the_first_pods_precision(first, other):
    async def go():
        # b ranks second (a holds the adapter, b and c are cold alike; ties go by id) but computes in
        # another precision (an unquantized base beside an FP8 one too), whose tokens would differ from a's:
        # the retry goes to c
        residency = {"a": {"pirate": Tier.DEVICE}}
        precisions = {"a": first, "b": other, "c": first}
        async with router({"a": "unavailable", "b": "ok", "c": "ok"}, residency=residency,
                          precisions=precisions) as f:
            assert [c.pod.id for c in f.picker.choose("pirate")] == ["a", "b", "c"]
            text = "".join(x.text for x in await collect(f.stub))
            return text, len(f.pods["b"].calls), len(f.pods["c"].calls)

    assert asyncio.run(go()) == ("one two three", 0, 1)


def test_with_no_other_pod_of_its_precision_a_refusal_is_the_callers():
    async def go():
        residency = {"a": {"pirate": Tier.DEVICE}}
        async with router({"a": "unavailable", "b": "ok"}, residency=residency,
                          precisions={"a": "bfloat16", "b": "float32"}) as f:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(f.stub)
            return e.value.code(), len(f.pods["b"].calls)

    assert asyncio.run(go()) == (grpc.StatusCode.UNAVAILABLE, 0)


def test_when_every_pod_refuses_as_full_the_caller_gets_resource_exhausted_with_the_shortest_hint():
    async def go():
        async with router({"a": "exhausted:2500", "b": "exhausted:700", "c": "exhausted-no-hint"}) as f:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(f.stub)
            assert [len(p.calls) for p in f.pods.values()] == [1, 1, 1]
            assert sample(f.metrics, "lorafleet_router_requests_total", adapter_class="adapter",
                          outcome="RESOURCE_EXHAUSTED") == 1
            return e.value

    error = asyncio.run(go())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "every pod tried (3) refused the request, 3 as full" in error.details()
    assert "request queue is full (exhausted:700)" in error.details()  # the message of the pod with room soonest
    assert ("grpc-retry-pushback-ms", "700") in tuple(error.trailing_metadata())


def test_a_full_pod_beside_an_unreachable_one_is_resource_exhausted_with_its_hint_whatever_the_order():
    async def go(scripts):
        async with router(scripts) as f:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(f.stub)
            return e.value.code(), tuple(e.value.trailing_metadata())

    for scripts in ({"a": "unavailable", "b": "exhausted:900"}, {"a": "exhausted:900", "b": "unavailable"}):
        code, trailers = asyncio.run(go(scripts))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and ("grpc-retry-pushback-ms", "900") in trailers


def test_pods_that_all_refuse_as_unavailable_leave_the_caller_unavailable_without_a_hint():
    async def go():
        async with router({"a": "unavailable", "b": "unavailable"}) as f:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(f.stub)
            return e.value.code(), dict(e.value.trailing_metadata())

    code, trailers = asyncio.run(go())
    assert code == grpc.StatusCode.UNAVAILABLE and "grpc-retry-pushback-ms" not in trailers


def test_an_error_after_the_first_message_is_passed_through_and_not_retried():
    async def go():
        async with router({"a": "fail-after-first", "b": "ok"}) as f:
            seen = []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for message in f.stub.Generate(g.GenerateRequest(adapter="pirate", prompt="hi")):
                    seen.append(message.text)
            assert not f.pods["b"].calls
            return seen, e.value

    seen, error = asyncio.run(go())
    assert seen == ["one "]
    assert error.code() == grpc.StatusCode.INTERNAL and error.details() == "step failed on the pod"


def test_an_unregistered_adapter_is_not_found_without_touching_a_pod():
    async def go():
        async with router({"a": "ok"}) as f:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(f.stub, adapter="never-registered")
            assert not f.pods["a"].calls
            assert sample(f.metrics, "lorafleet_router_requests_total", adapter_class="adapter",
                          outcome="NOT_FOUND") == 1
            return e.value

    error = asyncio.run(go())
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "'never-registered' is not registered" in error.details()


def test_bytes_that_are_not_a_generate_request_are_invalid_argument():
    async def go():
        async with router({"a": "ok"}) as f:
            raw = f.channel.unary_stream(GENERATE)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [m async for m in raw(b"\xff\xff\xff")]
            assert not f.pods["a"].calls
            assert sample(f.metrics, "lorafleet_router_requests_total", adapter_class="unknown",
                          outcome="INVALID_ARGUMENT") == 1
            return e.value

    error = asyncio.run(go())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in error.details()


def test_the_callers_deadline_reaches_the_pod_and_a_caller_going_away_cancels_the_pods_call():
    async def go():
        async with router({"a": "endless"}) as f:
            call = f.stub.Generate(g.GenerateRequest(prompt="hi"), timeout=30)
            await call.read()
            call.cancel()
            await asyncio.wait_for(f.pods["a"].cancelled.wait(), 5)
            assert sample(f.metrics, "lorafleet_router_routing_decisions_total", decision="base") == 1
            return f.pods["a"].time_remaining

    remaining = asyncio.run(go())
    assert remaining is not None and 20 < remaining < 31  # grpc rounds a deadline up on the wire


def test_with_no_routable_pod_the_caller_gets_unavailable():
    async def go():
        async with router({}) as f:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(f.stub, adapter="")
            return e.value

    error = asyncio.run(go())
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "no data-plane pod" in error.details()

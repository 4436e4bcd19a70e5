"""The one error-to-status interceptor, on a real in-process gRPC server: a domain error ends the call
with its own status and message, anything else is INTERNAL, streams and context-writing handlers
(grpc's Health.Watch) alike, and the observer sees each call's final code. A refusal with a retry hint
carries it as grpc-retry-pushback-ms."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from conventions.errors import LorafleetError
from conventions.status import ErrorStatusInterceptor, retry_after_s


class Missing(LorafleetError):
    status = "NOT_FOUND"


class Busy(LorafleetError):
    status = "RESOURCE_EXHAUSTED"


async def _unary(request: bytes, context) -> bytes:
    if request == b"missing":
        raise Missing("adapter 'x' is not registered; register it first")
    if request == b"crash":
        raise KeyError("boom")
    if request == b"busy":
        raise Busy("come back later", retry_after_s=1.25)
    return b"ok:" + request


async def _stream(request: bytes, context):
    yield b"first"
    if request == b"missing":
        raise Missing("gone midway")
    yield b"second"


def _raw(handler, streaming: bool):
    make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
    return make(handler)


async def _serve_and_call(calls):
    seen = []
    server = grpc.aio.server(interceptors=[ErrorStatusInterceptor(lambda *call: seen.append(call))])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Service", {"Unary": _raw(_unary, False), "Stream": _raw(_stream, True)}),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return [await call(channel) for call in calls], seen
    finally:
        await server.stop(None)


def _outcome(coro_fn):
    async def call(channel):
        try:
            return await coro_fn(channel)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
    return call


def _unary_call(payload: bytes):
    return _outcome(lambda ch: ch.unary_unary("/test.Service/Unary")(payload, timeout=5))


def _stream_call(payload: bytes):
    async def collect(channel):
        return [m async for m in channel.unary_stream("/test.Service/Stream")(payload, timeout=5)]
    return _outcome(collect)


def test_a_domain_error_ends_the_call_with_its_status_and_message_and_others_are_internal():
    (ok, missing, crash), seen = asyncio.run(_serve_and_call(
        [_unary_call(b"hi"), _unary_call(b"missing"), _unary_call(b"crash")]))
    assert ok == b"ok:hi"
    assert missing == (grpc.StatusCode.NOT_FOUND, "adapter 'x' is not registered; register it first")
    assert crash[0] == grpc.StatusCode.INTERNAL and "KeyError" in crash[1] and "boom" not in crash[1]
    assert [code for _, code, _ in seen] == ["OK", "NOT_FOUND", "INTERNAL"]


def test_a_stream_that_fails_midway_ends_with_the_errors_status():
    (whole, broken), seen = asyncio.run(_serve_and_call([_stream_call(b"x"), _stream_call(b"missing")]))
    assert whole == [b"first", b"second"]
    assert broken == (grpc.StatusCode.NOT_FOUND, "gone midway")
    assert [code for _, code, _ in seen] == ["OK", "NOT_FOUND"]


def test_health_watch_which_writes_to_its_context_passes_through():
    async def watch_once(channel):
        stub = health_pb2_grpc.HealthStub(channel)
        call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        first = await call.read()
        call.cancel()
        return first.status

    (status,), _ = asyncio.run(_serve_and_call([watch_once]))
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_a_refusal_with_a_retry_hint_carries_it_in_milliseconds_and_others_carry_none():
    def trailing(payload):
        async def call(channel):
            try:
                await channel.unary_unary("/test.Service/Unary")(payload, timeout=5)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.trailing_metadata()
        return call

    (busy, missing), _ = asyncio.run(_serve_and_call([trailing(b"busy"), trailing(b"missing")]))
    assert busy[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("grpc-retry-pushback-ms", "1250") in tuple(busy[1])
    assert retry_after_s(busy[1]) == 1.25
    assert retry_after_s(missing[1]) is None

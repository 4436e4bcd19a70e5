"""The router's OpenAI-compatible HTTP API (aiohttp): ``POST /v1/completions``, ``POST /v1/chat/completions``
(whole or as server-sent events) and ``GET /v1/models``. Each request becomes one GenerateRequest that goes
through the same Door and Forwarder as a gRPC call (the tenants' gate, picking, retries before the first
message, cancellation, usage); the pod's messages are decoded into OpenAI's JSON. Errors are OpenAI's error
JSON with the matching status. A request's deadline is its ``X-Request-Timeout`` header or ``timeout`` body
field (seconds), else the router's --http-timeout: it goes to the pod as the gRPC deadline."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from lorafleet.v1 import generation_pb2 as g

from conventions.errors import LorafleetError
from router.access import Access
from router.door import Door
from router.metrics import RouterMetrics
from router.openai_errors import ApiError, from_domain, invalid, retry_after_header
from router.openai_requests import ApiRequest, Endpoint, parse_chat, parse_completion
from router.openai_responses import ResponseBuilder, models, sse
from router.request import RoutedRequest
from router.view import FleetView

log = logging.getLogger("lorafleet.router.http")

_ROUTES = "POST /v1/completions, POST /v1/chat/completions and GET /v1/models"
_ID_PREFIX = {Endpoint.COMPLETIONS: "cmpl-", Endpoint.CHAT: "chatcmpl-"}
# How long a stopping router lets HTTP requests in flight finish before cancelling them (and their pod calls).
_SHUTDOWN_GRACE_S = 5.0
TIMEOUT_HEADER = "X-Request-Timeout"
TENANT = web.RequestKey("tenant", object)  # the caller's Tenant, or None while the doors are open
_MAX_TIMEOUT_S = 24 * 3600.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpApi:
    """Serves the API on one port. ``view`` returns the router's latest FleetView (None before the first
    read); ``access`` says who may call what; ``timeout_s`` is the deadline of a request that names none."""

    def __init__(self, door: Door, view: Callable[[], FleetView | None], metrics: RouterMetrics,
                 access: Access, max_body_bytes: int, timeout_s: float = 600.0) -> None:
        self._door, self._view, self._metrics, self._access = door, view, metrics, access
        self._max_body, self._timeout_s = max_body_bytes, timeout_s
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body, middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        """Listens on ``host:port``, over HTTPS with ``ssl_context``. A client that disconnects cancels its
        handler, and so its pod call."""
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                                     shutdown_timeout=_SHUTDOWN_GRACE_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, ssl_context=ssl_context).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        timeout = self._deadline(request, body)
        return await self._generate(request, parse_completion(body), timeout)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        timeout = self._deadline(request, body)
        return await self._generate(request, parse_chat(body), timeout)

    async def models(self, request: web.Request) -> web.StreamResponse:
        """The base model and the adapters, each only if the caller's tenant may use it."""
        view = self._live_view()
        tenant = request.get(TENANT)
        listed = models(view.base_model, [a for a in view.adapters if tenant is None or tenant.may_use(a)],
                        int(time.time()))
        if tenant is not None and not tenant.may_use(""):
            listed["data"] = listed["data"][1:]  # the adapters still name the base model as their parent
        return web.json_response(listed)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every refusal as OpenAI's error JSON; counts responses by route and status."""
        try:
            response = await handler(request)
        except web.HTTPException as e:
            response = _error_response(_from_http(e, request, self._max_body))
        except LorafleetError as e:
            response = _error_response(from_domain(e))
        except Exception:
            log.exception("HTTP request failed", extra={"path": request.path})
            response = _error_response(ApiError(500, "the router failed to serve the request; see its log",
                                                "server_error"))
        route = request.match_info.route.resource
        self._metrics.http_responses.labels(route.canonical if route else "unknown", str(response.status)).inc()
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        request[TENANT] = self._access.tenant(request.headers.get("Authorization"))
        return await handler(request)

    def _deadline(self, request: web.Request, body) -> float:
        """The request's timeout in seconds: the header, else the body's ``timeout`` (taken out of the body,
        which OpenAI's fields are then checked against), else the router's default."""
        given, param = request.headers.get(TIMEOUT_HEADER), TIMEOUT_HEADER
        if isinstance(body, dict) and "timeout" in body:
            from_body = body.pop("timeout")
            given, param = (given, param) if given is not None else (from_body, "timeout")
        if given is None:
            return self._timeout_s
        try:
            seconds = float(given)
        except (TypeError, ValueError):
            seconds = math.nan
        if isinstance(given, bool) or not 0 < seconds <= _MAX_TIMEOUT_S:
            raise invalid(param, f"{param} must be a number of seconds in (0, {_MAX_TIMEOUT_S:g}], got {given!r}")
        return seconds

    def _live_view(self) -> FleetView:
        view = self._view()
        if view is None or not view.base_model:
            raise ApiError(503, "the router has not read the fleet's state yet; retry in a moment",
                           "service_unavailable_error")
        return view

    def _adapter(self, model: str, tenant) -> str:
        """The adapter ``model`` names: "" for the base model id; 404 for neither. A model the caller's tenant
        may not use is left to the gate (403), so that the answer says nothing of whether it exists."""
        view = self._live_view()
        if model == view.base_model:
            return ""
        if model not in view.adapters and (tenant is None or tenant.may_use(model)):
            raise ApiError(404, f"the model {model!r} does not exist: use the base model {view.base_model!r} or a"
                           " registered adapter (GET /v1/models lists them)", "not_found_error", "model",
                           "model_not_found")
        return model

    async def _generate(self, request: web.Request, api: ApiRequest, timeout: float) -> web.StreamResponse:
        adapter = self._adapter(api.model, request.get(TENANT))
        response_id = _ID_PREFIX[api.endpoint] + uuid.uuid4().hex
        routed = RoutedRequest.of(api.generate_request(adapter, response_id))
        builder = ResponseBuilder(api, response_id, int(time.time()))
        async with contextlib.aclosing(self._door.stream(routed, request.get(TENANT), timeout, "http")) as messages:
            if not api.stream:
                async for raw in messages:
                    builder.add(g.GenerateResponse.FromString(raw))
                return web.json_response(builder.complete())
            # Errors up to the first message get their own status; after it, they end the event stream.
            first = await anext(messages, None)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                await _stream(response, builder, first, messages, api.include_usage)
            except LorafleetError as e:
                await response.write(sse(from_domain(e).body()))
            except ConnectionResetError:
                log.info("client went away mid-stream; the pod call is cancelled", extra={"id": response_id})
                return response
            await response.write_eof()
            return response


async def _stream(response: web.StreamResponse, builder: ResponseBuilder, raw: bytes | None, messages,
                  include_usage: bool) -> None:
    while raw is not None:
        chunk = builder.chunk(g.GenerateResponse.FromString(raw))
        if chunk is not None:
            await response.write(sse(chunk))
        raw = await anext(messages, None)
    if include_usage:
        await response.write(sse(builder.usage_chunk()))
    await response.write(sse("[DONE]"))


async def _json(request: web.Request):
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid(None, f"the request body is not valid JSON ({e}); send a JSON object") from None


def _from_http(error: web.HTTPException, request: web.Request, max_body: int) -> ApiError:
    if error.status == 413:
        return ApiError(413, f"the request body is larger than the router's limit of {max_body} bytes"
                        " (--http-max-body-bytes)", code="request_too_large")
    if error.status in (404, 405):
        return ApiError(error.status, f"no route {request.method} {request.path}; the API serves {_ROUTES}",
                        code="unknown_route")
    return ApiError(error.status, error.reason, "server_error" if error.status >= 500 else "invalid_request_error")


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.http_status, headers=retry_after_header(error))

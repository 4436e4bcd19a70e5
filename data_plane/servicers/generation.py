"""``Generation.Generate``: proto <-> engine."""

from __future__ import annotations

import json
from collections.abc import Callable

from lorafleet.v1 import generation_pb2, generation_pb2_grpc

from conventions.prefix_chain import routing_prefix
from data_plane.demand import DemandMeter
from data_plane.engine.choices import generate_choices
from data_plane.engine.engine import Engine, StepOutput
from data_plane.engine.grammar import Constraint, ConstraintKind
from data_plane.engine.sequence import FinishReason, SamplingParams
from data_plane.errors import InvalidRequest
from data_plane.servicers import EngineHandle

_FINISH = {FinishReason.STOP: generation_pb2.STOP, FinishReason.LENGTH: generation_pb2.LENGTH}
_ROLES = ("system", "user", "assistant", "tool")


# Characters of a request's cache_salt: a router's tenant scope (under 80) and the caller's salt (at most 256).
MAX_CACHE_SALT = 512


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, handle: EngineHandle, demand: DemandMeter | None = None) -> None:
        self._handle = handle
        self._demand = demand

    async def Generate(self, request: generation_pb2.GenerateRequest, context):
        if request.adapter and self._demand is not None:
            self._demand.record(request.adapter)  # on arrival: a request refused for load is demand too
        engine = self._handle.get()
        if len(request.cache_salt) > MAX_CACHE_SALT:
            raise InvalidRequest(f"cache_salt has {len(request.cache_salt)} characters; send at most {MAX_CACHE_SALT}")
        prompt_ids = _prompt_ids(engine, request)
        params = sampling_params(request.sampling, constraint(request))
        text_of = _token_text(engine) if request.sampling.token_text else None
        async for index, out in generate_choices(engine, prompt_ids, params, request.adapter or None,
                                                 request.request_id or None, context.time_remaining(),
                                                 request.tenant or None, routing_prefix(request), request.cache_salt):
            yield _response(out, request.request_id, text_of, index)


def _prompt_ids(engine: Engine, request: generation_pb2.GenerateRequest) -> list[int]:
    tokenizer = engine.tokenizer
    kind = request.WhichOneof("input")
    if request.tools_json and kind != "messages":
        raise InvalidRequest("tools_json needs messages: tools are rendered by the chat template")
    if kind == "prompt":
        return tokenizer.encode(request.prompt)
    if kind == "messages":
        messages = [_message(m) for m in request.messages.messages]
        if not messages:
            raise InvalidRequest("messages is empty; send at least one chat message")
        bad = [m["role"] for m in messages if m["role"] not in _ROLES]
        if bad:
            raise InvalidRequest(f"unknown chat role {bad[0]!r}; use one of {', '.join(_ROLES)}")
        tools = _json_list(request.tools_json, "tools_json") if request.tools_json else None
        return tokenizer.encode(tokenizer.render_chat(messages, tools=tools))
    raise InvalidRequest("the request has neither prompt nor messages; send one of them")


def _message(m: generation_pb2.ChatMessage) -> dict:
    out = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        calls = _json_list(m.tool_calls_json, "tool_calls_json")
        if not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                   and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments"), str)
                   for c in calls):
            raise InvalidRequest('each of tool_calls_json must be {"function": {"name": str, "arguments": str}, ...}')
        out["tool_calls"] = calls
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _json_list(text: str, field: str) -> list:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{field} is not valid JSON ({e}); send a JSON array") from None
    if not isinstance(value, list):
        raise InvalidRequest(f"{field} must be a JSON array")
    return value


def sampling_params(p: generation_pb2.SamplingParams, structured: Constraint | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k, seed=p.seed if p.HasField("seed") else None, stop=tuple(p.stop),
        logprobs=p.logprobs, ignore_eos=p.ignore_eos, logit_bias=tuple(sorted(p.logit_bias.items())),
        n=max(p.n, 1), constraint=structured,
    )


def constraint(request: generation_pb2.GenerateRequest) -> Constraint | None:
    """The request's structured-output constraint; None for free text."""
    so = request.structured_output
    kind = so.WhichOneof("kind") if request.HasField("structured_output") else None
    if kind is None:
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT) if so.json_object else None
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, json.dumps(list(so.choice.choices)))
    return Constraint(ConstraintKind(kind), getattr(so, kind))


def _token_text(engine: Engine) -> Callable[[int], str]:
    """Each token's own text, special tokens included (a logprob row names the token it scores)."""
    return lambda token_id: engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _response(out: StepOutput, request_id: str, text_of: Callable[[int], str] | None = None,
              index: int = 0) -> generation_pb2.GenerateResponse:
    text = text_of or (lambda _: "")
    tokens = [generation_pb2.Token(id=t.id, logprob=t.logprob, text=text(t.id),
                                   top_logprobs=[generation_pb2.TopLogprob(id=i, logprob=lp, text=text(i))
                                                 for i, lp in t.top])
              for t in out.tokens]
    response = generation_pb2.GenerateResponse(text=out.text, tokens=tokens, request_id=request_id, index=index)
    if out.finish_reason is not None:
        response.finish_reason = _FINISH.get(out.finish_reason, generation_pb2.STOP)
        response.usage.prompt_tokens = out.prompt_tokens
        response.usage.completion_tokens = out.completion_tokens
    return response

"""OpenAI request bodies, read and checked: ``/v1/completions`` and ``/v1/chat/completions`` JSON becomes
an ApiRequest, which becomes one GenerateRequest. Every field is either used, accepted at the value that
changes nothing (OpenAI clients send some by default), or refused with a 400 that names it. Pure."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lorafleet.v1 import generation_pb2 as g

from router.openai_errors import invalid
from router.openai_structured import structured_output
from router.openai_tools import Tools, parse_tools
from router.request import MAX_CACHE_SALT

MAX_LOGPROBS = 20  # the most alternatives a pod returns per token
MAX_STOP = 16
MAX_CHOICES = 16  # n; as the pods allow
MAX_LOGIT_BIAS = 300  # token ids one request may bias, as OpenAI allows
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context limit
_UINT32, _UINT64 = 2 ** 32 - 1, 2 ** 64 - 1
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class Endpoint(Enum):
    COMPLETIONS = "completions"
    CHAT = "chat.completions"


@dataclass(frozen=True)
class ApiRequest:
    """One checked request. ``logprobs`` is None when none were asked for, else the number of top
    alternatives per token."""

    endpoint: Endpoint
    model: str
    prompt: str | None
    messages: tuple[g.ChatMessage, ...]  # oldest first
    sampling: g.SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None
    structured: g.StructuredOutput | None = None  # the output's constraint (a forced tool call's included)
    tools: Tools | None = None  # tools the model may (or must) call; None: none, or tool_choice "none"
    cache_salt: str = ""  # keeps its cached prompt blocks apart from other salts' (GenerateRequest.cache_salt)

    @property
    def n(self) -> int:
        return max(self.sampling.n, 1)

    def generate_request(self, adapter: str, request_id: str) -> g.GenerateRequest:
        """The GenerateRequest a pod serves for this request, for ``adapter`` ("" = base model)."""
        req = g.GenerateRequest(request_id=request_id, adapter=adapter, sampling=self.sampling)
        if self.prompt is not None:
            req.prompt = self.prompt
        else:
            req.messages.messages.extend(self.messages)
        if self.structured is not None:
            req.structured_output.CopyFrom(self.structured)
        if self.tools is not None:
            req.tools_json = self.tools.tools_json()
        req.cache_salt = self.cache_salt
        return req


class _Fields:
    """The body's fields, taken one by one with a check each; a JSON null counts as absent."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise invalid(None, "the request body must be a JSON object")
        self._left = {k: v for k, v in body.items() if v is not None}

    def take(self, name: str) -> Any:
        return self._left.pop(name, None)

    def string(self, name: str, required: bool = False) -> str | None:
        value = self.take(name)
        if value is None and required:
            raise invalid(name, f"'{name}' is required")
        if value is not None and not isinstance(value, str):
            raise invalid(name, f"'{name}' must be a string")
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.take(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(name, f"'{name}' must be true or false")
        return value

    def integer(self, name: str, low: int, high: int, default: int | None = None) -> int | None:
        value = self.take(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise invalid(name, f"'{name}' must be an integer within [{low}, {high}], got {value!r}")
        return value

    def number(self, name: str, low: float, high: float, default: float, low_open: bool = False) -> float:
        value = self.take(name)
        if value is None:
            return default
        bad = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
        if bad or not (low < value if low_open else low <= value) or value > high:
            span = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
            raise invalid(name, f"'{name}' must be a number within {span}, got {value!r}")
        return float(value)

    def neutral(self, name: str, *accepted: Any) -> None:
        """Accepts ``name`` only at a value that changes nothing here; anything else is unsupported."""
        value = self.take(name)
        if value is not None and value not in accepted:
            raise invalid(name, f"'{name}' is not supported with the value {value!r}; leave it out"
                          f" or send {accepted[0]!r}")

    def done(self) -> None:
        """Refuses whatever field was not taken: an unknown field would otherwise be silently ignored."""
        if self._left:
            name = sorted(self._left)[0]
            raise invalid(name, f"unsupported field '{name}'; lorafleet's OpenAI API does not implement it")


def parse_completion(body: Any) -> ApiRequest:
    """A ``/v1/completions`` body, checked. 400 (ApiError) names the first bad field."""
    f = _Fields(body)
    model = f.string("model", required=True)
    prompt = f.take("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt", "'prompt' must be a string (or a list of one string); token-id prompts and"
                      " batches of prompts are not supported")
    max_tokens = f.integer("max_tokens", 1, _UINT32, _COMPLETION_DEFAULT_MAX_TOKENS)
    logprobs = f.integer("logprobs", 0, MAX_LOGPROBS)
    f.neutral("echo", False)
    f.neutral("best_of", 1)
    f.neutral("suffix", "")
    return _finish(f, Endpoint.COMPLETIONS, model, prompt, (), max_tokens, logprobs)


def parse_chat(body: Any) -> ApiRequest:
    """A ``/v1/chat/completions`` body, checked. 400 (ApiError) names the first bad field."""
    f = _Fields(body)
    model = f.string("model", required=True)
    messages = _messages(f.take("messages"))
    max_tokens = f.integer("max_completion_tokens", 1, _UINT32)
    legacy = f.integer("max_tokens", 1, _UINT32)
    if max_tokens is not None and legacy is not None and max_tokens != legacy:
        raise invalid("max_tokens", "send either 'max_completion_tokens' or 'max_tokens', not two different values")
    max_tokens = max_tokens if max_tokens is not None else legacy
    wants_logprobs = f.boolean("logprobs")
    top = f.integer("top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not wants_logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    tools = parse_tools(f)
    f.neutral("functions", [])
    f.neutral("function_call", "none", "auto")
    f.neutral("store", False)
    f.neutral("service_tier", "auto", "default")
    f.neutral("modalities", ["text"])
    metadata = f.take("metadata")  # kept by OpenAI with stored completions only; nothing is stored here
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata", "'metadata' must be an object")
    logprobs = (top or 0) if wants_logprobs else None
    return _finish(f, Endpoint.CHAT, model, None, messages, max_tokens or 0, logprobs, tools)


def _finish(f: _Fields, endpoint: Endpoint, model: str, prompt: str | None, messages: tuple,
            max_tokens: int, logprobs: int | None, tools: Tools | None = None) -> ApiRequest:
    """The fields both endpoints share, then the request."""
    structured = structured_output(f)
    if tools is not None and tools.forced:
        if structured is not None:
            raise invalid("tool_choice", "a forced tool call already constrains the output; drop the"
                          " response_format / guided_* field or set 'tool_choice' to \"auto\"")
        structured = tools.constraint()
    sampling = g.SamplingParams(
        max_tokens=max_tokens, logprobs=logprobs or 0, token_text=logprobs is not None,
        temperature=f.number("temperature", 0.0, 2.0, 1.0),
        top_p=f.number("top_p", 0.0, 1.0, 1.0, low_open=True),
        top_k=f.integer("top_k", 0, _UINT32, 0),  # an extension, as in vLLM; 0 disables it
        ignore_eos=f.boolean("ignore_eos"),  # an extension, as in vLLM
        stop=_stop(f.take("stop")))
    seed = f.integer("seed", 0, _UINT64)
    if seed is not None:
        sampling.seed = seed
    n = f.integer("n", 1, MAX_CHOICES, 1)
    if n > 1:  # unset is one choice: a request without n reads as it always did
        sampling.n = n
    for token, bias in _logit_bias(f.take("logit_bias")).items():
        sampling.logit_bias[token] = bias
    f.neutral("frequency_penalty", 0)
    f.neutral("presence_penalty", 0)
    f.string("user")  # an end-user id for abuse tracking upstream; nothing to do with it here
    cache_salt = f.string("cache_salt") or ""  # an extension, as in vLLM: prompts cached apart from other salts
    if len(cache_salt) > MAX_CACHE_SALT:
        raise invalid("cache_salt", f"'cache_salt' must be at most {MAX_CACHE_SALT} characters, got {len(cache_salt)}")
    stream = f.boolean("stream")
    options = f.take("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed with 'stream': true")
        if not isinstance(options, dict) or set(options) - {"include_usage"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise invalid("stream_options", "'stream_options' must be {\"include_usage\": true|false}")
        include_usage = options.get("include_usage", False)
    f.done()
    return ApiRequest(endpoint, model, prompt, messages, sampling, stream, include_usage, logprobs, structured, tools,
                      cache_salt)


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}``, checked; the pod checks the ids against its vocabulary."""
    if value is None:
        return {}
    rule = (f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids (as strings) to numbers within"
            " [-100, 100]")
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid("logit_bias", rule)
    out = {}
    for key, bias in value.items():
        ok = isinstance(key, str) and key.isdigit() and int(key) <= _UINT32 and not isinstance(bias, bool) \
            and isinstance(bias, int | float) and math.isfinite(bias) and -100 <= bias <= 100
        if not ok:
            raise invalid("logit_bias", f"{rule}; got {key!r}: {bias!r}")
        out[int(key)] = float(bias)
    return out


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them")
    return stops


def _messages(value: Any) -> tuple[g.ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content", "name", "tool_calls", "tool_call_id"}:
            raise invalid(param, f"'{param}' must be an object with 'role' and 'content' (and an optional 'name';"
                          " 'tool_calls' on an assistant turn, 'tool_call_id' on a tool turn)")
        role = _ROLES.get(message.get("role"))
        if role is None:
            raise invalid(f"{param}.role", f"'{param}.role' must be one of {', '.join(_ROLES)};"
                          f" got {message.get('role')!r}")
        calls = message.get("tool_calls")
        if calls is not None and (role != "assistant" or not _tool_calls_ok(calls)):
            raise invalid(f"{param}.tool_calls", f"'{param}.tool_calls' belongs to an assistant turn: a list of "
                          "{\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\" (a string)}}")
        call_id = message.get("tool_call_id")
        if (role == "tool") != isinstance(call_id, str):
            raise invalid(f"{param}.tool_call_id", f"'{param}': a tool turn, and only a tool turn, carries"
                          " 'tool_call_id' (a string)")
        content = "" if calls and message.get("content") is None else _content(message.get("content"),
                                                                               f"{param}.content")
        out.append(g.ChatMessage(role=role, content=content, tool_calls_json=json.dumps(calls) if calls else "",
                                 tool_call_id=call_id or "", name=message.get("name") or "" if role == "tool" else ""))
    return tuple(out)


def _tool_calls_ok(calls: Any) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), str) for c in calls)


def _content(value: Any, param: str) -> str:
    """A message's text: a string, or a list of text parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise invalid(param, f"'{param}' must be a string or a list of {{\"type\": \"text\", \"text\": ...}} parts;"
                  " images, audio and files are not supported")

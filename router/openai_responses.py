"""OpenAI response bodies built from a pod's GenerateResponse messages: the whole completion, or one
server-sent-event chunk per message. Pure.

The router holds no tokenizer: it asks the pod for each token's text (``SamplingParams.token_text``) when
logprobs are wanted and names tokens by it; a pod that sent none is answered with ``token_id:<id>`` (the
form vLLM's ``--return-tokens-as-token-ids`` uses) and ``bytes`` null."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from lorafleet.v1 import generation_pb2 as g

from router.openai_requests import ApiRequest, Endpoint
from router.openai_tools import call_id

OWNER = "lorafleet"
_FINISH = {g.STOP: "stop", g.LENGTH: "length"}


def token_name(token: g.Token | g.TopLogprob) -> str:
    """The token's text as the pod decoded it; a pod that sent none is named by id, as vLLM's
    ``--return-tokens-as-token-ids`` does."""
    return token.text or f"token_id:{token.id}"


def token_bytes(token: g.Token | g.TopLogprob) -> list[int] | None:
    """The text's UTF-8 bytes; None for a token holding part of a character (its text is U+FFFD, whose
    bytes would not be the token's own)."""
    return list(token.text.encode()) if token.text and "\ufffd" not in token.text else None


def usage(u: g.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def sse(body: dict | str) -> bytes:
    """One server-sent event carrying ``body`` (a JSON object, or the literal ``[DONE]``)."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, separators=(',', ':'))}\n\n".encode()


def models(base_model: str, adapters: list[str], created: int) -> dict:
    """``/v1/models``: the base model, then every adapter with the base model as its parent."""
    entry = lambda name, parent: {"id": name, "object": "model", "created": created, "owned_by": OWNER,
                                  "root": base_model, "parent": parent}
    return {"object": "list", "data": [entry(base_model, None), *(entry(a, base_model) for a in sorted(adapters))]}


class ResponseBuilder:
    """Turns the pod's messages for one request into OpenAI bodies: ``chunk`` per message when streaming,
    else ``add`` each and ``complete`` once. Messages of several choices (``n``) interleave; each carries its
    choice's index. With tools, a choice's text is read for calls once it is whole, so a streamed choice
    comes as one chunk at its end."""

    def __init__(self, request: ApiRequest, response_id: str, created: int) -> None:
        self._request, self._id, self._created = request, response_id, created
        self._chat = request.endpoint is Endpoint.CHAT
        self._choices: dict[int, _Choice] = {}

    def add(self, message: g.GenerateResponse) -> None:
        choice = self._choices.setdefault(message.index, _Choice())
        choice.text.append(message.text)
        choice.tokens.extend(message.tokens)
        choice.last = message

    def complete(self) -> dict:
        """The non-streaming body, once every message was added."""
        choices = []
        for index, c in sorted(self._choices.items()):
            text = "".join(c.text)
            body = {"index": index, "logprobs": self._logprobs(c.tokens), "finish_reason": self._finish(c.last)}
            if self._chat:
                body["message"] = {"role": "assistant", "content": text}
                self._read_calls(body, body["message"], text)
            else:
                body["text"] = text
            choices.append(body)
        return self._envelope("chat.completion" if self._chat else "text_completion", choices, usage=self._usage())

    def chunk(self, message: g.GenerateResponse) -> dict | None:
        """The streamed chunk of one message; None for a message that carries nothing (yet)."""
        finish = self._finish(message) if message.finish_reason else None
        first = message.index not in self._choices
        self.add(message)
        if self._request.tools is not None:
            prefix = self._request.tools.call_prefix()
            streamed = self._named_call_chunk(message, prefix, finish) if prefix is not None else None
            if streamed is not None or self._choices[message.index].call_id is not None:
                return streamed
            # otherwise the choice's calls are known only once its text is whole
            return self._tool_chunk(message.index) if finish else None
        if not (message.text or message.tokens or finish or (self._chat and first)):
            return None
        choice = {"index": message.index, "logprobs": self._logprobs(message.tokens), "finish_reason": finish}
        if self._chat:
            choice["delta"] = {"content": message.text}
            if first:
                choice["delta"]["role"] = "assistant"
        else:
            choice["text"] = message.text
        return self._chunk_body(choice)

    def usage_chunk(self) -> dict:
        """The chunk after the last when ``stream_options.include_usage``: no choices, the request's usage."""
        return self._envelope("chat.completion.chunk" if self._chat else "text_completion", [], usage=self._usage())

    def _tool_chunk(self, index: int) -> dict:
        c = self._choices[index]
        text = "".join(c.text)
        choice = {"index": index, "logprobs": self._logprobs(c.tokens), "finish_reason": self._finish(c.last),
                  "delta": {"role": "assistant", "content": text}}
        self._read_calls(choice, choice["delta"], text)
        return self._chunk_body(choice)

    def _named_call_chunk(self, message: g.GenerateResponse, prefix: str, finish: str | None) -> dict | None:
        """The next piece of a forced call's arguments, streamed as they come: the call's id and name with the
        first piece, the object's closing brace held back until the end. None while nothing can be sent, or
        for a text that does not begin as expected (then the call is read whole at the end)."""
        c = self._choices[message.index]
        text = "".join(c.text)
        if not text.startswith(prefix) or (len(text) == len(prefix) and not finish):
            return None
        arguments = text[len(prefix):]
        end = len(arguments) - (1 if arguments.endswith("}") else 0) if finish else len(arguments) - 1
        piece = arguments[c.sent_arguments:max(end, c.sent_arguments)]
        if not piece and c.call_id is not None and not finish:
            return None
        delta_call = {"index": 0, "function": {"arguments": piece}}
        c.sent_arguments += len(piece)
        delta: dict = {"tool_calls": [delta_call]}
        if c.call_id is None:
            c.call_id = call_id()
            delta_call |= {"id": c.call_id, "type": "function"}
            delta_call["function"]["name"] = self._request.tools.choice
            delta |= {"role": "assistant", "content": None}
        reason = "tool_calls" if finish == "stop" else finish
        return self._chunk_body({"index": message.index, "logprobs": self._logprobs(message.tokens),
                                 "finish_reason": reason, "delta": delta})

    def _read_calls(self, choice: dict, message: dict, text: str) -> None:
        """Turns ``message``'s text into tool calls where the request has tools and the text holds calls."""
        if self._request.tools is None:
            return
        content, calls = self._request.tools.read(text)
        if calls:
            message["content"], message["tool_calls"] = content, calls
            choice["finish_reason"] = "tool_calls"

    def _chunk_body(self, choice: dict) -> dict:
        body = self._envelope("chat.completion.chunk" if self._chat else "text_completion", [choice])
        if self._request.include_usage:
            body["usage"] = None  # OpenAI's form: every chunk but the usage chunk has a null usage
        return body

    def _usage(self) -> dict:
        """The prompt once, and the completion tokens of every choice."""
        lasts = [c.last.usage for c in self._choices.values()] or [g.Usage()]
        return usage(g.Usage(prompt_tokens=lasts[0].prompt_tokens,
                             completion_tokens=sum(u.completion_tokens for u in lasts)))

    def _envelope(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self._id, "object": kind, "created": self._created, "model": self._request.model,
                "choices": choices, **extra}

    @staticmethod
    def _finish(message: g.GenerateResponse) -> str:
        return _FINISH.get(message.finish_reason, "stop")

    def _logprobs(self, tokens) -> dict | None:
        if self._request.logprobs is None:
            return None
        if self._chat:
            return {"content": [{"token": token_name(t), "logprob": t.logprob, "bytes": token_bytes(t),
                                 "top_logprobs": [{"token": token_name(a), "logprob": a.logprob,
                                                   "bytes": token_bytes(a)} for a in t.top_logprobs]}
                                for t in tokens]}
        return {"tokens": [token_name(t) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{token_name(a): a.logprob for a in t.top_logprobs} for t in tokens]}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    tokens: list[g.Token] = field(default_factory=list)
    last: g.GenerateResponse = field(default_factory=g.GenerateResponse)
    call_id: str | None = None  # a streamed forced call's id, once its first piece went out
    sent_arguments: int = 0  # characters of its arguments sent so far

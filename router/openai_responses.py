"""OpenAI response bodies built from a pod's GenerateResponse messages: the whole completion, or one
server-sent-event chunk per message. Pure.

The router holds no tokenizer: it asks the pod for each token's text (``SamplingParams.token_text``) when
logprobs are wanted and names tokens by it; a pod that sent none is answered with ``token_id:<id>`` (the
form vLLM's ``--return-tokens-as-token-ids`` uses) and ``bytes`` null."""

from __future__ import annotations

import json

from lorafleet.v1 import generation_pb2 as g

from router.openai_requests import ApiRequest, Endpoint

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
    else ``add`` each and ``complete`` once."""

    def __init__(self, request: ApiRequest, response_id: str, created: int) -> None:
        self._request, self._id, self._created = request, response_id, created
        self._chat = request.endpoint is Endpoint.CHAT
        self._text: list[str] = []
        self._tokens: list[g.Token] = []
        self._last = g.GenerateResponse()
        self._role_sent = False

    def add(self, message: g.GenerateResponse) -> None:
        self._text.append(message.text)
        self._tokens.extend(message.tokens)
        self._last = message

    def complete(self) -> dict:
        """The non-streaming body, once every message was added."""
        text = "".join(self._text)
        choice = {"index": 0, "logprobs": self._logprobs(self._tokens), "finish_reason": self._finish(self._last)}
        if self._chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return self._envelope("chat.completion" if self._chat else "text_completion", [choice],
                              usage=usage(self._last.usage))

    def chunk(self, message: g.GenerateResponse) -> dict | None:
        """The streamed chunk of one message; None for a message that carries nothing."""
        finish = self._finish(message) if message.finish_reason else None
        if not (message.text or message.tokens or finish or (self._chat and not self._role_sent)):
            return None
        choice = {"index": 0, "logprobs": self._logprobs(message.tokens), "finish_reason": finish}
        if self._chat:
            choice["delta"] = {"content": message.text}
            if not self._role_sent:
                choice["delta"]["role"] = "assistant"
                self._role_sent = True
        else:
            choice["text"] = message.text
        body = self._envelope("chat.completion.chunk" if self._chat else "text_completion", [choice])
        if self._request.include_usage:
            body["usage"] = None  # OpenAI's form: every chunk but the usage chunk has a null usage
        return body

    def usage_chunk(self, message: g.GenerateResponse) -> dict:
        """The chunk after the last when ``stream_options.include_usage``: no choices, the request's usage."""
        return self._envelope("chat.completion.chunk" if self._chat else "text_completion", [],
                              usage=usage(message.usage))

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

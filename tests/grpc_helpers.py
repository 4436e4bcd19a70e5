"""Client-side helpers shared by the tests that drive real processes over gRPC: building a
Generate request and reading a whole stream."""

from __future__ import annotations

from lorafleet.v1 import generation_pb2 as g


def request(prompt: str, adapter: str | None = None, max_tokens: int = 12, chat: bool = True,
            **sampling) -> g.GenerateRequest:
    req = g.GenerateRequest(adapter=adapter or "", sampling=g.SamplingParams(max_tokens=max_tokens, **sampling))
    if chat:
        req.messages.messages.append(g.ChatMessage(role="user", content=prompt))
    else:
        req.prompt = prompt
    return req


def collect(pod, req: g.GenerateRequest, timeout: float = 120) -> tuple[str, list[g.Token], g.GenerateResponse]:
    """(text, tokens, last message) of one whole Generate stream from ``pod``."""
    text, tokens, last = "", [], None
    for last in pod.generation().Generate(req, timeout=timeout):
        text += last.text
        tokens.extend(last.tokens)
    return text, tokens, last


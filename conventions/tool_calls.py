"""Tool calls as text, for models whose chat template has no tool format of its own.

The pod describes the tools in a system turn and writes earlier calls into assistant turns as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the convention of Hermes-style
templates); the router reads the calls a model wrote that way back out of its text. A template that
renders ``tools`` itself is given the tools and the calls unchanged instead.
"""

from __future__ import annotations

import json
import re

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def system_text(tools: list[dict]) -> str:
    """The system turn's description of ``tools`` (OpenAI's ``tools`` list)."""
    described = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to help with the user's request. The functions, as JSON:\n"
            f"{described}\nTo call a function, answer with one JSON object per call inside tags, like "
            f'{OPEN}{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}{CLOSE}')


def call_text(name: str, arguments: str) -> str:
    """An earlier call written into an assistant turn; ``arguments`` is the call's JSON text."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        args = arguments
    return f"{OPEN}{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}{CLOSE}"


def inline(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` with the tools described in the (first) system turn and each assistant turn's
    ``tool_calls`` written into its content: what a template without a tool format can render."""
    out = [dict(m) for m in messages]
    if tools:
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{system_text(tools)}"
        else:
            out.insert(0, {"role": "system", "content": system_text(tools)})
    for m in out:
        calls = m.pop("tool_calls", None) or []
        m.pop("tool_call_id", None)
        m.pop("name", None)
        if calls:
            written = "".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)
            m["content"] = (m.get("content") or "") + written
    return out


def parse_calls(text: str, names: set[str]) -> tuple[str, list[tuple[str, str]]]:
    """(the text outside the calls, stripped; [(function name, arguments as JSON text)]) of the
    ``<tool_call>`` blocks in ``text`` that hold a JSON object naming one of ``names``. Blocks that do
    not are left in the text."""
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            continue
        args = call.get("arguments", call.get("parameters", {}))
        calls.append((call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        kept.append(text[last : match.start()])
        last = match.end()
    kept.append(text[last:])
    return "".join(kept).strip(), calls

"""Tool calls on chat completions: ``tools`` and ``tool_choice`` read from a request, the constraint that
forces a call, and the calls read back out of a choice's text. Pure.

- ``none``: the tools are not shown to the model; it answers in text.
- ``auto`` (the default with tools): the pod shows the tools to the model (the chat template's own tool
  format, or conventions/tool_calls.py's) and the model writes text or ``<tool_call>`` blocks; those
  naming a declared function become ``tool_calls``.
- ``required`` or a named function: the output is constrained to a JSON call, each call's arguments to
  its function's ``parameters`` schema: ``[{"name": ..., "arguments": {...}}, ...]`` for ``required``
  (one call unless ``parallel_tool_calls``), ``{"name": ..., "arguments": {...}}`` for a named one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lorafleet.v1 import generation_pb2 as g

from conventions import tool_calls
from router.openai_errors import invalid

MAX_TOOLS = 128


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict, ...]  # each tool's "function" object: name, description, parameters
    choice: str  # "auto", "required", or the name of the function that must be called
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def names(self) -> set[str]:
        return {fn["name"] for fn in self.functions}

    def tools_json(self) -> str:
        """The tools as the pod renders them (OpenAI's ``tools`` list)."""
        return json.dumps([{"type": "function", "function": fn} for fn in self.functions])

    def constraint(self) -> g.StructuredOutput | None:
        """The output's JSON schema when a call is forced; None under ``auto``."""
        if not self.forced:
            return None
        calls = {fn["name"]: _call_schema(fn) for fn in self.functions}
        if self.choice != "required":
            return g.StructuredOutput(json_schema=json.dumps(calls[self.choice]))
        schema = {"type": "array", "items": {"anyOf": list(calls.values())}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return g.StructuredOutput(json_schema=json.dumps(schema))

    def call_prefix(self) -> str | None:
        """The text a forced call of one named function begins with, up to its arguments, as the pods write
        JSON (on one line, ", " and ": " between items); None unless one named function is forced."""
        if self.choice in ("auto", "required"):
            return None
        return '{"name": ' + json.dumps(self.choice, ensure_ascii=False) + ', "arguments": '

    def read(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of one choice's whole text, in OpenAI's response form; no calls: the text."""
        if self.forced:
            try:
                value = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens: the text as it is
                return text, []
            pairs = [(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                     for c in (value if isinstance(value, list) else [value])]
            return None, [_call(i, name, args) for i, (name, args) in enumerate(pairs)]
        content, pairs = tool_calls.parse_calls(text, self.names)
        if not pairs:
            return text, []
        return content or None, [_call(i, name, args) for i, (name, args) in enumerate(pairs)]


def _call_schema(fn: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _call(index: int, name: str, arguments: str) -> dict:
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tools(f) -> Tools | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` taken from ``f`` (a ``_Fields``); None when there
    are no tools or ``tool_choice`` is ``none``."""
    tools = f.take("tools")
    choice = f.take("tool_choice")
    parallel = f.boolean("parallel_tool_calls", default=True)
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice", "'tool_choice' names a call but the request has no 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid("tools", f"'tools' must be a list of at most {MAX_TOOLS} function tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [fn["name"] for fn in functions]
    if len(set(names)) != len(names):
        raise invalid("tools", "two tools share a function name; give each its own")
    if choice in (None, "auto"):
        return Tools(functions, "auto", parallel)
    if choice == "none":
        return None
    if choice == "required":
        return Tools(functions, "required", parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        else None
    if not isinstance(name, str):
        raise invalid("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in names:
        raise invalid("tool_choice", f"'tool_choice' names the function {name!r}, which is not among 'tools'")
    return Tools(functions, name, parallel)


def _function(tool: Any, i: int) -> dict:
    param = f"tools[{i}]"
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise invalid(param, f"'{param}' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                      "\"parameters\": {...}}}}; only function tools are supported")
    if not isinstance(fn.get("parameters", {}), dict) or set(fn) - {"name", "description", "parameters", "strict"}:
        raise invalid(param, f"'{param}.function' takes 'name', 'description', 'parameters' (a JSON Schema object) "
                      "and 'strict'")
    return {k: v for k, v in fn.items() if k != "strict"}  # forced calls are always held to the schema

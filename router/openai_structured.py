"""Structured-output fields of an OpenAI request, as the pods' ``StructuredOutput``: OpenAI's
``response_format`` (``json_object``, ``json_schema``) and vLLM's names for the rest, sent by clients as
``extra_body``: ``guided_json``, ``guided_regex``, ``guided_grammar``, ``guided_choice`` and the newer
``structured_outputs`` object (``json``, ``regex``, ``grammar``, ``choice``, ``json_object``). At most one
constraint per request. Whether a schema's features are supported is the pod's grammar engine's to
say (INVALID_ARGUMENT, a 400 here, naming the feature). Pure."""

from __future__ import annotations

import json
from typing import Any

from lorafleet.v1 import generation_pb2 as g

from router.openai_errors import invalid

# guided_decoding_backend values that ask for nothing else than what the pods run (llguidance)
BACKENDS = ("auto", "guidance", "llguidance")


def structured_output(f) -> g.StructuredOutput | None:
    """The constraint among ``f``'s fields (a ``_Fields``), taken from it; None when there is none."""
    found: list[tuple[str, g.StructuredOutput]] = []
    response_format = f.take("response_format")
    if response_format is not None:
        so = _response_format(response_format)
        if so is not None:
            found.append(("response_format", so))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar"),
                       ("guided_choice", "choice")):
        value = f.take(name)
        if value is not None:
            found.append((name, _one(kind, value, name)))
    outputs = f.take("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict) or len(outputs) != 1:
            raise invalid("structured_outputs", "'structured_outputs' must be an object with exactly one of "
                          "'json', 'regex', 'grammar', 'choice', 'json_object'")
        (kind, value), = outputs.items()
        found.append(("structured_outputs", _one(kind, value, f"structured_outputs.{kind}")))
    backend = f.take("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise invalid("guided_decoding_backend", f"'guided_decoding_backend' {backend!r} is not available: the pods "
                      "run llguidance; leave it out")
    if len(found) > 1:
        raise invalid(found[1][0], f"'{found[0][0]}' and '{found[1][0]}' both constrain the output; send one")
    return found[0][1] if found else None


def _response_format(value: Any) -> g.StructuredOutput | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return g.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict) \
                or set(spec) - {"name", "schema", "strict", "description"}:
            raise invalid("response_format", "'response_format.json_schema' must be an object with 'name', "
                          "'schema' (a JSON Schema object), and optionally 'strict' and 'description'")
        if set(value) - {"type", "json_schema", "strict"}:
            raise invalid("response_format", f"unsupported key in 'response_format': {sorted(set(value))}")
        # strict or not, the output is held to the schema: the grammar engine cannot be less strict
        return g.StructuredOutput(json_schema=json.dumps(spec.get("schema", {})))
    raise invalid("response_format", "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")


def _one(kind: str, value: Any, param: str) -> g.StructuredOutput:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise invalid(param, f"'{param}' is not valid JSON ({e}); send a JSON Schema") from None
        if not isinstance(value, dict):
            raise invalid(param, f"'{param}' must be a JSON Schema object")
        return g.StructuredOutput(json_schema=json.dumps(value))
    if kind == "json_object" and value is True:
        return g.StructuredOutput(json_object=True)
    if kind in ("regex", "grammar") and isinstance(value, str) and value:
        return g.StructuredOutput(**{kind: value})
    if kind == "choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return g.StructuredOutput(choice=g.Choices(choices=value))
    expected = {"regex": "a non-empty string", "grammar": "a non-empty string (Lark or GBNF)",
                "choice": "a non-empty list of strings", "json_object": "true"}
    if kind not in expected:
        raise invalid(param, f"unknown structured output {kind!r}; use json, regex, grammar, choice or json_object")
    raise invalid(param, f"'{param}' must be {expected[kind]}")

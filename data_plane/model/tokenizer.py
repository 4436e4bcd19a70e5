"""Tokenizer (``tokenizer.json`` through the ``tokenizers`` library) and chat templates."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from conventions import tool_calls
from data_plane.errors import InvalidRequest, ModelLoadError


class Tokenizer:
    """Encodes prompts, decodes ids, and renders chat conversations with the model's template."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} not found: lorafleet needs a fast tokenizer file (tokenizer.json)")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token is not None
        self.eos_token_ids = self._eos_ids(model_dir)
        template = cfg.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        self._template = _compile_template(template) if isinstance(template, str) else None
        # A template that reads `tools` renders them (and calls) in its own format; others get them as text.
        self.template_has_tools = isinstance(template, str) and "tools" in template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos:
            bos = self._tok.token_to_id(self.bos_token)
            if not ids or ids[0] != bos:
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what the grammar engine reads its token table from)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The conversation as the model was trained to read it (its Jinja chat template). ``tools``
        (OpenAI's list) and assistant turns' ``tool_calls`` go to a template that renders tools; with
        any other template they are written as text (conventions/tool_calls.py)."""
        if self._template is None:
            raise InvalidRequest("this model has no chat template; send a raw prompt instead of messages")
        extra = {}
        if self.template_has_tools:
            extra = {"tools": tools} if tools else {}
        elif tools or any(m.get("tool_calls") for m in messages):
            messages = tool_calls.inline(messages, tools or [])
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"the chat template rejected the messages: {e}") from None

    def _eos_ids(self, model_dir: Path) -> tuple[int, ...]:
        ids: list[int] = []
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            value = json.loads(gen.read_text()).get("eos_token_id")
            ids += value if isinstance(value, list) else [value] if value is not None else []
        if self.eos_token is not None:
            eos = self._tok.token_to_id(self.eos_token)
            if eos is not None:
                ids.append(eos)
        return tuple(dict.fromkeys(ids))


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    # The same environment settings the templates are written for (trim/lstrip blocks, a
    # sandbox, raise_exception and strftime_now helpers).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the chat template does not parse: {e}") from None

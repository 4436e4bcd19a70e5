"""Structured output: a request's constraint compiled to a grammar, its matcher, and the step's token masks.

The grammar engine is llguidance (benchmarks/RESULTS.md, "Grammar engines", says why). A ``Constraint``
(JSON schema, any JSON object, regex, Lark or GBNF grammar, or a list of choices) is compiled once per
distinct constraint and kept in an LRU cache; each request gets its own copy of the compiled matcher
(``GrammarState``), which the engine's postprocess advances by each token the request generates (its
one writer, like the rest of a sequence's progress). ``TokenMasks.fill`` writes the next-token masks
of a step's constrained rows in parallel native threads without the GIL, into preallocated host
buffers: the model runner calls it after launching the forward, so on a GPU the masks are computed while
the device runs the step, and the sampler applies them on the device. A row's mask needs its matcher to
have consumed every earlier token: the engine's asynchronous loop launches a step with a constrained
sequence only once that sequence's last token is settled.

Mask layout (llguidance's): row r, bit ``j % 32`` of int32 word ``j // 32`` is 1 when token ``j`` may
come next. Rows that are not constrained are all ones.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import llguidance
import torch

from data_plane.errors import InvalidRequest

log = logging.getLogger("lorafleet.engine")

_MAX_SPEC_CHARS = 64 * 1024  # a schema or grammar larger than this is refused before compiling
# JSON is written on one line with ", " and ": " between items: free whitespace would let a small model
# spend its tokens on newlines and indentation. A schema's own "x-guidance" options override these.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"  # Lark, or GBNF (llama.cpp's EBNF), converted to Lark
    CHOICE = "choice"  # spec: a JSON list of strings


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    spec: str = ""  # the schema's JSON text, the regex, the grammar, or the choices as a JSON list

    def __post_init__(self) -> None:
        if len(self.spec) > _MAX_SPEC_CHARS:
            raise InvalidRequest(f"the {self.kind.value} is {len(self.spec)} characters; at most {_MAX_SPEC_CHARS}"
                                 " are accepted")
        if self.kind is not ConstraintKind.JSON_OBJECT and not self.spec:
            raise InvalidRequest(f"the {self.kind.value} constraint is empty; send one or leave it out")

    def grammar(self) -> str:
        """llguidance's grammar text for the constraint; InvalidRequest if it is not well-formed."""
        try:
            if self.kind is ConstraintKind.JSON_OBJECT:
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
            if self.kind is ConstraintKind.JSON_SCHEMA:
                schema = json.loads(self.spec)
                if not isinstance(schema, dict | bool):
                    raise InvalidRequest("the json_schema must be a JSON object")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, _JSON_OPTIONS)
            if self.kind is ConstraintKind.CHOICE:
                choices = json.loads(self.spec)
                if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                    raise InvalidRequest("choice must be a non-empty list of strings")
                return llguidance.grammar_from("choice", choices)
            return llguidance.grammar_from("regex" if self.kind is ConstraintKind.REGEX else "grammar", self.spec)
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"the {self.kind.value} is not valid: {e}") from None


class GrammarState:
    """One request's position in its grammar. ``advance`` is called once per generated token, in order."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def advance(self, token_id: int) -> bool:
        """Consumes ``token_id``; True when the output is complete (or can no longer be continued)."""
        if not self.matcher.consume_token(token_id):
            log.warning("a constrained request's token was refused by its grammar: %s", self.matcher.get_error())
            return True
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles constraints for one tokenizer, keeping the last ``cache_size`` distinct ones. The tokenizer's
    token table (a few hundred milliseconds to build) is built at the first constrained request;
    ``observe`` gets each compile's duration in seconds."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: tuple[int, ...],
                 observe: Callable[[float], None] = lambda s: None, cache_size: int = 256) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json, self._eos_ids = tokenizer_json, list(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._observe = observe
        self._lock = threading.Lock()  # compiles run on worker threads

    def _tokens(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                         eos_token=self._eos_ids or None)
            return self._tokenizer

    def state(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher for ``constraint``, from the cache or compiled now (off the event loop: it may take
        milliseconds). InvalidRequest names what the engine does not implement or cannot parse."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                return GrammarState(compiled.deep_copy())
        grammar, tokens = constraint.grammar(), self._tokens()
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokens, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the {constraint.kind.value} is not supported: {matcher.get_error()}; "
                                 "rewrite it without that feature")
        self._observe(time.perf_counter() - start)
        with self._lock:
            self._cache[constraint] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return GrammarState(matcher.deep_copy())


class TokenMasks:
    """The step's next-token masks: two preallocated host buffers (pinned on CUDA) of ``max_rows`` rows, used
    in turn, so a step fills one while the copy of the step before it may still be queued on the device."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32
        self.device = device
        on_cuda = device.type == "cuda"
        self._hosts = [torch.full((max_rows, self.words), -1, dtype=torch.int32, pin_memory=on_cuda)
                       for _ in range(2)]  # [max_rows, words] each
        self._copied = [torch.cuda.Event() if on_cuda else None for _ in range(2)]  # each buffer's last copy has run
        self._turn = 0
        self._executor = llguidance.LLExecutor(num_threads=2)

    def fill(self, rows: tuple[tuple[GrammarState, int], ...], num_rows: int) -> torch.Tensor:
        """[num_rows, words] int32 on the device: each listed row's mask, the others all ones. The copy is
        asynchronous; the buffer is rewritten two fills later, once that copy has run."""
        self._turn ^= 1
        copied = self._copied[self._turn]
        if copied is not None:  # the copy two steps back: long done unless the device is two steps behind
            copied.synchronize()
        host = self._hosts[self._turn][:num_rows]
        host.fill_(-1)
        if rows:
            self._executor.unsafe_compute_mask_ptr([(s.matcher, r) for s, r in rows], host.data_ptr(), self.words * 4,
                                                   num_rows)
        out = host.to(self.device, non_blocking=True)
        if copied is not None:
            copied.record()
        return out

"""Compares the grammar engines on PyPI for lorafleet's structured output, on the demo model's tokenizer.

For each of llguidance, xgrammar and outlines-core that imports: the time to prepare the tokenizer,
to compile one nested JSON schema, and to compute the next-token mask at each token of a valid
output (median and max over the tokens), whether the output is accepted to the end, and which
schema features compile. Only llguidance is a lorafleet dependency; the others are installed for
the comparison into a scratch folder, without their dependencies (xgrammar wants transformers):

    pip install --no-deps --target /tmp/engines xgrammar apache-tvm-ffi outlines-core llguidance
    PYTHONPATH=$PWD:/tmp/engines python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import json
import statistics
import time

from data_plane.model.demo_model import ensure_demo_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "color", "address"], "additionalProperties": False,
}
OUTPUT = '{"name": "Bob", "age": 42, "tags": ["a", "b"], "color": "red", "address": {"city": "Paris", "zip": "75001"}}'
FEATURES = {  # schema keywords to probe: does the engine compile, refuse by name, or accept silently?
    "format": {"type": "string", "format": "email"},
    "patternProperties": {"type": "object", "patternProperties": {"^a": {"type": "string"}}},
    "recursive $ref": {"$ref": "#/$defs/a",
                       "$defs": {"a": {"type": "object", "properties": {"n": {"$ref": "#/$defs/a"}}}}},
    "oneOf": {"type": "object", "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}},
    "not": {"not": {"type": "string"}},
    "if/then": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
}
EOS = 2


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _report(name: str, init_s: float, compile_s: float, mask_s: list[float], accepted: bool, features: dict) -> None:
    print(f"{name}: tokenizer {init_s * 1e3:.0f} ms, compile {compile_s * 1e3:.2f} ms, mask median "
          f"{statistics.median(mask_s) * 1e6:.1f} us max {max(mask_s) * 1e6:.0f} us, output accepted: {accepted}")
    for feature, outcome in features.items():
        print(f"    {feature}: {outcome}")


def llguidance_engine(tokenizer_json: str, ids: list[int], vocab: int) -> None:
    import llguidance
    import llguidance.numpy

    tok, init_s = _timed(lambda: llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=EOS))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher, compile_s = _timed(lambda: llguidance.LLMatcher(tok, grammar))
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        _, s = _timed(lambda: llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0))
        times.append(s)
        matcher.consume_token(t)
    features = {}
    for feature, schema in FEATURES.items():
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        features[feature] = f"refused: {m.get_error()}" if m.is_error() else "compiles"
    _report("llguidance", init_s, compile_s, times, matcher.is_accepting() and not matcher.is_error(), features)


def xgrammar_engine(tokenizer_json: str, ids: list[int], vocab: int) -> None:
    import xgrammar as xgr

    def info():
        return xgr.TokenizerInfo(_token_bytes(tokenizer_json, vocab), xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,
                                 stop_token_ids=[EOS])
    compiler, init_s = _timed(lambda: xgr.GrammarCompiler(info(), max_threads=1))
    compiled, compile_s = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher, mask, times = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab), []
    for t in ids:
        _, s = _timed(lambda: matcher.fill_next_token_bitmask(mask, 0))
        times.append(s)
        matcher.accept_token(t)
    features = {}
    for feature, schema in FEATURES.items():
        try:
            compiler.compile_json_schema(json.dumps(schema))
            features[feature] = "compiles"
        except Exception as e:  # noqa: BLE001 - any refusal is the finding
            features[feature] = f"refused: {str(e)[:100]}"
    _report("xgrammar", init_s, compile_s, times, matcher.accept_token(EOS), features)


def outlines_core_engine(tokenizer_json: str, ids: list[int], vocab: int) -> None:
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary():
        tokens: dict[bytes, list[int]] = {}
        for i, b in enumerate(_token_bytes(tokenizer_json, vocab)):
            if i != EOS and b:
                tokens.setdefault(b, []).append(i)
        return Vocabulary(EOS, tokens)
    voc, init_s = _timed(vocabulary)
    index, compile_s = _timed(lambda: Index(build_regex_from_schema(json.dumps(SCHEMA)), voc))
    state, times = index.get_initial_state(), []
    for t in ids:
        _, s = _timed(lambda st=state: index.get_allowed_tokens(st))
        times.append(s)
        state = index.get_next_state(state, t)
    features = {}
    for feature, schema in FEATURES.items():
        try:
            Index(build_regex_from_schema(json.dumps(schema)), voc)
            features[feature] = "compiles"
        except Exception as e:  # noqa: BLE001 - any refusal is the finding
            features[feature] = f"refused: {str(e)[:100]}"
    _report("outlines-core", init_s, compile_s, times, state is not None and index.is_final_state(state), features)


def _token_bytes(tokenizer_json: str, vocab: int) -> list[bytes]:
    """Each id's bytes under the byte-level BPE's printable-character alphabet."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    to_byte, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            to_byte[chr(256 + extra)] = b
            extra += 1
    model = json.loads(tokenizer_json)
    out = [b""] * vocab
    for token, i in model["model"]["vocab"].items():
        out[i] = bytes(to_byte[c] for c in token) if all(c in to_byte for c in token) else token.encode()
    for added in model.get("added_tokens", []):
        out[added["id"]] = added["content"].encode()
    return out


def main() -> None:
    from tokenizers import Tokenizer

    tokenizer_json = (ensure_demo_model(quiet=True) / "tokenizer.json").read_text()
    tok = Tokenizer.from_str(tokenizer_json)
    ids, vocab = tok.encode(OUTPUT).ids, tok.get_vocab_size(with_added_tokens=True)
    print(f"schema of {len(json.dumps(SCHEMA))} characters; output of {len(ids)} tokens; vocabulary {vocab}")
    for engine in (llguidance_engine, xgrammar_engine, outlines_core_engine):
        try:
            engine(tokenizer_json, ids, vocab)
        except ImportError as e:
            print(f"{engine.__name__}: not installed ({e})")


if __name__ == "__main__":
    main()

"""Structured output and logit_bias in the sampler: a grammar's mask and a request's biases decide the
choice, the logprobs stay the model's own, a row's tokens do not depend on its batch, and nothing
waits on the device; constraints compile once per distinct constraint, and what the grammar engine
does not implement is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from data_plane.engine.grammar import Constraint, ConstraintKind, GrammarCompiler, TokenMasks
from data_plane.engine.sampler import SamplingBatch, _gumbel, sample
from data_plane.errors import InvalidRequest
from tests.data_plane.test_sampler import NoHostSync, sequence

VOCAB = 100


def packed(allowed: list[set[int]], vocab: int = VOCAB) -> torch.Tensor:
    """[rows, words] int32 masks allowing each row's ids (llguidance's layout: bit j % 32 of word j // 32)."""
    words = (vocab + 31) // 32
    out = torch.zeros(len(allowed), words, dtype=torch.int64)
    for r, ids in enumerate(allowed):
        for j in ids:
            out[r, j // 32] |= 1 << (j % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def test_a_masked_row_chooses_only_allowed_tokens_greedy_and_drawn_and_keeps_the_models_logprobs():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=gen) * 4  # [rows, vocab]
    allowed = [{3, 40, 77}, set(range(VOCAB)), {99}, {0, 31, 32, 63, 64}]  # word edges included
    for params in (dict(), dict(temperature=1.5, seed=4, logprobs=2)):
        seqs = [sequence(str(r), **params) for r in range(4)]
        for _ in range(30):  # many positions: each draws anew
            out = sample(logits, SamplingBatch.build(seqs, "cpu"), packed(allowed)).to_host()
            free = sample(logits, SamplingBatch.build(seqs, "cpu")).to_host()
            for r, tok in enumerate(out):
                assert tok.id in allowed[r]
                assert tok.logprob == pytest.approx(torch.log_softmax(logits[r], -1)[tok.id].item(), abs=1e-6)
                assert tok.top == free[r].top  # alternatives are the model's, whatever the mask
            for seq in seqs:
                seq.output_ids.append(0)
    greedy = sample(logits, SamplingBatch.build([sequence(str(r)) for r in range(4)], "cpu"), packed(allowed))
    expected = [max(ids, key=lambda j: logits[r, j].item()) for r, ids in enumerate(allowed)]
    assert greedy.ids.tolist() == expected


def test_draw_noise_is_never_infinite_so_a_masked_or_truncated_token_never_wins():
    # seed 330 at position 5 hits the top cell of the uniform grid at id 47665 (found by search): float32
    # rounded it to 1.0, and its noise to +inf, which won any draw and beside -inf made NaN.
    assert torch.isfinite(_gumbel(torch.tensor([330]), torch.tensor([5]), 49152)).all()
    seq = sequence(temperature=1.0, seed=330, top_k=1)
    seq.output_ids += [0, 0]  # the token at position 5
    logits = torch.zeros(1, 49152)
    logits[0, 7] = 1.0
    assert sample(logits, SamplingBatch.build([seq], "cpu"), packed([{7, 8}], 49152)).ids.tolist() == [7]
    assert sample(logits, SamplingBatch.build([seq], "cpu")).ids.tolist() == [7]  # top_k 1: the top token only


def test_logit_bias_forces_and_bans_tokens_and_the_logprobs_stay_the_models():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))  # [rows, vocab]
    top = logits.argmax(-1).tolist()
    seqs = [sequence("force", logit_bias=((17, 100.0),)),
            sequence("ban", logit_bias=((top[1], -100.0),), temperature=0.5, seed=1),
            sequence("none")]
    out = sample(logits, SamplingBatch.build(seqs, "cpu")).to_host()
    assert out[0].id == 17 and out[1].id != top[1] and out[2].id == top[2]
    assert out[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[17].item(), abs=1e-6)


def test_a_constrained_seeded_row_draws_the_same_tokens_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, VOCAB, generator=gen) * 3  # [steps, vocab]
    mask = {1, 5, 9, 33, 70, 71}
    params = dict(temperature=1.0, top_p=0.9, seed=11, logit_bias=((9, 2.0), (70, -1.0)))
    alone = sequence("alone", **params)
    solo = []
    for i in range(12):
        solo.append(sample(logits[i : i + 1], SamplingBatch.build([alone], "cpu"), packed([mask])).to_host()[0])
        alone.output_ids.append(solo[-1].id)
    shared, together = sequence("shared", **params), []
    for i in range(12):
        others = [sequence("g"), sequence("b", temperature=0.7, seed=2, logit_bias=((4, 50.0),))]
        row = i % 3
        seqs = others[:row] + [shared] + others[row:]
        batch_logits = torch.randn(3, VOCAB, generator=gen) * 3
        batch_logits[row] = logits[i]
        masks = [set(range(VOCAB))] * 3
        masks[row] = mask
        together.append(sample(batch_logits, SamplingBatch.build(seqs, "cpu"), packed(masks)).to_host()[row])
        shared.output_ids.append(together[-1].id)
    assert together == solo


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_masks_and_biases_never_synchronise_with_the_host(device):
    seqs = [sequence("g", logit_bias=((3, 5.0),)), sequence("d", temperature=0.9, seed=1, top_p=0.8),
            sequence("k", temperature=1.0, top_k=5, logit_bias=((1, -3.0), (7, 1.0)))]
    logits = torch.randn(3, 300).to(device)
    batch = SamplingBatch.build(seqs, device)
    masks = packed([{1, 2}, {5}, set(range(300))], 300).to(device)
    with NoHostSync():
        sampled = sample(logits, batch, masks)
    assert sampled.ids.shape == (3,)


def test_logit_bias_out_of_range_is_refused():
    with pytest.raises(InvalidRequest, match=r"within \[-100, 100\]"):
        sequence(logit_bias=((1, 101.0),))


@pytest.fixture(scope="module")
def compiler(demo_tokenizer):
    compiles = []
    c = GrammarCompiler(demo_tokenizer.to_json, demo_tokenizer.vocab_size, demo_tokenizer.eos_token_ids,
                        compiles.append)
    c.compiles = compiles
    return c


def test_a_schema_compiles_once_and_each_request_gets_its_own_matcher(compiler, demo_tokenizer):
    schema = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}))
    before = len(compiler.compiles)
    first, second = compiler.state(schema), compiler.state(schema)
    assert len(compiler.compiles) == before + 1
    ids = demo_tokenizer.encode('{"n": 42}')
    assert not any(first.advance(t) for t in ids[:-1]) and first.advance(ids[-1])  # complete on the last token
    assert not second.advance(ids[0])  # untouched by the first request's progress


def test_token_masks_allow_what_the_grammar_allows_and_leave_other_rows_free(compiler, demo_tokenizer):
    state = compiler.state(Constraint(ConstraintKind.CHOICE, json.dumps(["yes", "no"])))
    masks = TokenMasks(4, demo_tokenizer.vocab_size, torch.device("cpu"))
    bits = masks.fill(((state, 1),), 3)
    assert (bits[0] == -1).all() and (bits[2] == -1).all()
    row = bits[1].to(torch.int64) & 0xFFFFFFFF
    allowed = {w * 32 + b for w in range(row.shape[0]) for b in range(32) if row[w] >> b & 1}
    texts = {demo_tokenizer.decode([t]) for t in allowed}
    assert {"yes", "no"} <= texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)


@pytest.mark.parametrize(("kind", "spec", "words"), [
    (ConstraintKind.JSON_SCHEMA, json.dumps({"not": {"type": "string"}}), '"not"'),
    (ConstraintKind.JSON_SCHEMA, json.dumps({"type": "object", "if": {}, "then": {}}), '"if"'),
    (ConstraintKind.JSON_SCHEMA, "{not json", "not valid"),
    (ConstraintKind.REGEX, "[a-", "not supported"),
    (ConstraintKind.GRAMMAR, "start: undefined_rule", "undefined_rule"),
    (ConstraintKind.CHOICE, "[]", "non-empty list"),
])
def test_what_the_grammar_engine_cannot_honour_is_refused_by_name(compiler, kind, spec, words):
    with pytest.raises(InvalidRequest, match=words.replace("[", r"\[")):
        compiler.state(Constraint(kind, spec))


@pytest.mark.parametrize("grammar", ['start: "yes" | "no"', 'root ::= "yes" | "no"'])  # Lark, GBNF (EBNF)
def test_a_lark_or_gbnf_grammar_constrains_the_output_to_its_sentences(compiler, demo_tokenizer, grammar):
    state = compiler.state(Constraint(ConstraintKind.GRAMMAR, grammar))
    ids = demo_tokenizer.encode("no")
    assert [state.advance(t) for t in ids][-1]  # complete after "no"
    refused = compiler.state(Constraint(ConstraintKind.GRAMMAR, grammar))
    assert refused.advance(demo_tokenizer.encode("maybe")[0])  # refused: the request ends, nothing follows
    assert refused.matcher.is_error()

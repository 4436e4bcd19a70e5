"""Choosing each request's next token from its row of logits: greedy at temperature 0, otherwise a
draw from its own seeded generator after temperature, top-k and top-p; logprobs always of the
model's own distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from data_plane.engine.sampler import sample
from data_plane.engine.sequence import SamplingParams, Sequence


def sequence(name: str = "r", **params) -> Sequence:
    return Sequence(name, None, [1, 2, 3], SamplingParams(**params), 64)


def draws(logits: list[float], seq: Sequence, n: int) -> list[int]:
    """``n`` successive tokens for ``seq`` from the same row of logits, as over ``n`` decode steps."""
    row = torch.tensor([logits])  # [1, vocab]
    return [sample(row, [seq])[0].id for _ in range(n)]


def log_probs(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_greedy_rows_take_the_highest_logit():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])  # [2, vocab]
    out = sample(logits, [sequence("a"), sequence("b", seed=5, top_k=2)])  # at temperature 0 these do not matter
    assert [t.id for t in out] == [1, 0]


def test_greedy_and_sampled_rows_in_one_batch_each_get_their_own_rule():
    logits = torch.tensor([[0.0, 2.0, 0.0]] * 2)  # [2, vocab]
    greedy, sampled = sequence("greedy"), sequence("sampled", temperature=5.0, seed=0)
    outs = [sample(logits, [greedy, sampled]) for _ in range(100)]
    assert {g.id for g, _ in outs} == {1}
    assert {s.id for _, s in outs} == {0, 1, 2}


def test_top_k_draws_only_among_the_k_highest_logits():
    seq = sequence(temperature=1.0, top_k=2, seed=0)
    counts = Counter(draws([4.0, 3.0, 2.0, 1.0, 0.0], seq, 300))
    assert set(counts) == {0, 1}


def test_top_k_larger_than_the_vocabulary_keeps_every_token():
    counts = Counter(draws([0.0, 0.0, 0.0], sequence(temperature=1.0, top_k=50, seed=0), 300))
    assert set(counts) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_of_tokens_whose_probability_reaches_p():
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    # 0.5 < 0.7, and the token that crosses it (0.5 + 0.3) is kept
    assert set(draws(logits, sequence(temperature=1.0, top_p=0.7, seed=0), 300)) == {0, 1}
    assert set(draws(logits, sequence(temperature=1.0, top_p=0.9, seed=0), 300)) == {0, 1, 2}
    # the most likely token alone already reaches 0.45
    assert set(draws(logits, sequence(temperature=1.0, top_p=0.45, seed=0), 50)) == {0}


@pytest.mark.parametrize("top_p", [0.0, 1.0])
def test_top_p_of_0_or_1_keeps_every_token(top_p):
    logits = log_probs([0.4, 0.3, 0.2, 0.1])
    assert set(draws(logits, sequence(temperature=1.0, top_p=top_p, seed=0), 300)) == {0, 1, 2, 3}


def test_a_low_temperature_sharpens_the_draws_and_a_high_one_spreads_them():
    logits = [2.0, 1.0, 0.0]
    assert set(draws(logits, sequence(temperature=0.05, seed=0), 300)) == {0}
    spread = Counter(draws(logits, sequence(temperature=10.0, seed=0), 300))
    assert min(spread[t] for t in range(3)) >= 60  # near uniform: about 110, 100 and 90 of 300


def test_the_same_seed_draws_the_same_tokens():
    flat = [0.0] * 50
    first, second = sequence("first", temperature=1.0, seed=1234), sequence("second", temperature=1.0, seed=1234)
    assert draws(flat, first, 20) == draws(flat, second, 20)


def test_different_seeds_draw_different_tokens():
    flat = [0.0] * 50
    assert draws(flat, sequence(temperature=1.0, seed=1), 20) != draws(flat, sequence(temperature=1.0, seed=2), 20)


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch():
    flat = [0.0] * 50
    alone = draws(flat, sequence(temperature=1.0, seed=7), 20)
    seeded = sequence("seeded", temperature=1.0, seed=7)
    others = [sequence("other-seed", temperature=1.0, seed=99), sequence("greedy")]
    logits = torch.zeros(3, 50)  # [3, vocab]
    batched = [sample(logits, [others[0], seeded, others[1]])[1].id for _ in range(20)]
    assert batched == alone


def test_logprobs_are_of_the_model_distribution_before_temperature_and_truncation():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])  # [1, vocab]
    expected = torch.log_softmax(logits[0], dim=-1).tolist()
    (out,) = sample(logits, [sequence(temperature=0.5, top_k=2, seed=0, logprobs=3)])
    assert out.logprob == pytest.approx(expected[out.id], abs=1e-6)
    assert [t for t, _ in out.top] == [0, 1, 2]  # most likely first, including a token top_k left out
    assert [lp for _, lp in out.top] == pytest.approx(expected[:3], abs=1e-6)


def test_each_row_gets_as_many_top_alternatives_as_it_asked_for():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]] * 3)  # [3, vocab]
    out = sample(logits, [sequence("none"), sequence("one", logprobs=1), sequence("three", logprobs=3)])
    assert [len(t.top) for t in out] == [0, 1, 3]
    assert out[0].logprob == pytest.approx(out[2].top[0][1], abs=1e-6)  # the chosen token's logprob all the same

"""Choosing the next token of every row of a step at once: greedy at temperature 0, otherwise a
counter-based draw (a function of the request's seed and the token's position only) after
temperature, top-k and top-p; logprobs always of the model's own distribution; no host sync."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from data_plane.engine.sampler import SamplingBatch, _nucleus, sample
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.errors import InvalidRequest
from tests.tolerances import eps, sum_atol

ALPHA = 1e-3  # significance of each chi-square test (the draws are fixed by their seeds: it passes or not, always)
DRAWS = 20_000
LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]


def sequence(name: str = "r", **params) -> Sequence:
    return Sequence(name, None, [1, 2, 3], SamplingParams(**params), 10_000)


def step(logits: torch.Tensor, seqs: list[Sequence]) -> list:
    """One step's tokens for ``seqs``, one row of ``logits`` each; each sequence then holds its token."""
    out = sample(logits, SamplingBatch.build(seqs, logits.device)).to_host()
    for seq, tok in zip(seqs, out, strict=True):
        seq.output_ids.append(tok.id)
    return out


def ids_over_steps(logits: list[float], seq: Sequence, n: int) -> list[int]:
    return [step(torch.tensor([logits]), [seq])[0].id for _ in range(n)]


def draw_with_seeds(logits: list[float], n: int = DRAWS, **params) -> list[int]:
    """One draw from each of ``n`` requests with seeds 0..n-1, all on the same logits, in one step."""
    seqs = [sequence(str(s), seed=s, **params) for s in range(n)]
    return [t.id for t in step(torch.tensor([logits] * n), seqs)]


def expected_probs(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The distribution the sampler promises, in float64 from its definition."""
    scaled = [x / temperature for x in logits]
    keep = list(range(len(logits)))
    if 0 < top_k < len(logits):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        keep = [i for i in keep if scaled[i] >= kth]
    norm = sum(math.exp(scaled[i]) for i in keep)
    probs = [math.exp(scaled[i]) / norm if i in keep else 0.0 for i in range(len(logits))]
    if 0.0 < top_p < 1.0:
        mass, nucleus = 0.0, []
        for i in sorted(keep, key=lambda i: -probs[i]):  # stable: ties keep the lower id first
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += probs[i]
        probs = [probs[i] / mass if i in nucleus else 0.0 for i in range(len(logits))]
    return probs


def chi_square_p_value(ids: list[int], probs: list[float]) -> float:
    """The p-value of the counts of ``ids`` under ``probs``; draws of a zero-probability id fail at once."""
    counts = torch.bincount(torch.tensor(ids), minlength=len(probs)).double()
    assert all(counts[i] == 0 for i, p in enumerate(probs) if p == 0.0), "drew a token the rule excludes"
    support = [i for i, p in enumerate(probs) if p > 0.0]
    expected = torch.tensor([probs[i] for i in support], dtype=torch.float64) * len(ids)
    assert expected.min() >= 5, "too few draws for the chi-square approximation"
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = len(support) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("params", [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.3, top_k=5, top_p=0.7),
], ids=["temperature", "top_k", "top_p", "top_k_and_top_p"])
def test_draws_over_many_seeds_follow_the_exact_distribution(params):
    assert chi_square_p_value(draw_with_seeds(LOGITS, **params), expected_probs(LOGITS, **params)) > ALPHA


def test_draws_over_many_positions_of_one_request_follow_the_exact_distribution():
    seqs = [sequence(str(i), temperature=0.9, top_p=0.9, seed=42) for i in range(DRAWS)]
    batch = SamplingBatch.build(seqs, "cpu")
    batch = dataclasses.replace(batch, counter=torch.arange(DRAWS))  # positions 0..n-1 of the same seed
    ids = sample(torch.tensor([LOGITS] * DRAWS), batch).ids.tolist()
    assert chi_square_p_value(ids, expected_probs(LOGITS, 0.9, top_p=0.9)) > ALPHA


def test_the_chi_square_check_rejects_draws_at_another_temperature():
    assert chi_square_p_value(draw_with_seeds(LOGITS, temperature=0.7), expected_probs(LOGITS, 0.8)) < ALPHA


def test_greedy_rows_take_the_highest_logit_and_ties_go_to_the_lowest_id():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [3.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # [3, vocab]
    seqs = [sequence("a"), sequence("b", seed=5, top_k=2), sequence("c", top_p=0.1)]  # temperature 0: greedy
    assert [t.id for t in step(logits, seqs)] == [1, 0, 0]


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-40, top_p=0.9)],
                         ids=["top_k_1", "tiny_top_p", "vanishing_temperature"])
def test_draws_that_can_only_keep_the_most_likely_token_are_greedy(params):
    logits = torch.randn(500, 64, generator=torch.Generator().manual_seed(0))  # [rows, vocab]
    seqs = [sequence(str(s), **{"temperature": 2.0, **params}, seed=s) for s in range(500)]
    assert [t.id for t in step(logits, seqs)] == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_the_prefix_of_the_sorted_distribution_that_reaches_p_on_rows_of_every_shape():
    gen = torch.Generator().manual_seed(6)
    vocab = 3000
    logits = torch.cat([
        torch.randn(8, vocab, generator=gen) * 4,  # peaked
        torch.randn(8, vocab, generator=gen) * 0.05,  # nearly flat
        (torch.randn(8, vocab, generator=gen) * 2).round(),  # many tokens tied at each probability
        torch.randn(8, vocab, generator=gen).masked_fill(torch.rand(8, vocab, generator=gen) < 0.9, float("-inf")),
        torch.zeros(2, vocab),  # uniform
    ])  # [rows, vocab]
    top_p = torch.rand(len(logits), generator=gen, dtype=torch.float64)  # [rows]
    top_p[:3] = torch.tensor([1e-13, 0.999999, 0.5])  # below the mass unit of 2**-40, near 1, a half
    probs = logits.softmax(dim=-1)
    kept = _nucleus(probs, top_p)
    for row, (p, cut) in enumerate(zip(probs.double().tolist(), top_p.tolist(), strict=True)):
        mass, nucleus = 0.0, set()
        for i in sorted(range(vocab), key=lambda i: (-p[i], i)):
            if mass >= cut:
                break
            nucleus.add(i)
            mass += p[i]
        assert set(kept[row].nonzero()[:, 0].tolist()) == nucleus, f"row {row}"
    # mass that never reaches top_p (rounding, with top_p a hair below 1) keeps every token that has mass
    short = torch.tensor([[0.25, 0.0, 0.25, 0.25, 0.0]])  # [1, vocab]
    assert _nucleus(short, torch.tensor([0.9], dtype=torch.float64)).tolist() == [[True, False, True, True, False]]


def test_top_k_keeps_every_token_tied_with_the_kth():
    ids = draw_with_seeds([3.0, 2.0, 2.0, 2.0, 0.0], 2000, temperature=1.0, top_k=2)
    assert set(ids) == {0, 1, 2, 3}


@pytest.mark.parametrize("off", [dict(top_k=64), dict(top_k=1000), dict(top_p=1.0), dict(top_p=0.0),
                                 dict(top_k=64, top_p=1.0)])
def test_top_k_of_the_vocabulary_or_more_and_top_p_of_0_or_1_change_no_draw(off):
    logits = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))  # [rows, vocab]
    plain = [sequence(str(s), temperature=1.1, seed=s) for s in range(300)]
    same = [sequence(str(s), temperature=1.1, seed=s, **off) for s in range(300)]
    assert [t.id for t in step(logits, same)] == [t.id for t in step(logits, plain)]


def test_the_same_seed_draws_the_same_tokens_and_another_seed_other_ones():
    flat = [0.0] * 1000
    first = ids_over_steps(flat, sequence("first", temperature=1.0, seed=1234), 20)
    assert ids_over_steps(flat, sequence("second", temperature=1.0, seed=1234), 20) == first
    assert ids_over_steps(flat, sequence("third", temperature=1.0, seed=1235), 20) != first


def test_each_position_of_a_request_draws_anew():
    ids = ids_over_steps([0.0] * 1000, sequence(temperature=1.0, seed=9), 20)
    assert len(set(ids)) >= 18  # 20 uniform draws from 1000 tokens: a repeat has probability 0.17


def test_requests_without_a_seed_draw_differently_and_a_recomputation_draws_the_same():
    flat = torch.zeros(1, 1000)  # [1, vocab]
    a, b = sequence("a", temperature=1.0), sequence("b", temperature=1.0)
    assert a.sampling_seed != b.sampling_seed
    assert ids_over_steps([0.0] * 1000, a, 10) != ids_over_steps([0.0] * 1000, b, 10)
    # a preempted request recomputes the same position with the same seed: the same token
    again = sample(flat, SamplingBatch.build([a], "cpu")).to_host()[0].id
    assert sample(flat, SamplingBatch.build([a], "cpu")).to_host()[0].id == again


def test_a_seeded_request_draws_the_same_tokens_and_logprobs_at_any_row_of_any_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(20, 1000, generator=gen) * 3  # [steps, vocab]: the request's row at each step
    params = dict(temperature=0.8, top_k=50, top_p=0.9, seed=7, logprobs=3)
    alone = sequence("alone", **params)
    solo = [step(logits[i : i + 1], [alone])[0] for i in range(20)]
    shared = sequence("shared", **params)
    together = []
    for i in range(20):
        others = [sequence("greedy"), sequence("other-seed", temperature=1.5, top_p=0.5, seed=99, logprobs=5),
                  sequence("unseeded", temperature=1.0, top_k=3), sequence("greedy-2", logprobs=1)]
        row = i % (len(others) + 1)
        seqs = others[:row] + [shared] + others[row:]
        batch_logits = torch.randn(len(seqs), 1000, generator=gen) * 3  # [rows, vocab]
        batch_logits[row] = logits[i]
        together.append(step(batch_logits, seqs)[row])
    assert together == solo


def test_logprobs_of_a_row_are_the_same_bits_alone_and_in_a_batch_at_a_real_vocabulary_size():
    # At a real vocabulary a lone row's sum over it is split across threads, where a batch's rows are
    # summed one per thread: a plain sum would give the row other bits in a batch than alone.
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 65536, generator=gen) * 4  # [rows, vocab]
    seqs = [sequence(f"r{i}", logprobs=3, **({"temperature": 0.7, "seed": i} if i % 2 else {})) for i in range(8)]
    together = sample(logits, SamplingBatch.build(seqs, "cpu")).to_host()
    alone = [sample(logits[i : i + 1], SamplingBatch.build([seq], "cpu")).to_host()[0] for i, seq in enumerate(seqs)]
    assert together == alone


def test_logprobs_are_of_the_model_distribution_before_temperature_and_truncation():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(4)) * 4  # [rows, vocab]
    seqs = [sequence("none"), sequence("one", logprobs=1),
            sequence("five", temperature=0.5, top_k=2, seed=0, logprobs=5),
            sequence("twenty", temperature=1.0, top_p=0.3, seed=1, logprobs=20),
            sequence("zero", temperature=2.0), sequence("three", temperature=1.0, seed=2, logprobs=3)]
    out = step(logits, seqs)
    expected = torch.log_softmax(logits.double(), dim=-1)  # [rows, vocab]
    # log_softmax's sum of exp over the vocabulary, rounded in another order, and the logit minus max
    atol = sum_atol(500, 1.0) + 4 * eps(torch.float32) * float(logits.abs().max())
    assert [len(t.top) for t in out] == [0, 1, 5, 20, 0, 3]
    for row, tok in enumerate(out):
        assert tok.logprob == pytest.approx(float(expected[row, tok.id]), abs=atol)
        best = expected[row].topk(len(tok.top))
        assert [i for i, _ in tok.top] == best.indices.tolist()  # most likely first, even those top-k left out
        assert [lp for _, lp in tok.top] == pytest.approx(best.values.tolist(), abs=atol)


def test_token_ids_beyond_float32_precision_come_back_exactly():
    logits = torch.zeros(1, 2**24 + 2)  # [1, vocab]: 2**24 + 1 is the first integer float32 cannot hold
    logits[0, 2**24 + 1] = 1.0
    assert step(logits, [sequence()])[0].id == 2**24 + 1


def test_sample_refuses_logits_that_do_not_match_its_batch():
    batch = SamplingBatch.build([sequence()], "cpu")
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(2, 8), batch)
    with pytest.raises(TypeError, match="float32"):
        sample(torch.zeros(1, 8, dtype=torch.bfloat16), batch)


def test_a_seed_outside_64_bits_is_refused():
    with pytest.raises(InvalidRequest, match="seed"):
        SamplingParams(temperature=1.0, seed=2**64)
    assert sequence(temperature=1.0, seed=2**64 - 1).sampling_seed == 2**64 - 1


class HostSync(Exception):
    pass


class NoHostSync(TorchDispatchMode):
    """Raises on every op that reads a value on the host, has a shape that depends on values, or copies
    between devices."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.item, torch.ops.aten.nonzero,
                                   torch.ops.aten.masked_select, torch.ops.aten.unique_consecutive,
                                   torch.ops.aten._unique2):
            raise HostSync(f"{func} synchronises with the host")
        if func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_) and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            raise HostSync("indexing with a boolean mask has a shape that depends on values")
        out = func(*args, **kwargs)
        devices = {t.device for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
        if len(devices) > 1:
            raise HostSync(f"{func} copies between {sorted(map(str, devices))}")
        return out


def test_the_host_sync_guard_catches_item_masks_and_copies():
    x = torch.ones(3)
    for op in (lambda: x.sum().item(), lambda: x[x > 0], lambda: x.__setitem__(x > 0, 0.0), lambda: x.nonzero(),
               lambda: x.to("meta")):
        with pytest.raises(HostSync), NoHostSync():
            op()


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta tensors hold no values: reading one fails
def test_sample_never_synchronises_with_the_host(device):
    seqs = [sequence("greedy", logprobs=2), sequence("plain", temperature=0.9, seed=1),
            sequence("top-k", temperature=1.0, top_k=5, logprobs=4), sequence("top-p", temperature=1.2, top_p=0.8),
            sequence("both", temperature=0.7, top_k=9, top_p=0.5, seed=3, logprobs=1)]
    logits = torch.randn(len(seqs), 300).to(device)  # [rows, vocab]
    batch = SamplingBatch.build(seqs, device)
    with NoHostSync():
        sampled = sample(logits, batch)
    assert sampled.ids.device.type == device and sampled.top_ids.shape == (len(seqs), 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draws_on_cuda_match_draws_on_cpu():
    logits = torch.randn(64, 2000, generator=torch.Generator().manual_seed(5)) * 3  # [rows, vocab]
    seqs = [sequence(str(s), temperature=0.3 + s % 5 * 0.3, top_k=s % 3 * 20, top_p=(0.5, 0.9, 1.0)[s % 3],
                     seed=s * 2**40 + s, logprobs=s % 4) for s in range(64)]
    cpu = sample(logits, SamplingBatch.build(seqs, "cpu")).to_host()
    cuda = sample(logits.cuda(), SamplingBatch.build(seqs, "cuda")).to_host()
    assert [t.id for t in cuda] == [t.id for t in cpu]


def test_top_alternatives_are_the_largest_logits_equal_ones_in_id_order_alone_or_in_any_batch():
    # bfloat16-rounded logits: many ties, of negative, zero and positive values
    logits = (torch.randn(33, 500, generator=torch.Generator().manual_seed(3)) * 4).bfloat16().float()
    logits[5, 7:47] = 100.0  # forty equal largest
    logits[6] = -torch.arange(500).float().div(7).floor()  # runs of seven equal negative logits
    logits[7] = torch.tensor([0.0, -0.0] * 250)  # +0.0 and -0.0 are equal logits
    seqs = [sequence(str(i), logprobs=20) for i in range(33)]
    together = sample(logits, SamplingBatch.build(seqs, "cpu")).to_host()
    for i, tok in enumerate(together):
        order = torch.sort(logits[i], descending=True, stable=True).indices[:20].tolist()  # ties: lower id first
        assert [t for t, _ in tok.top] == order
        alone = sample(logits[i : i + 1], SamplingBatch.build([seqs[i]], "cpu")).to_host()[0]
        assert alone.top == tok.top

"""Paged attention gives PyTorch's scaled-dot-product attention, and a query's output is the same bits
whatever other sequences share the step and however its own prompt was cut into chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data_plane.model import tiled_attention
from data_plane.model.tiled_attention import KEY_TILE
from data_plane.model.torch_attention import TorchAttention
from tests.steps import SeqSlice, attention_inputs
from tests.tolerances import sum_atol

BLOCK = 16


def _attend(cache, seqs, qkv, window=None, heads=(9, 3), softcap=None):
    """Writes each sequence's new keys and values and returns its queries' outputs, in seqs order."""
    k_cache, v_cache = cache
    step = TorchAttention({window}).prepare(attention_inputs([SeqSlice(list(s.block_table), s.num_cached, s.num_new)
                                                              for s in seqs], BLOCK))
    q, k, v = (torch.cat(parts) for parts in zip(*qkv, strict=True))
    return step(q, k, v, k_cache, v_cache, window, q.shape[-1] ** -0.5, softcap)


def _new(n: int, seed: int, heads=(9, 3), head_dim=64):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads[0], head_dim, generator=gen), torch.randn(n, heads[1], head_dim, generator=gen),
            torch.randn(n, heads[1], head_dim, generator=gen))


def _cache(heads=(9, 3), head_dim=64, blocks=400):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(blocks * BLOCK, heads[1], head_dim, generator=gen),
            torch.randn(blocks * BLOCK, heads[1], head_dim, generator=gen))


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa", "mha"])
def test_attention_equals_scaled_dot_product_attention(window, heads):
    cache = _cache(heads)
    qkv = _new(37, 1, heads)
    out = _attend(cache, [SeqSlice(range(3), 0, 37)], [qkv], window, heads)
    q, k, v = (t.transpose(0, 1)[None] for t in qkv)
    pos = torch.arange(37)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    # scores: 64-term sums of |q||k|; outputs: 37-term averages of |v| (weights sum to one)
    atol = sum_atol(64, float(q.abs().max() * k.abs().max() * 64)) + sum_atol(37, float(v.abs().max()))
    torch.testing.assert_close(out, expected.reshape(37, -1), rtol=0, atol=atol)


@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa", "mha"])
def test_a_decode_query_gives_the_same_bits_whatever_shares_its_step(heads):
    mine = _new(1, 5, heads)
    alone = None
    for others in ([], [(1, 199)], [(40, 0)], [(1, 10 * i + 5) for i in range(7)], [(300, 0)], [(1, 1699)],
                   [(2, 50), (17, 3)]):
        cache = _cache(heads)
        seqs, qkv, block = [SeqSlice(range(3), 30, 1)], [mine], 3
        for i, (n, cached) in enumerate(others):
            blocks = -(-(n + cached) // BLOCK)
            seqs.append(SeqSlice(range(block, block + blocks), cached, n))
            qkv.append(_new(n, 100 + i, heads))
            block += blocks
        out = _attend(cache, seqs, qkv, heads=heads)[0]
        alone = out if alone is None else alone
        assert torch.equal(out, alone), others


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("chunks", [(20, 1, 16, 113), (1,) * 150, (5, 145), (KEY_TILE, 150 - KEY_TILE),
                                    (KEY_TILE + 1, KEY_TILE - 1, 150 - 2 * KEY_TILE)])
def test_a_prompt_gives_the_same_bits_however_it_is_chunked(window, chunks, softcap):
    qkv = _new(150, 9)
    whole = _attend(_cache(), [SeqSlice(range(10), 0, 150)], [qkv], window, softcap=softcap)
    cache, parts, done = _cache(), [], 0
    for n in chunks:
        parts.append(_attend(cache, [SeqSlice(range(10), done, n)], [tuple(t[done: done + n] for t in qkv)], window,
                             softcap=softcap))
        done += n
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize("heads", [(9, 3), (8, 1)], ids=["gqa3", "mqa8"])
def test_a_long_prefill_gives_the_same_bits_beside_another_long_prefill_and_decodes(heads):
    qkv = _new(150, 9, heads)
    alone = _attend(_cache(heads), [SeqSlice(range(10), 0, 150)], [qkv], heads=heads)
    seqs = [SeqSlice(range(10, 30), 100, 140), SeqSlice(range(10), 0, 150), SeqSlice(range(30, 40), 99, 1)]
    together = _attend(_cache(heads), seqs, [_new(140, 10, heads), qkv, _new(1, 11, heads)], heads=heads)
    assert torch.equal(together[140:290], alone)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_heads_taken_a_few_at_a_time_give_the_bits_of_all_at_once(monkeypatch, softcap):
    # past ATTENTION_BYTES a group's key/value heads go a few per call; each head's matrices are the same
    seqs = [SeqSlice(range(3), 30, 1), SeqSlice(range(3, 6), 20, 1), SeqSlice(range(6, 16), 37, 5),
            SeqSlice(range(16, 30), 0, 150)]
    heads = (8, 4)
    qkv = [_new(s.num_new, i, heads) for i, s in enumerate(seqs)]

    def attend() -> torch.Tensor:
        return _attend(_cache(heads), seqs, qkv, heads=heads, softcap=softcap)

    together = attend()
    calls = []
    attend_heads = tiled_attention._attend
    monkeypatch.setattr(tiled_attention, "_attend", lambda q, *rest: calls.append(q.shape[0]) or attend_heads(q, *rest))
    monkeypatch.setattr(tiled_attention, "ATTENTION_BYTES", 1)
    assert torch.equal(attend(), together)
    assert calls and set(calls) == {1}, calls


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa3", "mha", "mqa8"])
def test_every_matmul_computes_a_multiple_of_eight_query_rows(monkeypatch, heads):
    # which row counts share a BLAS kernel differs by CPU; a multiple of eight rows is what every CPU
    # measured agrees on (tiled_attention's notes), so no call may see another count, on any CPU
    rows = []
    bmm = torch.bmm

    def counting_bmm(a, b, **kwargs):
        rows.append(a.shape[1])
        return bmm(a, b, **kwargs)

    monkeypatch.setattr(torch, "bmm", counting_bmm)
    # a decode, a one-token chunk, a chunk ending inside a query block, and a long prefill
    seqs = [SeqSlice(range(3), 30, 1), SeqSlice(range(3, 6), 20, 1), SeqSlice(range(6, 16), 37, 5),
            SeqSlice(range(16, 30), 0, 150)]
    _attend(_cache(heads), seqs, [_new(s.num_new, i, heads) for i, s in enumerate(seqs)], heads=heads)
    assert rows and all(r % 8 == 0 for r in rows), rows

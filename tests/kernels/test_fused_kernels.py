"""The fused layer kernels (residual add + RMSNorm, in-place rotary, gated activation) agree with
``kernels.reference`` and read and write nothing else, and a row's bits do not depend on the rows beside it.

Inputs are views into wider rows whose extra columns are NaN, so a read past a row's end spreads NaN into
the result; outputs are NaN before each run (views into wider NaN rows too), so an element left
unwritten, or written past the row, shows. Rotary runs in place on the queries and keys of a packed qkv
row: the values, and each head past ``rotary_dim``, must come back bit for bit.

Compared under a per-dtype table built from ``tests.tolerances``: ``RTOL`` per rounding to the dtype (the
interpreter rounds toward zero, the reference to nearest, so two results one rounding apart differ by up
to ``RTOL``), times the roundings a result passes through; an atol for what the float32 math may differ by
(another summation order, FMA, the GPU's rsqrt, exp and sigmoid), relative to the largest magnitude
summed. On CPU the kernels run under Triton's interpreter (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.fused_activation import act_mul
from kernels.fused_norm import add_rms_norm
from kernels.fused_rotary import rotary
from tests.tolerances import RTOL, eps, magnitude, sum_atol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16)
TOKENS = (1, 3, 7, 133)
PAD = 3  # NaN columns past each input and output row


def _rows(values: torch.Tensor) -> torch.Tensor:
    """``values`` as a view into rows PAD columns wider, the extra columns NaN."""
    wide = torch.full((values.shape[0], values.shape[1] + PAD), float("nan"), dtype=values.dtype, device=DEVICE)
    wide[:, : values.shape[1]] = values
    return wide[:, : values.shape[1]]


def _poisoned(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return _rows(torch.full((rows, cols), float("nan"), dtype=dtype, device=DEVICE))


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _tolerances(dtype: torch.dtype, roundings: int, atol: float) -> dict:
    return dict(rtol=roundings * RTOL[dtype], atol=atol)


def _assert_untouched(view: torch.Tensor) -> None:
    """The NaN columns past a view's rows are still NaN."""
    wide = view.as_strided((view.shape[0], view.stride(0)), (view.stride(0), 1))
    assert wide[:, view.shape[1] : view.shape[1] + PAD].isnan().all(), "written past the row"


# ---- residual add + RMSNorm


HIDDEN = 96  # not a power of two: the last block is masked
EPS = 1e-6


def _norm_case(tokens: int, dtype: torch.dtype, seed: int = 0):
    x = _rows(_randn(tokens, HIDDEN, dtype=dtype, seed=seed))
    residual = _rows(_randn(tokens, HIDDEN, dtype=dtype, seed=seed + 1, scale=3.0))
    weight = _randn(HIDDEN, dtype=dtype, seed=seed + 2, scale=0.5) + 1
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_add_rms_norm_equals_reference(dtype, tokens, with_residual, offset):
    x, residual, weight = _norm_case(tokens, dtype)
    expected_residual = residual.clone() if with_residual else None
    expected = reference.add_rms_norm(x, expected_residual, weight, EPS, offset)
    out = _poisoned(tokens, HIDDEN, dtype)
    got = add_rms_norm(x, residual if with_residual else None, weight, EPS, offset, out=out)
    assert got is out
    _assert_untouched(out)
    if with_residual:  # the sum, rounded once by each side
        _assert_untouched(residual)
        torch.testing.assert_close(residual, expected_residual, **_tolerances(dtype, 1, 0.0))
    # Llama rounds the normalised row, then its product with weight (Gemma only the product); with a
    # residual the normalised sum may sit one rounding apart too.
    roundings = (1 if offset else 2) + with_residual
    atol = sum_atol(HIDDEN + 4, magnitude(expected))  # the sum of squares, rsqrt and the products
    torch.testing.assert_close(out, expected, **_tolerances(dtype, roundings, atol))


def test_add_rms_norm_of_a_row_has_the_same_bits_alone_and_beside_others():
    x, residual, weight = _norm_case(133, torch.bfloat16, seed=3)
    together_residual = residual.clone()
    together = add_rms_norm(x, together_residual, weight, EPS)
    for row in (0, 66, 132):
        alone_residual = residual[row : row + 1].clone()
        alone = add_rms_norm(x[row : row + 1].clone(), alone_residual, weight, EPS)
        assert torch.equal(alone[0], together[row]) and torch.equal(alone_residual[0], together_residual[row])


def test_add_rms_norm_refuses_a_row_too_wide_for_one_block():
    x = torch.zeros(1, 40000, device=DEVICE)
    with pytest.raises(AssertionError, match="fit one block"):
        add_rms_norm(x, None, torch.ones(40000, device=DEVICE), EPS)


# ---- rotary, in place


NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32


def _tables(tokens: int, rotary_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin as ``RotaryEmbedding.tables`` gives them: [tokens, 1, rotary_dim] each."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = positions[:, None] * inv_freq[None, :]  # [tokens, rotary_dim // 2]
    cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)
    sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
    return cos[:, None, :].to(DEVICE), sin[:, None, :].to(DEVICE)


def _qkv(tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A packed qkv output, q and k heads then v, as a view into wider NaN-padded rows."""
    return _rows(_randn(tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=dtype, seed=seed))


def _qk(qkv: torch.Tensor) -> torch.Tensor:  # [tokens, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM], a view of qkv
    return qkv[:, : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(-1, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 4 * 3], ids=["full", "partial"])
def test_rotary_in_place_equals_reference_and_leaves_the_rest_of_the_row(dtype, tokens, rotary_dim):
    qkv = _qkv(tokens, dtype, seed=tokens)
    cos, sin = (t.to(dtype) for t in _tables(tokens, rotary_dim, seed=tokens))
    expected = qkv.clone()
    reference.rotary(_qk(expected), cos, sin)
    before = qkv.clone()
    assert rotary(_qk(qkv), cos, sin).data_ptr() == qkv.data_ptr()
    _assert_untouched(qkv)
    qk_width = (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    assert torch.equal(qkv[:, qk_width:], before[:, qk_width:]), "the values changed"
    assert torch.equal(_qk(qkv)[..., rotary_dim:], _qk(before)[..., rotary_dim:]), "past rotary_dim changed"
    atol = sum_atol(3, 2 * magnitude(before))  # x·cos + x'·sin, |cos|, |sin| <= 1
    torch.testing.assert_close(qkv, expected, **_tolerances(dtype, 1, atol))


def test_rotary_of_a_token_has_the_same_bits_alone_and_beside_others():
    qkv, (cos, sin) = _qkv(133, torch.bfloat16, seed=5), _tables(133, HEAD_DIM, seed=5)
    cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    together = qkv.clone()
    rotary(_qk(together), cos, sin)
    for row in (0, 66, 132):
        alone = _rows(qkv[row : row + 1].clone())
        rotary(_qk(alone), cos[row : row + 1].clone(), sin[row : row + 1].clone())
        assert torch.equal(alone[0], together[row])


# ---- gated activation


WIDTH = 72  # per half: not a multiple of the block


# numpy's exp overflows to inf for the interpreter's sigmoid of a large negative input, which is then 0, right
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_act_mul_equals_reference(dtype, tokens, activation):
    gate_up = _rows(_randn(tokens, 2 * WIDTH, dtype=dtype, seed=tokens, scale=3.0))
    expected = reference.act_mul(gate_up, activation)
    out = _poisoned(tokens, WIDTH, dtype)
    assert act_mul(gate_up, activation, out=out) is out
    _assert_untouched(out)
    # The activation rounded (it may land a rounding apart), then the product; the activation's float32
    # math (exp, sigmoid, tanh) a few ulps apart, relative to |gate|·|up|.
    atol = 8 * eps(torch.float32) * magnitude(gate_up) ** 2
    torch.testing.assert_close(out, expected, **_tolerances(dtype, 2, atol))


def test_act_mul_of_a_row_has_the_same_bits_alone_and_beside_others():
    gate_up = _randn(133, 2 * WIDTH, dtype=torch.bfloat16, seed=7, scale=3.0)
    together = act_mul(gate_up, "silu")
    for row in (0, 66, 132):
        assert torch.equal(act_mul(gate_up[row : row + 1].clone(), "silu")[0], together[row])


def test_act_mul_refuses_an_activation_it_does_not_fuse():
    with pytest.raises(AssertionError, match="relu"):
        act_mul(torch.zeros(1, 8, device=DEVICE), "relu")

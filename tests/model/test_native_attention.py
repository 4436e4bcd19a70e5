"""The native CPU attention kernel (kernels/native/paged_attention.cpp, compiled here at first use) against
``kernels.reference.paged_attention``: mixed steps of decodes and prompt chunks over scattered blocks, every
cache dtype a CPU pod keeps, grouped-query ratios, windows, soft-capping, padding sequences and NaN in the
cache slots no query may read; and a query's bits whatever shares its step (the start-up probe's check,
which must also notice a kernel that breaks it)."""

from __future__ import annotations

import pytest
import torch

from data_plane.model import native_attention, row_rule
from data_plane.model.attention import AttentionInputs
from kernels import reference

BLOCK = 16
# (new tokens, context after the step) per sequence: decodes of odd lengths, prompt chunks over cached
# context and from nothing, one of a single key, a padding sequence (no context) last
STEP = [(1, 1), (5, 17), (1, 100), (40, 40), (3, 33), (23, 150), (0, 0)]


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    if native_attention.kernel() is None:
        why = native_attention.native_build.why_not(native_attention.LIBRARY)
        pytest.fail(f"the kernel must build on a CI machine: {why}")


def _step(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-ctx // BLOCK) for _, ctx in STEP) + 1
    num_blocks = len(STEP) * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=gen)[: len(STEP) * max_blocks].view(len(STEP), max_blocks).int()
    # every slot NaN but those of some sequence's context: a kernel that read past a row's keys would show it
    k_cache = torch.full((num_blocks * BLOCK, kv_heads, head_dim), float("nan")).to(dtype)
    v_cache = k_cache.clone()
    starts, written = [0], []
    for b, (new, ctx) in enumerate(STEP):
        starts.append(starts[-1] + new)
        slots = tables[b].long()[torch.arange(ctx) // BLOCK] * BLOCK + torch.arange(ctx) % BLOCK
        k_cache[slots[: ctx - new]] = torch.randn(ctx - new, kv_heads, head_dim, generator=gen).to(dtype)
        v_cache[slots[: ctx - new]] = torch.randn(ctx - new, kv_heads, head_dim, generator=gen).to(dtype)
        written.append(slots[ctx - new :])
    slot_mapping = torch.cat(written)
    tokens = starts[-1]
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    inputs = AttentionInputs(slot_mapping, tables, torch.tensor([c for _, c in STEP], dtype=torch.int32),
                             torch.tensor(starts, dtype=torch.int32), max(n for n, _ in STEP),
                             max(c for _, c in STEP), BLOCK)
    return inputs, q, k, v, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16), (8, 1, 32), (4, 2, 128)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (7, None), (None, 30.0), (20, 50.0)])
def test_the_kernel_equals_the_reference(dtype, heads, kv_heads, head_dim, window, softcap):
    inputs, q, k, v, k_cache, v_cache = _step(heads, kv_heads, head_dim, dtype, heads * head_dim)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    step = native_attention.NativeAttention(native_attention.kernel()).prepare(inputs)
    got = step(q, k, v, k_cache, v_cache, window, head_dim**-0.5, softcap)
    expected_k[inputs.slot_mapping], expected_v[inputs.slot_mapping] = k, v
    assert torch.equal(k_cache.nan_to_num(), expected_k.nan_to_num())  # this step's keys and values written
    assert torch.equal(v_cache.nan_to_num(), expected_v.nan_to_num())
    want = torch.zeros(q.shape[0], heads, head_dim)
    reference.paged_attention(q, expected_k, expected_v, inputs.block_tables, inputs.seq_lens, inputs.query_start,
                              want, block_size=BLOCK, scale=head_dim**-0.5, window=window,
                              max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len, softcap=softcap)
    assert got.dtype == dtype and got.shape == (q.shape[0], heads * head_dim) and not got.isnan().any()
    # float32 sums over up to 150 keys and 128 dimensions (an exp to ~2e-7 relative), then one rounding to dtype
    atol = 2e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.view(q.shape[0], -1).to(dtype).float(), atol=atol, rtol=atol)


def test_a_padded_steps_rows_of_no_sequence_come_out_zero():
    inputs, q, k, v, k_cache, v_cache = _step(4, 2, 16, torch.float32, 1)
    extra = torch.randn(3, 4, 16)  # rows past the last sequence's tokens, as a fixed-size step pads them
    q = torch.cat([q, extra])
    k, v = torch.cat([k, extra[:, :2]]), torch.cat([v, extra[:, :2]])
    pad = torch.full((3,), k_cache.shape[0] - 1, dtype=torch.long)  # a slot no sequence reads
    inputs = AttentionInputs(torch.cat([inputs.slot_mapping, pad]), inputs.block_tables, inputs.seq_lens,
                             inputs.query_start, inputs.max_query_len, inputs.max_seq_len, BLOCK)
    got = native_attention.NativeAttention(native_attention.kernel()).prepare(inputs)(q, k, v, k_cache, v_cache,
                                                                                        None, 0.25)
    assert torch.equal(got[-3:], torch.zeros(3, 64)) and not got.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "per_kv"), [(64, 3), (16, 2), (32, 4), (128, 1)])
def test_a_query_keeps_its_bits_chunked_decoded_alone_and_beside_others(dtype, head_dim, per_kv):
    assert row_rule._native_breaks(dtype, head_dim, per_kv) is None


def test_the_probe_notices_a_kernel_whose_queries_depend_on_what_shares_their_step(monkeypatch):
    call = native_attention.NativeStep.__call__

    def by_company(self, q, *rest, **kwargs):  # scales every row by how many tokens share the step
        return call(self, q, *rest, **kwargs) * (1 + 1e-3 * q.shape[0])

    monkeypatch.setattr(native_attention.NativeStep, "__call__", by_company)
    assert row_rule._native_breaks(torch.float32, 64, 3) is not None


def test_a_cache_the_kernel_cannot_take_is_named_and_left_to_tiled_attention():
    assert "float64" in native_attention.unusable(torch.float64, 64)
    assert "not 12" in native_attention.unusable(torch.float32, 12)
    assert native_attention.unusable(torch.float32, 64) == ""


def test_a_step_whose_sequence_has_more_new_tokens_than_context_is_refused_not_read_out_of_bounds():
    inputs, q, k, v, k_cache, v_cache = _step(4, 2, 16, torch.float32, 2)
    short = inputs.seq_lens.clone()
    short[3] = 20  # 40 new tokens over a context of 20
    broken = AttentionInputs(inputs.slot_mapping, inputs.block_tables, short, inputs.query_start,
                             inputs.max_query_len, inputs.max_seq_len, BLOCK)
    step = native_attention.NativeAttention(native_attention.kernel()).prepare(broken)
    with pytest.raises(ValueError, match="more new tokens than context"):
        step(q, k, v, k_cache, v_cache, None, 0.25)

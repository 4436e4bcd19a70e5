"""The unified Triton paged-attention kernel over an FP8 KV cache (``--kv-cache-dtype fp8``): keys and values
stored as float8_e4m3fn with a scale each, read back as ``e4m3 · scale``, agree with
``kernels.reference.paged_attention`` on the same cache; the kernel reads nothing else (the cache's other
slots are e4m3 NaN) and gives a sequence the same bits whatever shares its step.

The steps are ``test_paged_attention``'s (odd lengths, GQA, windows, soft-capping, splits, padding rows), their
caches quantized with power-of-two scales (what a pod calibrates: the dequantized values are exact in every
dtype) or, in float32, any scale. The tolerances are those of a cache holding the dequantized values.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from data_plane.model.attention import KV_FP8, quantize_kv
from kernels import reference
from kernels.attention_unified import unified_attention
from kernels.paged_attention import paged_attention
from tests.kernels.test_paged_attention import (
    BF16,
    CASES,
    F16,
    F32,
    PAD,
    SMALL,
    SPLIT,
    Batch,
    _args,
    _batch,
    _bits,
    _copy_sequence,
    _out_rows,
    _tolerances,
)


def _fp8(b: Batch, k_scale: float, v_scale: float) -> tuple[Batch, Batch]:
    """(``b`` with its caches quantized to e4m3 by the scales, ``b`` with those caches dequantized in float32):
    the second is what the tolerances are reckoned on."""
    k8, v8 = quantize_kv(b.k_cache, k_scale), quantize_kv(b.v_cache, v_scale)
    assert k8.dtype == KV_FP8
    return (dataclasses.replace(b, k_cache=k8, v_cache=v8),
            dataclasses.replace(b, k_cache=k8.float() * k_scale, v_cache=v8.float() * v_scale))


def _run(b: Batch, scales: tuple[float, float], tiles=None, **limits) -> torch.Tensor:
    storage, out = b.poisoned_out()
    kw = b.kwargs(**limits) | {"k_scale": scales[0], "v_scale": scales[1]}
    if tiles is None:
        paged_attention(*_args(b, out), **kw)
    else:
        unified_attention(*_args(b, out), **kw, tiles=tiles)
    return storage


def _check(b: Batch, dequantized: Batch, scales: tuple[float, float], storage: torch.Tensor) -> None:
    expected, out = b.poisoned_out()
    reference.paged_attention(*_args(b, out), **b.kwargs(), k_scale=scales[0], v_scale=scales[1])
    assert expected[: b.num_tokens, : out[0].numel()].isfinite().all(), "the reference read poison: a test bug"
    rtol, atol = _tolerances(dequantized)
    torch.testing.assert_close(storage, expected, rtol=rtol, atol=atol, equal_nan=True)


# A case of each kind (decode, splits, odd lengths, mixed, windows, padding rows, GQA 1 to 8, head_dim 16 to 128),
# with (k_scale, v_scale): powers of two from 2^-6 to 4
FP8_CASES = {
    "decode-gqa4-bs16": (2.0**-4, 2.0**-5),
    "decode-gqa8-bs1-window": (1.0, 0.5),
    "decode-splits": (2.0**-3, 4.0),
    "odd-lengths-gqa4": (2.0**-6, 2.0**-2),
    "odd-lengths-gqa2-window": (0.25, 0.25),
    "mixed-gqa4-bs16": (0.5, 2.0**-4),
    "mixed-gqa1-bs5-window-padding": (2.0, 1.0),
    "prefill-bs32-hd128": (2.0**-5, 2.0**-5),
    "decode-padding-rows-hd128": (0.125, 0.0625),
}


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_an_fp8_cache_matches_the_reference_on_its_dequantized_values(case):
    seqs, heads, head_dim, block_size, dtype, window = CASES[case]
    scales = FP8_CASES[case]
    b, dequantized = _fp8(_batch(seqs, heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                                 window=window, seed=zlib.crc32(case.encode())), *scales)
    _check(b, dequantized, scales, _run(b, scales))


@pytest.mark.parametrize(("case", "softcap"), [("mixed-gqa4-bs16", 2.0), ("odd-lengths-gqa2-window", 1.0)])
def test_soft_capped_scores_over_an_fp8_cache_match_the_reference(case, softcap):
    seqs, heads, head_dim, block_size, dtype, window = CASES[case]
    scales = (0.25, 0.5)
    b, dequantized = _fp8(_batch(seqs, heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                                 window=window, seed=zlib.crc32(case.encode()), softcap=softcap), *scales)
    _check(b, dequantized, scales, _run(b, scales))


def test_any_scale_in_float32_and_small_tiles_over_several_splits():
    # scales that are no power of two: a float32 query dequantizes in float32, as the reference does
    seqs = [(1, 100), (30, 70), (1, 45), (20, 20), (1, 300), PAD]
    scales = (0.0123, 0.37)
    b, dequantized = _fp8(_batch(seqs, heads=(4, 1), head_dim=32, block_size=6, dtype=F32, window=40, seed=3),
                          *scales)
    _check(b, dequantized, scales, _run(b, scales, SMALL))


def test_the_scales_are_applied():
    # the same e4m3 bytes under other scales: the output moves (v's scale multiplies it exactly)
    seqs, heads, head_dim, block_size, dtype, window = CASES["mixed-gqa4-bs16"]
    b, _ = _fp8(_batch(seqs, heads=heads, head_dim=head_dim, block_size=block_size, dtype=F32, window=window,
                       seed=1), 0.5, 0.5)
    once, twice = _run(b, (0.5, 0.5)), _run(b, (0.5, 1.0))
    n = b.num_tokens
    torch.testing.assert_close(twice[:n, : b.q[0].numel()], 2 * once[:n, : b.q[0].numel()])
    assert not torch.equal(_run(b, (1.0, 0.5))[:n], once[:n])


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_a_decode_over_an_fp8_cache_keeps_its_bits_alone_and_in_a_batch(dtype):
    mine, scales = (1, SPLIT + 77), (2.0**-3, 2.0**-4)
    kw = dict(heads=(8, 2), head_dim=32, block_size=16, dtype=dtype, seed=11)
    alone, _ = _fp8(_batch([mine], **kw), *scales)
    seqs = [(1, 3), (1, 6 * SPLIT + 5), mine, (5, 40), PAD]
    batch, dequantized = _fp8(_batch(seqs, **kw), *scales)
    _copy_sequence(alone, 0, batch, 2)
    together = _run(batch, scales, max_seq_len=8 * SPLIT)
    _check(batch, dataclasses.replace(dequantized, k_cache=batch.k_cache.float() * scales[0],
                                      v_cache=batch.v_cache.float() * scales[1]), scales, together)
    by_itself = _run(alone, scales)
    assert torch.equal(_bits(_out_rows(alone, by_itself, 0)), _bits(_out_rows(batch, together, 2)))


def test_the_launcher_takes_an_fp8_cache_only_as_both_k_and_v():
    b, _ = _fp8(_batch([(2, 5)], heads=(4, 2), head_dim=16, block_size=4, dtype=F16, seed=19), 1.0, 1.0)
    _, out = b.poisoned_out()
    with pytest.raises(ValueError, match="one shape and dtype"):
        paged_attention(b.q, b.k_cache, b.v_cache.to(F16), b.block_tables, b.seq_lens, b.query_start, out,
                        **b.kwargs())


def test_the_start_up_probe_passes_a_kernel_that_reads_an_fp8_cache_and_names_one_that_cannot(monkeypatch):
    # kv_scales.kernel_failure, what a CUDA pod of compute capability 8.9+ runs before it takes
    # --kv-cache-dtype fp8: here on CPU tensors under the interpreter, with a tiny model's heads
    from data_plane.model import kv_scales
    from kernels import paged_attention as launcher
    from tests.data_plane.tiny_model import tiny_model

    model = tiny_model(hidden_size=64)  # head_dim 16
    assert kv_scales.kernel_failure(model, "cpu") == ""

    def broken(*args, **kwargs):
        raise RuntimeError("fp8e4nv is not supported on this architecture\nmore")

    monkeypatch.setattr(launcher, "paged_attention", broken)
    assert kv_scales.kernel_failure(model, "cpu") == ("the Triton attention kernel does not run an FP8 KV cache "
                                                      "here: fp8e4nv is not supported on this architecture")
    monkeypatch.setattr(launcher, "paged_attention", lambda q, *args, **kwargs: args[5].copy_(q))  # out = q
    assert "wrong results" in kv_scales.kernel_failure(model, "cpu")

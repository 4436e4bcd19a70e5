"""One LoRA layer code, two backends: the Triton kernels (what CUDA runs; here under the
interpreter) and the CPU path give the same layer output, and a CPU layer follows slot changes."""

from __future__ import annotations

import itertools

import pytest
import torch

import kernels.lora_expand
import kernels.lora_shrink
from data_plane.lora.layer import LoRAProjection
from data_plane.lora.peft_adapter import SliceDelta
from data_plane.model.llama import ForwardBatch, Projection
from kernels.lora_backend import CpuBackend, TritonBackend
from kernels.lora_meta import LoraMetaBuilder
from tests.tolerances import magnitude, tolerances

MAX_LORAS, MAX_RANK = 4, 16
# slot -> slice -> rank: mixed ranks in one batch, a slot that adapts only q and v, an empty slot.
SLOT_RANKS = {0: {"q": 8, "k": 8, "v": 8}, 1: {"q": 16, "v": 16}, 2: {"q": 1, "k": 4, "v": 2}}
TOKEN_SLOTS = [0, -1, 1, 1, 2, 0, -1, 3, 1]
DTYPES = (torch.float32, torch.bfloat16)


def _qkv_layer(dtype: torch.dtype) -> LoRAProjection:
    gen = torch.Generator().manual_seed(0)
    base = Projection(96, {"q": 80, "k": 24, "v": 24}, bias=False)
    base.weight.data = torch.randn(base.out_features, base.in_features, generator=gen).to(dtype)
    layer = LoRAProjection(base, MAX_LORAS, MAX_RANK)
    for slot, ranks in SLOT_RANKS.items():
        deltas = {
            name: SliceDelta(
                a=torch.randn(r, base.in_features, generator=gen).to(dtype),  # [r, in_features]
                b=torch.randn(base.slices[name], r, generator=gen).to(dtype),  # [slice_out, r]
            )
            for name, r in ranks.items()
        }
        layer.set_slot(slot, deltas)
    return layer


def _tolerances(layer: LoRAProjection, x: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol) for the layer's output on two paths, from |W| @ |x| + |B| @ (|A| @ |x|) per token
    (what each element's sums add up to: outputs reach hundreds and cancel to near zero, as the
    weights are unscaled) and the longest chain of sums: shrink, expand, the add to the base."""
    x = x.float().abs()
    abs_sums = x @ layer.base.weight.float().abs().T
    for t, slot in enumerate(TOKEN_SLOTS):
        for s, (lo, hi) in enumerate(itertools.pairwise(layer.host_offsets)):
            r = layer.host_ranks[s][slot] if slot >= 0 else 0
            if r:
                a, b = layer.lora_a[s, slot, :r].float().abs(), layer.lora_b[slot, lo:hi, :r].float().abs()
                abs_sums[t, lo:hi] += b @ (a @ x[t])
    return tolerances(layer.lora_a.dtype, depth=layer.base.in_features + MAX_RANK + 1, scale=magnitude(abs_sums))


def _counting(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    launcher = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return launcher(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_output_is_the_same_on_the_triton_and_the_cpu_path(monkeypatch, dtype):
    layer = _qkv_layer(dtype)
    meta = LoraMetaBuilder(32, MAX_LORAS, "cpu", max_rank=MAX_RANK).build(TOKEN_SLOTS)
    batch = ForwardBatch(input_ids=None, positions=None, attn=None, kv_cache=None, lora=meta)
    x = torch.randn(len(TOKEN_SLOTS), 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    base = layer.base(x)
    assert isinstance(layer.backend, CpuBackend), "a layer on CPU runs the CPU path"
    on_cpu = layer(x, batch)

    # What a layer on CUDA runs, on CPU tensors: the kernels run under the interpreter.
    layer.backend = TritonBackend(layer.backend.slots)
    shrinks = _counting(monkeypatch, kernels.lora_shrink, "lora_shrink")
    expands = _counting(monkeypatch, kernels.lora_expand, "lora_expand")
    on_triton = layer(x, batch)

    assert (len(shrinks), len(expands)) == (1, 1)
    rtol, atol = _tolerances(layer, x)
    torch.testing.assert_close(on_triton, on_cpu, rtol=rtol, atol=atol)
    base_rows = [t for t, slot in enumerate(TOKEN_SLOTS) if slot not in SLOT_RANKS]
    lora_rows = [t for t, slot in enumerate(TOKEN_SLOTS) if slot in SLOT_RANKS]
    assert torch.equal(on_triton[base_rows], base[base_rows]), "rows without an adapter changed"
    assert (on_triton[lora_rows].float() - base[lora_rows].float()).abs().max() > 1.0, "adapters did nothing"


def _step() -> ForwardBatch:
    meta = LoraMetaBuilder(32, MAX_LORAS, "cpu", max_rank=MAX_RANK).build(TOKEN_SLOTS)
    return ForwardBatch(input_ids=None, positions=None, attn=None, kv_cache=None, lora=meta)


X = torch.randn(len(TOKEN_SLOTS), 96, generator=torch.Generator().manual_seed(1))


def _loop(layer: LoRAProjection) -> torch.Tensor:
    """The layer's output by ``kernels.reference``'s loop over segments and slices."""
    from kernels import reference

    batch, sl = _step(), layer.backend.slots
    y = layer.base(X)
    buf = batch.lora.buffer[: sl.lora_a.shape[0], : X.shape[0]]
    reference.lora_shrink(X, sl.lora_a, sl.ranks, batch.lora, buf)
    reference.lora_expand(y, buf, sl.lora_b, sl.ranks, sl.host_offsets, batch.lora)
    return y


def test_a_layer_no_resident_adapter_adapts_returns_the_base_output():
    layer = _qkv_layer(torch.float32)
    for slot in SLOT_RANKS:
        layer.clear_slot(slot)
    assert torch.equal(layer(X, _step()), layer.base(X))


def test_the_cpu_layer_equals_the_loop_and_follows_slot_changes():
    layer = _qkv_layer(torch.float32)
    before = layer(X, _step())
    rtol, atol = _tolerances(layer, X)
    torch.testing.assert_close(before, _loop(layer), rtol=rtol, atol=atol)

    # Replacing slot 1's adapter must show on the next step (its packed copy is rebuilt).
    gen = torch.Generator().manual_seed(2)
    layer.set_slot(1, {"k": SliceDelta(a=torch.randn(4, 96, generator=gen), b=torch.randn(24, 4, generator=gen))})
    after = layer(X, _step())
    rtol, atol = _tolerances(layer, X)
    torch.testing.assert_close(after, _loop(layer), rtol=rtol, atol=atol)
    rows = [t for t, slot in enumerate(TOKEN_SLOTS) if slot == 1]
    assert not torch.allclose(after[rows], before[rows]), "slot 1 changed but its rows did not"
    others = [t for t, slot in enumerate(TOKEN_SLOTS) if slot != 1]
    assert torch.equal(after[others], before[others]), "rows of unchanged slots changed"

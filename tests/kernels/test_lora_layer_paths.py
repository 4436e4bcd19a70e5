"""One LoRA layer code, two backends: the Triton kernels (what CUDA runs; here under the
interpreter) and the CPU paths give the same layer output, and a CPU layer takes the path it is
given and follows slot changes on it."""

from __future__ import annotations

import itertools

import pytest
import torch

import kernels.lora_expand
import kernels.lora_shrink
from data_plane.lora.layer import LoRAProjection
from data_plane.lora.peft_adapter import SliceDelta
from data_plane.model.llama import ForwardBatch, Projection
from kernels import cpu_lora, cpu_tuner
from kernels.cpu_tuner import CpuLoraPath, CpuLoraRun
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
def test_layer_output_is_the_same_on_the_triton_and_the_reference_path(monkeypatch, dtype):
    layer = _qkv_layer(dtype)
    meta = LoraMetaBuilder(32, MAX_LORAS, "cpu", max_rank=MAX_RANK).build(TOKEN_SLOTS)
    batch = ForwardBatch(input_ids=None, positions=None, attn=None, kv_cache=None, lora=meta)
    x = torch.randn(len(TOKEN_SLOTS), 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    base = layer.base(x)
    assert isinstance(layer.backend, CpuBackend), "a layer on CPU runs the CPU paths"
    monkeypatch.setattr(cpu_tuner, "choose_path", lambda *args: CpuLoraRun(CpuLoraPath.LOOP, 1))
    on_reference = layer(x, batch)

    # What a layer on CUDA runs, on CPU tensors: the kernels run under the interpreter.
    layer.backend = TritonBackend(layer.backend.slots)
    shrinks = _counting(monkeypatch, kernels.lora_shrink, "lora_shrink")
    expands = _counting(monkeypatch, kernels.lora_expand, "lora_expand")
    on_triton = layer(x, batch)

    assert (len(shrinks), len(expands)) == (1, 1)
    rtol, atol = _tolerances(layer, x)
    torch.testing.assert_close(on_triton, on_reference, rtol=rtol, atol=atol)
    base_rows = [t for t, slot in enumerate(TOKEN_SLOTS) if slot not in SLOT_RANKS]
    lora_rows = [t for t, slot in enumerate(TOKEN_SLOTS) if slot in SLOT_RANKS]
    assert torch.equal(on_triton[base_rows], base[base_rows]), "rows without an adapter changed"
    assert (on_triton[lora_rows].float() - base[lora_rows].float()).abs().max() > 1.0, "adapters did nothing"


def _step() -> ForwardBatch:
    """A fresh step over TOKEN_SLOTS: each step has its own metadata (and its own cached choices)."""
    meta = LoraMetaBuilder(32, MAX_LORAS, "cpu", max_rank=MAX_RANK).build(TOKEN_SLOTS)
    return ForwardBatch(input_ids=None, positions=None, attn=None, kv_cache=None, lora=meta)


X = torch.randn(len(TOKEN_SLOTS), 96, generator=torch.Generator().manual_seed(1))


def test_a_layer_no_resident_adapter_adapts_returns_the_base_output(monkeypatch):
    layer = _qkv_layer(torch.float32)
    for slot in SLOT_RANKS:
        layer.clear_slot(slot)
    choices = _counting(monkeypatch, cpu_tuner, "choose_path")
    batch = _step()
    assert layer.backend.path(layer.base(X), X, batch.lora) is None
    assert torch.equal(layer(X, batch), layer.base(X))
    assert not choices, "a layer without adapters has no path to choose"


def test_layers_with_equal_plans_choose_their_path_once_per_step(monkeypatch):
    first, second = _qkv_layer(torch.float32), _qkv_layer(torch.float32)
    choices = _counting(monkeypatch, cpu_tuner, "choose_path")
    batch = _step()
    first(X, batch)
    second(X, batch)
    assert len(choices) == 1
    first(X, _step())
    assert len(choices) == 2, "a new step chooses again"


@pytest.mark.parametrize("path, kernel", [(CpuLoraPath.DENSE, "lora_dense"), (CpuLoraPath.GATHERED, "lora_gathered"),
                                          (CpuLoraPath.SEGMENTED, "lora_segmented")],
                         ids=["dense", "gathered", "segmented"])
def test_cpu_layer_path_equals_the_loop_and_follows_slot_changes(monkeypatch, path, kernel):
    layer = _qkv_layer(torch.float32)
    calls = _counting(monkeypatch, cpu_lora, kernel)

    def run(on: CpuLoraPath) -> torch.Tensor:
        monkeypatch.setattr(cpu_tuner, "choose_path", lambda *args: CpuLoraRun(on, 1))
        before = len(calls)
        out = layer(X, _step())
        assert len(calls) - before == (on == path), f"{on} step took the wrong path"
        return out

    on_path = run(path)
    rtol, atol = _tolerances(layer, X)
    torch.testing.assert_close(on_path, run(CpuLoraPath.LOOP), rtol=rtol, atol=atol)

    # Replacing slot 1's adapter must show on the next step (the packed copy is rebuilt).
    gen = torch.Generator().manual_seed(2)
    layer.set_slot(1, {"k": SliceDelta(a=torch.randn(4, 96, generator=gen), b=torch.randn(24, 4, generator=gen))})
    after = run(path)
    rtol, atol = _tolerances(layer, X)
    torch.testing.assert_close(after, run(CpuLoraPath.LOOP), rtol=rtol, atol=atol)
    rows = [t for t, slot in enumerate(TOKEN_SLOTS) if slot == 1]
    assert not torch.allclose(after[rows], on_path[rows]), "slot 1 changed but its rows did not"

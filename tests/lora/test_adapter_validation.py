"""Every malformed adapter is refused with a typed error naming it and what is wrong, and no
cache changes."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from data_plane.errors import InvalidAdapter
from data_plane.lora.peft_adapter import AdapterLimits
from data_plane.lora.runtime import LoraRuntime
from data_plane.model import load_model
from tests.lora.conftest import WEIGHTS, RunsCode, edit_config, edit_tensors


@pytest.fixture(scope="module")
def runtime(tiny_base, tiny_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    model = load_model(tiny_base[0], "float32")
    rt = LoraRuntime(model, max_loras=2, max_cpu_loras=3, max_rank=16, max_tokens=64, adapter_roots=(root,),
                     limits=AdapterLimits(max_rank=16, max_bytes=1 << 20))
    shutil.copytree(tiny_adapters / "r8", root / "resident")
    rt.load("resident", "resident")
    rt.cache.acquire("resident")
    rt.cache.release("resident")
    rt.root = root
    return rt


@pytest.fixture
def adapter(runtime, tiny_adapters, request):
    """A fresh copy of a valid rank-8 adapter under the runtime's root, to break."""
    path = runtime.root / request.node.name.replace("[", "_").replace("]", "")
    shutil.copytree(tiny_adapters / "r8", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _refused(runtime, source, match, name="bad"):
    before = (runtime.cache.list(), runtime.cache.slot_usage(), runtime.cache.cpu_usage())
    with pytest.raises(InvalidAdapter, match=match) as info:
        runtime.load(name, str(source))
    assert f"adapter {name!r}" in str(info.value)
    assert (runtime.cache.list(), runtime.cache.slot_usage(), runtime.cache.cpu_usage()) == before
    assert name not in runtime.cache


def test_a_valid_copy_loads(runtime, adapter):
    runtime.load("fine", adapter.name)
    assert runtime.cache.residency("fine").rank == 8
    runtime.cache.unload("fine")


def test_missing_config(runtime, adapter):
    (adapter / "adapter_config.json").unlink()
    _refused(runtime, adapter, "adapter_config.json is missing")


def test_missing_weights(runtime, adapter):
    (adapter / WEIGHTS).unlink()
    _refused(runtime, adapter, "has no adapter_model.safetensors")


def test_truncated_safetensors(runtime, adapter):
    data = (adapter / WEIGHTS).read_bytes()
    (adapter / WEIGHTS).write_bytes(data[: len(data) // 2])
    _refused(runtime, adapter, "truncated or corrupt")


def test_garbage_safetensors(runtime, adapter):
    (adapter / WEIGHTS).write_bytes(b"\xff" * 100)
    _refused(runtime, adapter, "truncated or corrupt")


def test_rank_above_the_pod_limit(runtime, tiny_adapters):
    shutil.copytree(tiny_adapters / "r64pat", runtime.root / "big-rank", dirs_exist_ok=True)
    _refused(runtime, "big-rank", "exceeds this pod's --max-lora-rank 16")


def test_target_module_the_model_lacks(runtime, adapter):
    edit_config(adapter, target_modules=["q_proj", "embed_tokens"])
    _refused(runtime, adapter, r"target modules \['embed_tokens'\] are not projections")


def test_shapes_of_another_base_model(runtime, adapter):
    def widen(t):
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        t[key] = torch.zeros(8, 128)
    edit_tensors(adapter, widen)
    _refused(runtime, adapter, "trained for another base model")


def test_more_layers_than_the_base_model(runtime, adapter):
    def extra_layer(t):
        for key in [k for k in t if ".layers.1." in k]:
            t[key.replace(".layers.1.", ".layers.7.")] = t[key].clone()
    edit_tensors(adapter, extra_layer)
    _refused(runtime, adapter, "base model has only 2 layers")


def test_packed_and_split_names_for_one_projection(runtime, adapter):
    # qkv_proj (Phi-3's packed name) and q_proj would both write the q slice: refused, not summed or overwritten.
    def add_packed(t):
        p = "base_model.model.model.layers.0.self_attn"
        t[f"{p}.qkv_proj.lora_A.weight"] = torch.zeros(8, 64)
        t[f"{p}.qkv_proj.lora_B.weight"] = torch.zeros(64 + 2 * 32, 8)
    edit_tensors(adapter, add_packed)
    _refused(runtime, adapter, r"layers.0 adapts the k/q projection twice, through its packed name")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_weights(runtime, adapter, value):
    def poison(t):
        t["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"][3, 2] = value
    edit_tensors(adapter, poison)
    _refused(runtime, adapter, "down_proj.lora_B contains NaN or Inf")


def test_dora(runtime, adapter):
    edit_config(adapter, use_dora=True)
    _refused(runtime, adapter, "DoRA")


def test_modules_to_save(runtime, adapter):
    edit_config(adapter, modules_to_save=["lm_head"])
    _refused(runtime, adapter, "modules_to_save")


def test_bias_other_than_none(runtime, adapter):
    edit_config(adapter, bias="lora_only")
    _refused(runtime, adapter, "bias='lora_only' is not supported")


def test_unknown_tensor_name(runtime, adapter):
    edit_tensors(adapter, lambda t: t.__setitem__("base_model.model.lm_head.weight", torch.zeros(4, 4)))
    _refused(runtime, adapter, "unknown tensor 'base_model.model.lm_head.weight'")


def test_integer_tensor(runtime, adapter):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    edit_tensors(adapter, lambda t: t.__setitem__(key, torch.zeros(8, 64, dtype=torch.int32)))
    _refused(runtime, adapter, "must be a 2-D floating-point tensor")


def test_missing_lora_b(runtime, adapter):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    edit_tensors(adapter, lambda t: t.pop(key))
    _refused(runtime, adapter, "q_proj has lora_B missing")


def test_rank_disagreeing_with_config(runtime, adapter):
    edit_config(adapter, r=4)
    _refused(runtime, adapter, "has rank 8, but its config says 4")


def test_file_over_the_size_limit(runtime, adapter):
    with open(adapter / WEIGHTS, "ab") as f:
        f.truncate((1 << 20) + 1)
    _refused(runtime, adapter, "over the pod's limit of 1048576")


def test_sha256_mismatch(runtime, adapter):
    with pytest.raises(InvalidAdapter, match="sha256 of its weights is [0-9a-f]{64}, but 0{64} was expected"):
        runtime.read("bad", adapter.name, "0" * 64)


def test_parent_traversal(runtime, adapter):
    _refused(runtime, f"{adapter.name}/../../outside", "outside the adapter roots")


def test_source_name_too_long_for_the_file_system(runtime):
    _refused(runtime, "a" * 300, "File name too long")


@pytest.mark.parametrize("source", ["\x00", "r8\x00", "file:///tmp/a%00b"])
def test_source_with_a_nul_byte(runtime, source):
    # No path may hold one: the OS calls would raise ValueError, which no caller maps to a status.
    _refused(runtime, source, "contains a NUL byte")


def test_absolute_path_elsewhere(runtime, tiny_adapters):
    _refused(runtime, str(tiny_adapters / "r8"), "outside the adapter roots")


def test_file_url_elsewhere(runtime, tiny_adapters):
    _refused(runtime, f"file://{tiny_adapters / 'r8'}", "outside the adapter roots")


def test_directory_symlink_that_escapes(runtime, tiny_adapters):
    link = runtime.root / "escape"
    link.unlink(missing_ok=True)
    os.symlink(tiny_adapters / "r8", link)
    _refused(runtime, "escape", "outside the adapter roots")


def test_weights_symlink_that_escapes(runtime, adapter, tiny_adapters):
    (adapter / WEIGHTS).unlink()
    os.symlink(tiny_adapters / "r1" / WEIGHTS, adapter / WEIGHTS)
    _refused(runtime, adapter, "is a symlink to .* outside the adapter roots")


def test_unsupported_scheme(runtime):
    _refused(runtime, "ftp://host/adapter", "source scheme 'ftp' is not supported")


def test_pickle_is_refused_without_opt_in(runtime, adapter):
    tensors = load_file(adapter / WEIGHTS)
    (adapter / WEIGHTS).unlink()
    torch.save(tensors, adapter / "adapter_model.bin")
    _refused(runtime, adapter, "pickles can run code")


def test_malicious_pickle_is_refused_even_with_opt_in(tiny_base, adapter, runtime):
    (adapter / WEIGHTS).unlink()
    torch.save({"x": RunsCode()}, adapter / "adapter_model.bin")
    model = load_model(tiny_base[0], "float32")
    opted_in = LoraRuntime(model, 2, 2, 16, 64, (runtime.root,), AdapterLimits(max_rank=16, allow_pickle=True))
    with pytest.raises(InvalidAdapter, match="refused by the safe loader"):
        opted_in.load("evil", adapter.name)
    assert not os.path.exists(RunsCode.MARKER)


def test_tensor_pickle_loads_with_opt_in(tiny_base, adapter, runtime):
    tensors = load_file(adapter / WEIGHTS)
    (adapter / WEIGHTS).unlink()
    torch.save(tensors, adapter / "adapter_model.bin")
    model = load_model(tiny_base[0], "float32")
    opted_in = LoraRuntime(model, 2, 2, 16, 64, (runtime.root,), AdapterLimits(max_rank=16, allow_pickle=True))
    assert opted_in.load("pickled", adapter.name).rank == 8

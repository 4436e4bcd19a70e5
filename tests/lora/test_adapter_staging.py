"""What the reader hands over and writes into slots is what peft's files and config say, bit for
bit: A in the serving dtype, B times its scale rounded once; slot pools hold what per-layer writes
would; a value the serving dtype cannot hold is refused by name; and every malformed safetensors
header is refused by name."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import struct
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_plane.errors import InvalidAdapter
from data_plane.lora.runtime import LoraRuntime
from data_plane.model import load_model
from tests.lora.conftest import ADAPTERS, WEIGHTS, edit_tensors

# PEFT module -> (our projection below layers.N, slice); written out here rather than imported.
SLICE_OF = {"q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
            "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", "o"),
            "gate_proj": ("mlp.gate_up_proj", "gate"), "up_proj": ("mlp.gate_up_proj", "up"),
            "down_proj": ("mlp.down_proj", "down")}


def _runtime(tiny_base, root, dtype="float32", max_rank=64):
    return LoraRuntime(load_model(tiny_base[0], dtype), max_loras=2, max_cpu_loras=2, max_rank=max_rank,
                       max_tokens=32, adapter_roots=(root,))


def _expected(adapter_dir, dtype):
    """path -> slice -> (A, B·scale) from safetensors' own reader and the config, as peft defines them."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    expected, tensors = {}, load_file(adapter_dir / WEIGHTS)
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        layer, module = int(key.split(".layers.")[1].split(".")[0]), key.split(".")[-3]
        r = a.shape[0]
        alpha = (config.get("alpha_pattern") or {}).get(module, config["lora_alpha"])
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        kind, s = SLICE_OF[module]
        expected.setdefault(f"layers.{layer}.{kind}", {})[s] = (a.to(dtype), (b.float() * scale).to(dtype))
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_staged_deltas_equal_the_files_weights_and_scale(tiny_base, tiny_adapters, name, dtype):
    rt = _runtime(tiny_base, tiny_adapters, str(dtype).removeprefix("torch."))
    adapter = rt.read(name, name)
    expected = _expected(tiny_adapters / name, dtype)
    got = adapter.deltas
    assert got.keys() == expected.keys()
    for path, slices in expected.items():
        assert got[path].keys() == slices.keys(), path
        for s, (a, b) in slices.items():
            assert got[path][s].a.dtype == dtype and torch.equal(got[path][s].a, a), (path, s)
            assert torch.equal(got[path][s].b, b), (path, s)
    tensors = load_file(tiny_adapters / name / WEIGHTS)
    if dtype == torch.float32:  # the file's own dtype: its tensors as stored, not a copy
        assert adapter.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    else:  # converted once, A and B of the serving dtype
        assert adapter.nbytes == sum(t.numel() for t in tensors.values()) * dtype.itemsize


def _slot_contents(rt, slot):
    """path -> slice -> (A, B) as slot ``slot`` holds them, at each slice's rank."""
    held = {}
    for path, layer in rt.layers.items():
        for s, name in enumerate(layer.slice_names):
            r, lo, hi = layer.host_ranks[s][slot], layer.host_offsets[s], layer.host_offsets[s + 1]
            if r:
                held.setdefault(path, {})[name] = (layer.lora_a[s, slot, :r], layer.lora_b[slot, lo:hi, :r])
    return held


@pytest.mark.parametrize(("file_dtype", "dtype"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                   (torch.float16, torch.bfloat16), (torch.float64, torch.float16)])
def test_slots_hold_the_files_weights_converted_and_b_scaled_once(tiny_base, tiny_adapters, tmp_path, file_dtype,
                                                                  dtype):
    """B goes from the read buffer into its slot: (B.float() * scale) rounded once to the slot's dtype,
    whatever the file's dtype (the 8B case: bfloat16 in, bfloat16 out)."""
    shutil.copytree(tiny_adapters / "r64pat", tmp_path / "cast")
    edit_tensors(tmp_path / "cast", lambda t: t.update({k: v.to(file_dtype) for k, v in t.items()}))
    rt = _runtime(tiny_base, tmp_path, str(dtype).removeprefix("torch."))
    rt.load("cast", "cast")
    held = _slot_contents(rt, rt.cache.acquire("cast"))
    expected = _expected(tmp_path / "cast", dtype)
    assert held.keys() == expected.keys()
    for path, slices in expected.items():
        assert held[path].keys() == slices.keys(), path
        for s, (a, b) in slices.items():
            assert torch.equal(held[path][s][0], a) and torch.equal(held[path][s][1], b), (path, s)


def test_pool_writes_hold_what_per_layer_writes_would(tiny_base, tiny_adapters):
    """Mixed ranks (rank_pattern) and partial targets, through the pools and through set_slot."""
    pooled, per_layer = _runtime(tiny_base, tiny_adapters), _runtime(tiny_base, tiny_adapters)
    for name in ("r1", "r64pat"):  # r64pat replaces r1 in the same slot: no stale ranks may stay
        pooled.load(name, name)
        slot = pooled.cache.acquire(name)
        pooled.cache.release(name)
        if name == "r1":
            pooled.cache.unload(name)
    deltas = pooled.cache.get("r64pat").deltas
    for path, layer in per_layer.layers.items():
        layer.set_slot(slot, deltas.get(path, {}))
    for path, layer in pooled.layers.items():
        other = per_layer.layers[path]
        assert layer.host_ranks == other.host_ranks and torch.equal(layer.ranks, other.ranks), path
        for s in range(len(layer.slice_names)):  # what the kernels read: each slice's first `rank` columns
            r, lo, hi = layer.host_ranks[s][slot], layer.host_offsets[s], layer.host_offsets[s + 1]
            assert torch.equal(layer.lora_a[s, slot, :r], other.lora_a[s, slot, :r]), (path, s)
            assert torch.equal(layer.lora_b[slot, lo:hi, :r], other.lora_b[slot, lo:hi, :r]), (path, s)


def test_adapter_of_some_layers_only(tiny_base, tiny_adapters, tmp_path):
    shutil.copytree(tiny_adapters / "r8", tmp_path / "first-layer")
    edit_tensors(tmp_path / "first-layer", lambda t: [t.pop(k) for k in [k for k in t if ".layers.1." in k]])
    rt = _runtime(tiny_base, tmp_path)
    rt.load("first", "first-layer")
    slot = rt.cache.acquire("first")
    expected = _expected(tmp_path / "first-layer", torch.float32)
    for path, layer in rt.layers.items():
        if path.startswith("layers.1."):
            assert all(ranks[slot] == 0 for ranks in layer.host_ranks) and not layer.ranks[:, slot].any()
            continue
        for s, name in enumerate(layer.slice_names):
            a, b = expected[path][name]
            lo, hi = layer.host_offsets[s], layer.host_offsets[s + 1]
            assert torch.equal(layer.lora_a[s, slot, :8], a) and torch.equal(layer.lora_b[slot, lo:hi, :8], b)


def test_finite_weights_near_the_top_of_the_range_still_load(tiny_base, tiny_adapters, tmp_path):
    shutil.copytree(tiny_adapters / "r8", tmp_path / "huge")

    def huge(t):
        t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][0, :4] = 3e38
    edit_tensors(tmp_path / "huge", huge)
    assert _runtime(tiny_base, tmp_path).read("huge", "huge").rank == 8


def test_a_value_the_serving_dtype_cannot_hold_is_refused(tiny_base, tiny_adapters, tmp_path):
    shutil.copytree(tiny_adapters / "r8", tmp_path / "wide")

    def wide(t):
        t["base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"][2, 5] = 1e6  # over float16's 65504
    edit_tensors(tmp_path / "wide", wide)
    with pytest.raises(InvalidAdapter, match=r"layers\.1\.up_proj\.lora_A contains NaN or Inf"):
        _runtime(tiny_base, tmp_path, "float16").read("wide", "wide")


@pytest.mark.parametrize(("value", "loads"), [(30000.0, True), (40000.0, False)])
def test_a_b_that_overflows_once_scaled_is_refused(tiny_base, tiny_adapters, tmp_path, value, loads):
    """r8's scale is 16 / 8 = 2: 30000 scaled fits float16 (60000 <= 65504), 40000 scaled does not."""
    shutil.copytree(tiny_adapters / "r8", tmp_path / "big")

    def big(t):
        t["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"][7, 3] = value
    edit_tensors(tmp_path / "big", big)
    rt = _runtime(tiny_base, tmp_path, "float16")
    if loads:
        assert rt.read("big", "big").rank == 8
    else:
        with pytest.raises(InvalidAdapter, match=r"layers\.0\.down_proj\.lora_B contains NaN or Inf"):
            rt.read("big", "big")


def test_a_header_without_padding_still_loads(tiny_base, tiny_adapters, tmp_path):
    """Older writers did not align the data to 8 bytes: the tensors are then copied, not viewed."""
    tensors = load_file(tiny_adapters / "r8" / WEIGHTS)
    header, offset = {}, 0
    for key, t in tensors.items():
        header[key] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + 4 * t.numel()]}
        offset += 4 * t.numel()
    text = json.dumps(header).encode()
    text += b" " * ((2 - len(text)) % 4)  # 8 + len(text) is 2 past a multiple of 4
    shutil.copytree(tiny_adapters / "r8", tmp_path / "unaligned")
    data = b"".join(t.contiguous().numpy().tobytes() for t in tensors.values())
    (tmp_path / "unaligned" / WEIGHTS).write_bytes(struct.pack("<Q", len(text)) + text + data)
    rt = _runtime(tiny_base, tmp_path)
    assert torch.equal(rt.read("u", "unaligned").deltas["layers.1.mlp.down_proj"]["down"].a,
                       tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"])


def _write_raw(path, header, data: bytes, header_len: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if header_len is None else header_len) + text + data)


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
ENTRY = {"dtype": "F32", "shape": [8, 64], "data_offsets": [0, 2048]}


@pytest.mark.parametrize(("header", "data", "header_len", "match"), [
    ({KEY: ENTRY}, b"\0" * 2048, 10**9, "its header claims 1000000000 bytes"),
    (b"{not json", b"", None, "its header is not JSON"),
    (b"[1, 2]", b"", None, "its header is not a JSON object"),
    ({KEY: {**ENTRY, "dtype": "F9"}}, b"\0" * 2048, None, "the header entry .* is malformed"),
    ({KEY: {**ENTRY, "shape": [8, -64]}}, b"\0" * 2048, None, "the header entry .* is malformed"),
    ({KEY: {**ENTRY, "shape": [8, 65]}}, b"\0" * 2048, None,
     re.escape(f"'{KEY}' has shape [8, 65] of F32, but 2048 bytes")),
    ({KEY: {**ENTRY, "data_offsets": [8, 2056]}}, b"\0" * 2056, None,
     re.escape(f"'{KEY}' starts at byte 8 of the data, where 0 was expected")),
    ({KEY: ENTRY}, b"\0" * 2049, None, "its tensors need 2048 bytes of data, but the file holds 2049"),
    ({KEY: ENTRY}, b"\0" * 1000, None, "its tensors need 2048 bytes of data, but the file holds 1000"),
])
def test_malformed_safetensors_headers(tiny_base, tiny_adapters, tmp_path, header, data, header_len, match):
    shutil.copytree(tiny_adapters / "r8", tmp_path / "bad")
    _write_raw(tmp_path / "bad" / WEIGHTS, header, data, header_len)
    prefix = "adapter 'bad': adapter_model.safetensors is truncated or corrupt: "
    with pytest.raises(InvalidAdapter, match=prefix + match):
        _runtime(tiny_base, tmp_path).read("bad", "bad")


@pytest.mark.parametrize("size", [0, 3])
def test_weights_file_shorter_than_its_length_field(tiny_base, tiny_adapters, tmp_path, size):
    shutil.copytree(tiny_adapters / "r8", tmp_path / "short")
    (tmp_path / "short" / WEIGHTS).write_bytes(b"\1" * size)
    with pytest.raises(InvalidAdapter, match=f"it is {size} bytes, shorter than the 8-byte header length"):
        _runtime(tiny_base, tmp_path).read("short", "short")


def test_a_corrupt_file_under_a_registered_hash_is_named_by_its_hash(tiny_base, tiny_adapters, tmp_path):
    shutil.copytree(tiny_adapters / "r8", tmp_path / "swapped")
    (tmp_path / "swapped" / WEIGHTS).write_bytes(b"\xff" * 100)
    with pytest.raises(InvalidAdapter, match="sha256 of its weights is [0-9a-f]{64}, but 1{64} was expected"):
        _runtime(tiny_base, tmp_path).read("swapped", "swapped", "1" * 64)


def test_the_sha256_is_the_whole_files(tiny_base, tiny_adapters):
    import hashlib

    expected = hashlib.sha256((tiny_adapters / "r16rs" / WEIGHTS).read_bytes()).hexdigest()
    assert _runtime(tiny_base, tiny_adapters).read("r16rs", "r16rs", expected).sha256 == expected


def test_mixed_dtypes_in_one_file(tiny_base, tiny_adapters, tmp_path):
    shutil.copytree(tiny_adapters / "r8", tmp_path / "mixed")
    tensors = load_file(tmp_path / "mixed" / WEIGHTS)
    tensors = {k: (t.to(torch.bfloat16) if ".lora_B." in k else t) for k, t in tensors.items()}
    save_file(tensors, tmp_path / "mixed" / WEIGHTS)
    got = _runtime(tiny_base, tmp_path).read("mixed", "mixed").deltas
    for path, slices in _expected(tmp_path / "mixed", torch.float32).items():
        for s, (a, b) in slices.items():
            assert torch.equal(got[path][s].a, a) and torch.equal(got[path][s].b, b), (path, s)


def test_a_large_file_is_hashed_chunk_by_chunk_to_the_whole_files_sha256(tiny_base, tiny_adapters, monkeypatch):
    """Files from BACKGROUND_HASH_BYTES up are hashed on another thread as their chunks arrive."""
    import hashlib

    from data_plane.lora import weights_file

    monkeypatch.setattr(weights_file, "BACKGROUND_HASH_BYTES", 0)
    monkeypatch.setattr(weights_file, "CHUNK_BYTES", 4096)  # several chunks, the last one partial
    data = (tiny_adapters / "r64pat" / WEIGHTS).read_bytes()
    assert len(data) % 4096 and len(data) > 3 * 4096
    adapter = _runtime(tiny_base, tiny_adapters).read("r64pat", "r64pat", hashlib.sha256(data).hexdigest())
    assert adapter.sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(("claimed", "match"), [(+1, "got shorter while it was read"),
                                                (-1, "got longer while it was read")])
def test_a_file_that_changes_size_while_read_is_refused(tiny_adapters, monkeypatch, claimed, match):
    """Its size is taken before the read; a file still being written has another size after it."""
    from data_plane.lora import weights_file

    path = tiny_adapters / "r8" / WEIGHTS
    size = path.stat().st_size
    for background in (0, 1 << 30):
        monkeypatch.setattr(weights_file, "BACKGROUND_HASH_BYTES", background)
        with pytest.raises(OSError, match=match):
            weights_file.HashedFile(path, size + claimed)


@pytest.mark.parametrize("name", ["r64pat", "r16rs"])
def test_an_adapter_moved_to_another_buffer_holds_the_same_weights(tiny_base, tiny_adapters, name):
    """What pin_memory does on a GPU pod (page-locked memory needs a GPU; a plain buffer here)."""
    adapter = _runtime(tiny_base, tiny_adapters).read(name, name)
    moved = adapter.with_buffer(torch.empty_like(adapter.buffer))
    end = adapter.buffer.data_ptr() + adapter.nbytes
    for g in moved.groups:
        for run in g.runs:
            for t in (run.a, run.b):
                assert not adapter.buffer.data_ptr() <= t.data_ptr() < end  # nothing left in the old buffer
    expected = adapter.deltas
    assert moved.deltas.keys() == expected.keys()
    for path, slices in expected.items():
        for s, delta in slices.items():
            got = moved.deltas[path][s]
            assert torch.equal(got.a, delta.a) and torch.equal(got.b, delta.b), (path, s)


def test_a_file_in_another_dtype_is_converted_once_into_one_run_per_group(tiny_base, tiny_adapters):
    """The tiny adapters are float32; served in bfloat16 they are staged, each group's layers side by side."""
    adapter = _runtime(tiny_base, tiny_adapters, "bfloat16").read("r8", "r8")
    for g in adapter.groups:
        assert len(g.runs) == 1 and g.runs[0].layers == range(2) and g.runs[0].scale == 1.0
        assert g.runs[0].a.dtype == g.runs[0].b.dtype == torch.bfloat16
        assert g.runs[0].a.is_contiguous() and g.runs[0].b.is_contiguous()


def test_the_header_is_checked_and_grouped_while_the_data_is_still_being_read(tiny_base, tiny_adapters,
                                                                               monkeypatch):
    """A safetensors file's header is read first; the rest arrives on another thread while the entries are
    paired, checked against the model and grouped, and nothing looks at the data before it is all in: here
    the rest is held back until the loader waits for it, so a loader that touched the data first would
    find it missing (and wait forever; the hold gives up after 30 s and fails the load)."""
    from data_plane.lora import peft_adapter, weights_file

    monkeypatch.setattr(weights_file, "BACKGROUND_HASH_BYTES", 0)
    monkeypatch.setattr(weights_file, "CHUNK_BYTES", 4096)
    data = (tiny_adapters / "r64pat" / WEIGHTS).read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    release, seen = threading.Event(), []
    read_into, wait_read, real_group = weights_file._read_into, peft_adapter.wait_read, peft_adapter._group
    real_finite, real_staged = peft_adapter._check_finite, peft_adapter._staged

    def held_back(f, view):  # the data past the header waits until the loader waits for it
        if f.tell() >= header_end:
            assert release.wait(30), "the loader never waited for the data"
        read_into(f, view)

    def waited(name, file):
        release.set()
        wait_read(name, file)
        seen.append("read")

    def group(*args):
        seen.append("grouped")
        return real_group(*args)

    def after_read(real, label):
        def check(*args):
            seen.append(label)
            assert "read" in seen, f"{label} before the data was all in"
            return real(*args)
        return check

    monkeypatch.setattr(weights_file, "_read_into", held_back)
    monkeypatch.setattr(peft_adapter, "wait_read", waited)
    monkeypatch.setattr(peft_adapter, "_group", group)
    monkeypatch.setattr(peft_adapter, "_check_finite", after_read(real_finite, "finite"))
    monkeypatch.setattr(peft_adapter, "_staged", after_read(real_staged, "staged"))
    adapter = _runtime(tiny_base, tiny_adapters).read("r64pat", "r64pat", hashlib.sha256(data).hexdigest())
    assert seen[:2] == ["grouped", "read"] and "finite" in seen
    assert adapter.sha256 == hashlib.sha256(data).hexdigest()
    expected = _expected(tiny_adapters / "r64pat", torch.float32)
    for path, slices in adapter.deltas.items():
        for s, delta in slices.items():
            a, b = expected[path][s]
            assert torch.equal(delta.a, a) and torch.equal(delta.b, b), (path, s)


@pytest.mark.parametrize(("claimed", "match"), [(+1, "got shorter while it was read"),
                                                (-1, "got longer while it was read")])
def test_a_size_change_found_after_the_header_is_raised_when_the_rest_is_waited_for(tiny_adapters, monkeypatch,
                                                                                      claimed, match):
    from data_plane.lora import weights_file

    monkeypatch.setattr(weights_file, "BACKGROUND_HASH_BYTES", 0)
    path = tiny_adapters / "r8" / WEIGHTS
    file = weights_file.HashedFile(path, path.stat().st_size + claimed, lead=weights_file.safetensors_lead)
    with pytest.raises(OSError, match=match):
        file.wait_read()
    with pytest.raises(InvalidAdapter, match=f"cannot read {WEIGHTS}: it {match}"):
        weights_file.wait_read("r8", file)
    with pytest.raises(OSError, match=match):  # and the hash of bytes that are not the file's is never given
        file.sha256()


def test_no_thread_to_read_on_is_a_clear_refusal_and_the_hash_thread_ends(tiny_adapters, monkeypatch):
    from data_plane.lora import weights_file

    monkeypatch.setattr(weights_file, "BACKGROUND_HASH_BYTES", 0)
    started, real_start = [], weights_file._thread.start_new_thread

    def second_fails(fn, args):
        if started:
            raise RuntimeError("can't start new thread")
        started.append(fn)
        return real_start(fn, args)

    monkeypatch.setattr(weights_file._thread, "start_new_thread", second_fails)
    path = tiny_adapters / "r8" / WEIGHTS
    with pytest.raises(InvalidAdapter, match="cannot read .*no thread to read it on"):
        weights_file.open_weights("r8", path, 1 << 30, lead=weights_file.safetensors_lead)
    hasher = started[0].__self__
    assert hasher._hashed.wait(10)  # the hash thread was told the file ended, and did


def test_the_rest_is_being_read_when_the_header_is_handed_over(tiny_adapters, monkeypatch):
    """A new thread needs the GIL to begin, and the caller holds it while it parses the header: the
    constructor returns once the reading thread runs, so that the read overlaps the parse."""
    from data_plane.lora import weights_file

    monkeypatch.setattr(weights_file, "BACKGROUND_HASH_BYTES", 0)
    ran, real_start = [], weights_file._thread.start_new_thread

    def recorded(fn, args):
        def run(*a):
            ran.append(fn.__name__)
            fn(*a)
        return real_start(run, args)

    monkeypatch.setattr(weights_file._thread, "start_new_thread", recorded)
    path = tiny_adapters / "r8" / WEIGHTS
    file = weights_file.HashedFile(path, path.stat().st_size, lead=weights_file.safetensors_lead)
    assert "_read_rest" in ran
    file.wait_read()
    assert file.sha256() == hashlib.sha256(path.read_bytes()).hexdigest()

"""A pod with an FP8 KV cache (--kv-cache-dtype fp8): it serves the base model and adapters with answers close
to the unquantized cache's, sizes its cache at one byte an element, says "+kv-fp8" wherever it reports its
precision (log, GetState, prefix-cache keys), and refuses at start-up what it cannot run: a device without FP8
conversions, a checkpoint's NaN, infinite or non-positive KV scale, naming what to fix. (Invariance over an FP8
cache: test_batch_invariance.py.)"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.processes import free_port
from data_plane.config import DataPlaneConfig, build_parser
from data_plane.errors import ModelLoadError
from data_plane.metrics import PodMetrics
from data_plane.model import kv_scales
from data_plane.model.attention import KV_FP8
from data_plane.pod import build_engine
from tests.data_plane.conftest import ADAPTERS
from tests.data_plane.test_batch_invariance import alone_and_together
from tests.data_plane.test_fp8_pod import serve_and_report


def _config(model_dir, root, **extra) -> DataPlaneConfig:
    return DataPlaneConfig(model=model_dir, dtype="float32", adapter_roots=(root,), max_loras=len(ADAPTERS),
                           max_cpu_loras=len(ADAPTERS), max_lora_rank=32, **{"num_kv_blocks": 16} | extra)


def test_an_fp8_kv_pod_serves_and_says_kv_fp8_wherever_it_reports_its_precision(tiny_pod_files, caplog):
    model_dir, root, _ = tiny_pod_files
    with caplog.at_level(logging.INFO, logger="lorafleet"):
        engine, reported, salts, answers = serve_and_report(_config(model_dir, root, kv_cache_dtype="fp8"))
    assert engine.precision == reported == "float32+kv-fp8"
    assert [len(a) for a in answers] == [2, 2]
    # cached blocks of an FP8-cache pod are never an unquantized pod's, with or without an adapter
    assert len(salts) >= 2 and all(salt.startswith("float32+kv-fp8/") for salt in salts), salts
    cache = engine.runner.kv_cache
    assert cache.k.dtype == KV_FP8 and cache.v.dtype == KV_FP8
    records = {r.getMessage(): r for r in caplog.records}
    assert records["precision"].precision == "float32+kv-fp8"
    assert records["kv cache"].kv_scales == "calibrated" and len(records["kv cache"].k_scales) == 2
    assert list(cache.k_scales) == records["kv cache"].k_scales


def test_an_fp8_kv_cache_holds_four_times_the_blocks_of_a_float32_one(tiny_pod_files):
    from data_plane import pod

    model_dir, root, _ = tiny_pod_files
    blocks = {}
    for kv in ("auto", "fp8"):
        config = _config(model_dir, root, kv_cache_dtype=kv, num_kv_blocks=0, kv_cache_bytes=1 << 20)
        model = pod.load_model(model_dir, "float32")
        if kv == "fp8":
            kv_scales.use_fp8_kv_cache(model, model_dir, list(range(3, 40)))
        blocks[kv] = pod.kv_cache_blocks(model, None, config)  # lora is read on CUDA only
    assert blocks["fp8"] == 4 * blocks["auto"]


def test_answers_over_an_fp8_kv_cache_stay_close_to_the_unquantized_caches(tiny_pod_files):
    # The tiny random model's logits are nearly flat (its 3 most likely tokens within ~0.1 of each other), so
    # e4m3's 1/16 relative error in a key may swap its greedy choice. What must hold: over the same prompt, the
    # k-th most likely first token's log-probability (k = 1..3) moves by at most twice the logits' error.
    model_dir, root, _ = tiny_pod_files
    _, exact, _, _ = alone_and_together(model_dir, root, "float32")
    _, fp8, _, _ = alone_and_together(model_dir, root, "float32", kv_cache_dtype="fp8")
    for ours, theirs in zip((a[0][2] for a in fp8), (a[0][2] for a in exact), strict=True):
        moved = max(abs(a - b) for (_, a), (_, b) in zip(ours, theirs, strict=True))
        assert moved < 0.1, (ours, theirs)
    assert fp8 != exact  # the cache is really quantized


def test_kv_cache_dtype_is_a_flag_of_the_pod():
    assert DataPlaneConfig.from_args(build_parser().parse_args(["--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8"
    assert DataPlaneConfig.from_args(build_parser().parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-cache-dtype", "int8"])
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8"):
        DataPlaneConfig(kv_cache_dtype="e5m2")


def test_a_checkpoints_nan_kv_scale_stops_the_pod_at_start_up_naming_the_tensor(tiny_pod_files, tmp_path):
    model_dir, root, _ = tiny_pod_files
    bad = tmp_path / "bad-kv-scales"
    bad.mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    scales = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(0.05) for i in range(2) for w in "kv"}
    scales["model.layers.1.self_attn.v_scale"] = torch.tensor(float("nan"))
    save_file(load_file(model_dir / "model.safetensors") | scales, bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.v_scale is nan.*--kv-cache-dtype fp8"):
        asyncio.run(asyncio.to_thread(build_engine, _config(bad, root, kv_cache_dtype="fp8"), PodMetrics()))
    # without --kv-cache-dtype fp8 the scales are not read, and the pod starts
    engine = build_engine(_config(bad, root), PodMetrics())
    assert engine.precision == "float32" and engine.runner.kv_cache.k.dtype == torch.float32
    # the command says so in one line and exits with status 2, before it listens
    argv = ["data-plane", "--model", str(bad), "--kv-cache-dtype", "fp8", "--port", str(free_port()),
            "--metrics-port", "0", "--num-kv-blocks", "16"]
    done = subprocess.run([sys.executable, "-c", f"import sys\nfrom cli.main import main\nsys.exit(main({argv!r}))"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "lorafleet data-plane:" in done.stderr and "v_scale is nan" in done.stderr


def test_a_gpu_without_fp8_conversions_is_refused_saying_what_to_do(monkeypatch):
    model = types.SimpleNamespace(head_weight=torch.empty(0, device="meta"))
    assert kv_scales.unsupported(model) == ""  # not CUDA: both CPU backends read an FP8 cache
    model.head_weight = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability 8.0" in kv_scales.unsupported(model) and "8.9+" in kv_scales.unsupported(model)
    monkeypatch.setattr(kv_scales, "unsupported", lambda model: "compute capability 8.0 has no float8_e4m3fn")
    with pytest.raises(ModelLoadError, match="--kv-cache-dtype fp8 cannot run here: compute capability 8.0.*run "
                                             "without --kv-cache-dtype fp8"):
        kv_scales.use_fp8_kv_cache(model, None, [])

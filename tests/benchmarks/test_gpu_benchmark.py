"""benchmarks/gpu.py, the GPU evaluation's pods and kernels, runs end to end in its tiny CPU mode (as
benchmarks/gpu_run.sh --tiny runs it: tests/benchmarks/conftest.py): every section writes finite figures,
and our pod matches transformers + peft in float32. Its parity check fails a pod whose log-probabilities are
off, that ignored the adapter, or, in bfloat16, that applied it at half strength."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_plane.engine.sequence import TokenOut

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


@pytest.fixture(scope="module")
def tiny_run(gpu_run_tiny) -> tuple[subprocess.CompletedProcess, dict]:
    """gpu.py's tiny CPU run, as the one GPU command (benchmarks/gpu_run.sh --tiny) ran it."""
    done, out = gpu_run_tiny
    return done, json.loads((out / "gpu.json").read_text()) if (out / "gpu.json").is_file() else {}


def _finite(*values) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


@pytest.mark.slow
def test_tiny_cpu_run_passes_and_writes_every_section(tiny_run):
    done, data = tiny_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert data["passed"] and not data["failures"]
    meta = data["meta"]
    assert {"device_name", "torch", "triton", "transformers", "date", "command"} <= meta.keys()
    assert "--model tiny" in meta["command"]
    assert _finite(data["copy_gbs"]) and data["copy_gbs"] > 0
    for row in data["lora_kernels"] + data["attention"]:
        assert row["ok"] and _finite(row["ms"], row["floor_ms"], row["ratio"], row["max_err"]), row
    assert {r["rank"] for r in data["lora_kernels"]} == {8, 64}
    for row in data["fused_ops"]:
        assert row["ok"] and _finite(row["fused_ms"], row["torch_ms"], row["floor_ms"], row["max_err"]), row
    assert len({r["op"] for r in data["fused_ops"]}) == 3 and {r["tokens"] for r in data["fused_ops"]} == {1, 4, 64}
    assert {(r["step"], r["tiles"]) for r in data["attention"]} == {
        ("decode", "default"), ("decode", "64-row prefill items"), ("decode", "256-key splits"),
        ("decode", "512-key splits"),
        ("decode, mixed grid", "default"), ("mixed", "default"), ("mixed", "64-row prefill items")}
    runs = data["serving"]
    for label in ("64 adapters", "8 adapters", "base only", "no-LoRA pod, base only", "64 adapters, peft's length",
                  "peft"):
        assert _finite(runs[label]["tok_s"]) and runs[label]["tok_s"] > 0, label
    assert _finite(*(runs[f"decode b1, enforce_eager={eager}"]["itl_p50_ms"] for eager in (False, True)))
    assert _finite(*(runs["open loop"][f"{k}_p{q}_ms"] for k in ("ttft", "itl") for q in (50, 99)))
    # each serving pod reports its graphs and eager steps (a CPU pod runs every step eagerly by design: none counted)
    assert set(data["graphs"]) == {"serving pod", "no-LoRA pod"} and runs["open loop"]["eager_steps"] == 0
    assert all(g["eager_steps"] == 0 and g["capture_s"] is None for g in data["graphs"].values())
    assert "| graphs | serving pod: steps run eagerly" in done.stdout
    # wall time per step on the default (asynchronous) pod and on one started with --no-async-scheduling; a CPU
    # has no device busy time to hold it against
    steps = data["step_time"]
    assert {(r["pod"], r["mix"]) for r in steps} == {(pod, mix) for pod in ("asynchronous", "synchronous")
                                                      for mix in ("base only", "64 adapters")}
    for r in steps:
        assert r["steps"] > 0 and _finite(r["wall_ms"]) and r["wall_ms"] > 0 and r["busy_ms"] is None, r
    assert "| step time | base only: wall time per step, asynchronous / synchronous loop |" in done.stdout
    # the printed table carries the same rows
    assert "| serving | 8 adapters / base only |" in done.stdout and "all checks passed" in done.stdout


@pytest.mark.slow
def test_tiny_cpu_run_matches_transformers_and_peft_with_and_without_graphs(tiny_run):
    _, data = tiny_run
    rows = data["parity"]
    # the run's dtype (bfloat16, as on a GPU) with CUDA graphs on and off, and a float32 pod
    pods = ("bfloat16, enforce_eager=False", "bfloat16, enforce_eager=True", "float32, enforce_eager=False")
    assert {(r["pod"], r["adapter"]) for r in rows} == {(p, a) for p in pods for a in ("base", "r8", "r16-0", "r64")}
    for r in rows:
        assert r["ok"] and r["max_diff"] < r["atol"] and r["greedy_gap"] <= r["atol"], r
        if r["dtype"] == "float32":  # against float32 transformers + peft: no rounding to allow for
            assert r["atol"] == 2e-3 and r["reference_rounding"] is None, r
        else:  # three times what rounding to bfloat16 costs transformers + peft on the same tokens
            assert r["atol"] == max(2e-3, 3 * r["reference_rounding"]), r
        if r["adapter"] != "base":  # the adapters move the log-probabilities far past the tolerance
            assert r["adapter_effect"] > 10 * r["atol"], r


@pytest.mark.slow
def test_tiny_cpu_run_compares_an_fp8_base_with_the_unquantized_one(tiny_run):
    _, data = tiny_run
    rows = data["fp8_matmuls"]
    assert {r["path"] for r in rows} == {"unquantized", "w8a8", "weight-only"}
    for row in rows:  # W8A8 through torch's CPU _scaled_mm here, checked against float64
        assert row["ok"] and _finite(row["ms"], row["floor_ms"], row["max_err"]), row
    pods = data["fp8_pods"]
    assert pods["fp8"]["precision"] == pods["unquantized"]["precision"] + "+fp8"
    assert pods["fp8+kv-fp8"]["precision"] == pods["fp8"]["precision"] + "+kv-fp8"
    for pod in ("unquantized", "fp8", "fp8+kv-fp8"):
        figures = pods[pod]
        assert _finite(figures["decode_b1_ms"], figures["prefill_s"], figures["base only"], figures["8 adapters"])
    assert 0 < pods["agreeing_prefix_tokens"] <= pods["compared_tokens"]
    assert 0 < pods["kv_fp8_agreeing_prefix_tokens"] <= pods["compared_tokens"]
    # the FP8 KV cache's elements are 1 byte: at least twice the FP8 pod's blocks (bfloat16) in the same bytes
    assert pods["fp8+kv-fp8"]["kv_blocks"] >= 1.9 * pods["fp8"]["kv_blocks"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """transformers + peft on the tiny checkpoint in float32 and in bfloat16, with a rank-16 adapter and
    the same adapter at half strength (its lora_alpha halved), and gpu_reference's module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        import gpu_reference
        from gpu_checkpoint import TINY, write_adapters, write_checkpoint

    root = tmp_path_factory.mktemp("checkpoint")
    model_dir = write_checkpoint(root, TINY, torch.float32, "cpu")
    write_adapters(root / "adapters", TINY, {"r16": 16}, torch.float32, "cpu")
    shutil.copytree(root / "adapters" / "r16", root / "adapters" / "r16-half")
    config_path = root / "adapters" / "r16-half" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["lora_alpha"] /= 2
    config_path.write_text(json.dumps(config))
    names = ["r16", "r16-half"]
    return (gpu_reference.Reference(model_dir, root / "adapters", names, "cpu", torch.float32),
            gpu_reference.Reference(model_dir, root / "adapters", names, "cpu", torch.bfloat16), gpu_reference)


PROMPT = [256, 72, 101, 108, 108, 111]


def _greedy(ref, adapter: str | None, new_tokens: int = 6, top: int = 5) -> list[TokenOut]:
    """``ref``'s own greedy tokens with their log-probabilities, as the pod reports them."""
    ids, out = list(PROMPT), []
    for _ in range(new_tokens):
        values, index = ref.logprobs(adapter, ids)[-1].topk(top)
        out.append(TokenOut(int(index[0]), float(values[0]), tuple(zip(index.tolist(), values.tolist(), strict=True))))
        ids.append(int(index[0]))
    return out


def _row(references, adapter: str | None, tokens: list[TokenOut], dtype: torch.dtype = torch.float32) -> dict:
    """The parity row of a pod in ``dtype`` that returned ``tokens`` for ``adapter``."""
    truth, rounded, module = references
    read = module.read
    reading = None if dtype == torch.float32 else read(rounded, adapter, PROMPT, tokens)
    return module.parity_row(adapter, tokens, read(truth, adapter, PROMPT, tokens), reading)


def test_parity_passes_for_the_references_own_tokens(references):
    truth, _, module = references
    for adapter in (None, "r16"):
        row = _row(references, adapter, _greedy(truth, adapter))
        assert row["ok"] and row["atol"] == module.FLOAT32_ATOL and row["max_diff"] < 1e-5, row


def test_parity_fails_a_log_probability_off_by_more_than_the_tolerance(references):
    tokens = _greedy(references[0], None)
    t = tokens[2]
    tokens[2] = TokenOut(t.id, t.logprob, (*t.top[:-1], (t.top[-1][0], t.top[-1][1] + 2 * references[2].FLOAT32_ATOL)))
    assert not _row(references, None, tokens)["ok"]


def test_parity_fails_a_pod_that_ignored_the_adapter(references):
    row = _row(references, "r16", _greedy(references[0], None))
    assert not row["ok"] and row["max_diff"] > row["atol"]


def test_a_bfloat16_pod_is_held_to_what_rounding_costs_transformers_and_fails_an_adapter_at_half_strength(references):
    _, rounded, module = references
    # a pod as exact as transformers in bfloat16 passes, at a tolerance of three times that rounding
    row = _row(references, "r16", _greedy(rounded, "r16"), torch.bfloat16)
    assert row["ok"], row
    assert module.FLOAT32_ATOL < row["atol"] == pytest.approx(module.ROUNDING_FACTOR * row["reference_rounding"])
    # the same pod applying the adapter at half its strength does not
    half = _row(references, "r16", _greedy(rounded, "r16-half"), torch.bfloat16)
    assert not half["ok"] and half["max_diff"] > half["atol"], half


@pytest.mark.slow
def test_skipped_parts_are_left_out_and_the_others_still_run(tmp_path):
    """``--skip`` reruns some parts within a device lease: the skipped ones write nothing, the rest run."""
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu.py"), "--model", "tiny", "--device", "cpu",
                           "--skip", "kernels", "--skip", "parity", "--skip", "peft", "--skip", "fp8", "--out",
                           str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert "lora_kernels" not in data and "parity" not in data and "peft" not in data["serving"]
    assert "fp8_pods" not in data
    assert not any(label.startswith("decode b1") for label in data["serving"])
    assert data["serving"]["64 adapters"]["tok_s"] > 0 and data["serving"]["no-LoRA pod, base only"]["tok_s"] > 0
    # each figure is printed as it is measured, before the table
    assert done.stdout.index("  serving: 64 adapters") < done.stdout.index("| section |")


@pytest.mark.slow
def test_profile_script_reports_both_runs_in_cpu_mode():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_profile.py"), "--model", "tiny", "--device", "cpu",
                           "--new-tokens", "2", "--rows", "3"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for label in ("64 adapters", "base only"):
        line = next(x for x in done.stdout.splitlines() if x.startswith(f"== {label}:"))
        assert "128 tokens" in line and "ms/step wall" in line, line


def test_benchmark_pods_keep_a_given_queue_delay_and_lift_the_default(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_pods import pod_config

    lifted, _ = pod_config(tmp_path, "cpu", "float32")
    kept, _ = pod_config(tmp_path, "cpu", "float32", max_queue_delay=0.5)
    assert lifted.max_queue_delay == 3600.0 and kept.max_queue_delay == 0.5

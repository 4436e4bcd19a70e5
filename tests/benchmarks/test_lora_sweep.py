"""benchmarks/lora_sweep.py, the LoRA tile sweep with the peers side by side, runs end to end in its tiny
CPU mode (the Triton kernels, ours and the peers', under the interpreter), as benchmarks/gpu_run.sh
--tiny runs it (tests/benchmarks/conftest.py): every tile it keeps computed the reference's result, every
layer row has ours and each peer checked and timed, the fused kernel was timed against the split pair
and chosen where it won, and the split shrink and the fused kernel kept a row's bits. A CPU run writes
no tuned table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO.parent / "shared" / "peers"  # the peers' kernels, beside the checkout (never copied into it)


@pytest.mark.slow
def test_tiny_cpu_sweep_tunes_every_projection_and_times_ours_beside_the_peers(gpu_run_tiny):
    done, out = gpu_run_tiny
    tables = {p.name for p in (REPO / "kernels" / "tuned").glob("*.json")}
    peers = PEERS.is_dir()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "lora-sweep.json").read_text())
    assert not data["failures"]
    tuned = data["tuned"]
    for projection in ("qkv", "o", "gate_up", "down"):
        rows = [r for r in data["tuning"] if r["projection"] == projection]
        assert {r["kernel"] for r in rows} == {"shrink", "expand", "fused", "split"}
        assert all(math.isfinite(t) and t > 0 for r in rows for t in r["ms"])
        assert all(r["tokens"][-1] > 16 for r in rows), "a prefill-sized step is timed too"
        # the fused kernel against the split pair, and the choice: a fused entry exactly where it won
        [choice] = [c for c in data["choices"] if c["projection"] == projection]
        assert choice["kernel"] == ("fused" if choice["fused_geomean_ms"] < choice["split_geomean_ms"] else "split")
    # one entry per kernel and shape (o's and down's expands share one: 1 slice of 128 columns), and one
    # fused entry per projection where the fused kernel won
    split_entries = {k: t for k, t in tuned.items() if not k.startswith("fused/")}
    assert len(split_entries) == 7 and all(t["m"] == 16 for t in tuned.values())
    assert len(tuned) - 7 == sum(c["kernel"] == "fused" for c in data["choices"])
    [row] = data["layer"]
    assert math.isfinite(row["ours_ms"]) and math.isfinite(row["ours before_ms"]) and row["floor_ms"] > 0
    assert math.isfinite(row["ours split_ms"]) and math.isfinite(row["ours fused_ms"])
    for peer in ("vllm", "sglang") if peers else ():
        assert math.isfinite(row[f"{peer}_ms"]) and math.isfinite(row[f"ours_over_{peer}"])
    assert {b["projection"] for b in data["bits"]} == {"qkv", "o", "gate_up", "down"}
    for bits in data["bits"]:
        assert bits["split = one program"] and bits["replays unlike one program"] == 0
        assert all(v for k, v in bits.items() if k.startswith("alone = in"))
        assert bits["fused: alone = in 5 tokens"] and all(v for k, v in bits.items() if k.startswith("fused: "))
    assert tables == {"nvidia-h200.json"}, "a CPU run must not write a tuned table"  # only the committed one
    assert not any(out.glob("nvidia-*.json")) and ("--peers" in data["command"]) == peers

"""benchmarks/gpu_run.sh, the GPU evaluation in one command, runs every step in its tiny CPU mode as it
runs them on a GPU machine: the preflight first, the sweep, then gpu.py, each step's figures in $OUT."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_tiny_run_passes_every_step_and_leaves_each_ones_figures(gpu_run_tiny):
    done, out = gpu_run_tiny
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"preflight.log", "lora-sweep.json", "lora-sweep.log", "gpu.json",
                                               "gpu.log"}
    assert "preflight passed" in (out / "preflight.log").read_text()
    order = [done.stdout.index(marker) for marker in ("preflight passed", " shrink: Tiles(", "[   0 s] checkpoint")
             if marker in done.stdout]
    assert len(order) == 3 and order == sorted(order), "preflight, then the sweep, then gpu.py"
    assert json.loads((out / "gpu.json").read_text())["passed"]
    assert "--budget-s" in json.loads((out / "gpu.json").read_text())["meta"]["command"]


def test_an_unknown_argument_stops_it_before_anything_runs(tmp_path):
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--fast"], cwd=REPO,
                          env={"OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "usage: bash benchmarks/gpu_run.sh" in done.stderr
    assert not (tmp_path / "out").exists()

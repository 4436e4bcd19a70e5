"""The GPU evaluation's one command, run once in its tiny CPU mode exactly as on a GPU machine
(benchmarks/gpu_run.sh --tiny): the tests of its steps read what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def gpu_run_tiny(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """(the finished command, the folder its figures went to)."""
    out = tmp_path_factory.mktemp("gpu-run")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--tiny"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    return done, out

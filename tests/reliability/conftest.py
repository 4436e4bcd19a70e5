"""The reliability suite: its sizes (short in ``make test``, the full sizes under ``make reliability``),
one pod shared by the load, leak, hostile-input and auth tests, and the recorder of measured figures."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.processes import FLEET_BASE_MODEL, TOKEN, ControlPlaneProcess, PodProcess, RedisServer
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir

# The leak tests cycle through more adapters than the pod's caches hold: COPIES copies of each demo adapter.
COPIES = 2
POD_MAX_LORAS, POD_MAX_CPU_LORAS, POD_MAX_RANK = 2, 4, 16
POD_MAX_ADAPTER_BYTES = 32 << 20
POD_MAX_WAITING = 32


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How long and how much each test runs. ``LORAFLEET_RELIABILITY=full`` selects the sizes the
    reliability table reports; each size can also be set on its own (``LORAFLEET_RELIABILITY_<FIELD>``)."""

    load_seconds: float = 15.0
    load_streams: int = 64
    cache_cycles: int = 300
    pod_cycles: int = 150
    fuzz_examples: int = 15

    @classmethod
    def from_env(cls) -> Sizes:
        base = cls(load_seconds=60.0, cache_cycles=2000, pod_cycles=2000, fuzz_examples=100) \
            if os.environ.get("LORAFLEET_RELIABILITY") == "full" else cls()
        changes = {}
        for f in dataclasses.fields(cls):
            value = os.environ.get(f"LORAFLEET_RELIABILITY_{f.name.upper()}")
            if value:
                changes[f.name] = type(getattr(base, f.name))(value)
        return dataclasses.replace(base, **changes)

    def __post_init__(self) -> None:
        if self.load_seconds <= 0 or min(self.load_streams, self.cache_cycles, self.pod_cycles,
                                         self.fuzz_examples) < 1:
            raise ValueError(f"reliability sizes must be positive: {self}")


class Results:
    """Writes one JSON file per scenario into ``directory`` (``LORAFLEET_RELIABILITY_RESULTS``), which
    ``python -m tests.reliability.report`` turns into docs/RELIABILITY.md. A scenario is recorded only
    once its assertions have held."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def record(self, area: str, scenario: str, tried: str, held: str, **figures) -> None:
        slug = re.sub(r"[^a-z0-9]+", "-", f"{area}-{scenario}".lower()).strip("-")
        (self.directory / f"{slug}.json").write_text(json.dumps(
            {"area": area, "scenario": scenario, "tried": tried, "held": held, "figures": figures}, indent=1))


@pytest.fixture(scope="session")
def sizes() -> Sizes:
    return Sizes.from_env()


@pytest.fixture(scope="session")
def results(tmp_path_factory) -> Results:
    directory = os.environ.get("LORAFLEET_RELIABILITY_RESULTS")
    return Results(Path(directory) if directory else tmp_path_factory.mktemp("reliability-results"))


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory) -> Path:
    """The demo adapters, and COPIES copies of each under other names (``pirate-1``, ...)."""
    root = tmp_path_factory.mktemp("reliability-adapters")
    for name in DEMO_ADAPTERS:
        shutil.copytree(demo_adapter_dir(name), root / name)
        for i in range(1, COPIES + 1):
            shutil.copytree(demo_adapter_dir(name), root / f"{name}-{i}")
    return root


@pytest.fixture(scope="session")
def hostile_root(tmp_path_factory) -> Path:
    """An adapter root the hostile-input tests fill with malformed adapters while the pod runs."""
    return tmp_path_factory.mktemp("hostile-adapters")


def pod_args(adapter_root: Path, hostile_root: Path) -> tuple[str, ...]:
    return ("--max-loras", str(POD_MAX_LORAS), "--max-cpu-loras", str(POD_MAX_CPU_LORAS),
            "--max-lora-rank", str(POD_MAX_RANK), "--max-adapter-bytes", str(POD_MAX_ADAPTER_BYTES),
            "--max-num-seqs", "16", "--max-waiting", str(POD_MAX_WAITING), "--num-kv-blocks", "256",
            "--adapter-root", str(adapter_root), "--adapter-root", str(hostile_root))


@pytest.fixture(scope="session")
def pod(demo_model_dir, adapter_root, hostile_root, tmp_path_factory):
    """One CPU pod on the demo model: 2 adapter slots, 4 CPU entries, rank at most 16, no pickles."""
    process = PodProcess(tmp_path_factory.mktemp("reliability-pod"), *pod_args(adapter_root, hostile_root),
                         name="reliable", token=TOKEN)
    try:
        yield process.start()
    finally:
        process.stop()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    """A control plane over its own redis-server, with no pods."""
    workdir = tmp_path_factory.mktemp("reliability-cp")
    redis = RedisServer(workdir)
    redis.start()
    token_file = workdir / "token"
    token_file.write_text(TOKEN + "\n")
    cp = ControlPlaneProcess(redis.url, token_file, workdir, "cp", base_model=FLEET_BASE_MODEL)
    try:
        yield cp.start()
    finally:
        cp.stop()
        redis.kill()


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")

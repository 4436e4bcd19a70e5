"""What benchmarks/gpu.py found: one table of figures against their floors or references and the issue's
targets, the notes on what was left out and why, the checks that failed, and the same as JSON with the
device, the versions, the date and the command line."""

from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

# the table's sections, in order
ORDER = ("parity", "copy", "LoRA", "attention", "fused ops", "decode b1", "serving", "latency", "step time", "graphs",
         "fp8")

def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name from /proc/cpuinfo."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "CPU")
    except OSError:
        return platform.processor() or "CPU"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def _commit(repo: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


@dataclass
class Report:
    device: str
    repo: Path
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    sections: dict = field(default_factory=dict)  # section -> its figures, as written to the JSON
    phases: dict[str, float] = field(default_factory=dict)  # part -> seconds from the start when it ended
    started: float = field(default_factory=time.perf_counter)
    out: Path | None = None  # where the JSON goes, rewritten after every part: a run cut short keeps its figures
    model: str = ""
    budget_s: float | None = None  # no part starts after this many seconds (a device lease's window)
    skipped: list[str] = field(default_factory=list)  # parts left out for want of budget

    def run(self, part: str, fn: Callable, *args, always: bool = False):
        """Runs one part of the evaluation, saying when it starts and recording when it ends. An exception
        becomes a failed check and the parts after it still run: one broken part must not cost the others'
        device time. A part due after ``budget_s`` is skipped (unless ``always``), and a note says so.
        Returns ``fn``'s result, None when it raised or was skipped."""
        elapsed = time.perf_counter() - self.started
        if self.budget_s is not None and elapsed > self.budget_s and not always:
            self.skipped.append(part)
            self.notes.append(f"{part}: skipped, {elapsed:.0f} s in (past --budget-s {self.budget_s:.0f})")
            print(f"[{elapsed:4.0f} s] {part}: skipped (past --budget-s)", flush=True)
            return None
        print(f"[{elapsed:4.0f} s] {part}", flush=True)
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - reported as a failed check, and in full on stderr
            traceback.print_exc()
            self.check(False, f"{part}: {type(e).__name__}: {e}")
            return None
        finally:
            self.phases[part] = round(time.perf_counter() - self.started, 1)
            if self.out is not None:
                self.write_json(self.out, self.model, quiet=True)

    def row(self, section: str, what: str, value: float | str, unit: str = "", against: str = "",
            ratio: float | None = None, target: str = "") -> None:
        """One line of the table: ``value`` (in ``unit``), what it is measured against, their ratio and
        the issue's target for it."""
        self.rows.append({"section": section, "what": what, "value": value, "unit": unit, "against": against,
                          "ratio": ratio, "target": target})
        # at once too: a run stopped at a time limit still leaves every figure it reached in its output
        print(f"  {section}: {what}: {_cell(value)} {unit}" + (f" ({_cell(ratio)} of {against}, target {target})"
                                                             if ratio is not None else ""), flush=True)

    def check(self, ok: bool, what: str) -> None:
        """A correctness check: a failed one is listed and makes the run exit non-zero."""
        if not ok:
            self.failures.append(what)
            print(f"  FAILED: {what}", flush=True)

    @property
    def passed(self) -> bool:
        return not self.failures

    def print_table(self) -> None:
        print("\n| section | measurement | value | against | ratio | target |\n|---|---|---|---|---|---|")
        for r in sorted(self.rows, key=lambda r: ORDER.index(r["section"])):
            value = f"{_cell(r['value'])} {r['unit']}".strip()
            print(f"| {r['section']} | {r['what']} | {value} | {r['against']} | {_cell(r['ratio'])} | {r['target']} |")
        for note in self.notes:
            print(f"\nnote: {note}")
        print("\n" + ("all checks passed" if self.passed else "FAILED: " + "; ".join(self.failures)))
        print(f"{time.perf_counter() - self.started:.0f} s in all; parts ended at " +
              ", ".join(f"{part} {t:.0f} s" for part, t in self.phases.items()))

    def write_json(self, path: Path, model: str, quiet: bool = False) -> None:
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "command": " ".join([Path(sys.executable).name, *sys.argv]), "model": model, "device": self.device,
                "device_name": device_name(self.device), "python": platform.python_version(),
                "torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
                "peft": _version("peft"), "commit": _commit(self.repo)}
        if self.device == "cuda":
            meta["cuda"] = torch.version.cuda
        data = {"meta": meta, **self.sections, "table": self.rows, "notes": self.notes, "failures": self.failures,
                "passed": self.passed, "skipped": self.skipped, "phases_s": self.phases}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, allow_nan=True))
        if not quiet:
            print(f"\nwrote {path}")

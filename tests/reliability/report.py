"""Turns the reliability suite's results (one JSON file per scenario) into docs/RELIABILITY.md:
``python -m tests.reliability.report RESULTS_DIR OUTPUT.md``."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

AREAS = ["Faults", "Load", "Leaks", "Hostile input", "Auth"]


def _figure(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def render(results: list[dict]) -> str:
    results = sorted(results, key=lambda r: (AREAS.index(r["area"]) if r["area"] in AREAS else len(AREAS),
                                             r["scenario"]))
    lines = [
        "# Reliability",
        "",
        "What `tests/reliability/` tried against real processes on 127.0.0.1 (data-plane pods on the demo",
        "model, a control plane, a redis-server with `appendfsync always`) and what held. Every figure",
        "below was measured by the run that wrote this file: `make reliability` runs the suite at full",
        "size and regenerates it; `make test` runs the same tests at reduced sizes.",
        "",
        f"Run on {platform.machine()}, {platform.system()}, Python {platform.python_version()}, CPU pods.",
        "",
        "| area | scenario | what was tried | what held | figures |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        figures = "<br>".join(f"{k.replace('_', ' ')}: {_figure(v)}" for k, v in r["figures"].items())
        lines.append(f"| {r['area']} | {r['scenario']} | {r['tried']} | {r['held']} | {figures} |")
    missing = [a for a in AREAS if a not in {r["area"] for r in results}]
    if missing:
        lines += ["", f"Not run: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.reliability.report RESULTS_DIR OUTPUT.md", file=sys.stderr)
        return 2
    results = [json.loads(p.read_text()) for p in sorted(Path(argv[0]).glob("*.json"))]
    if not results:
        print(f"no results in {argv[0]}: run the reliability suite with LORAFLEET_RELIABILITY_RESULTS set",
              file=sys.stderr)
        return 1
    Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
    Path(argv[1]).write_text(render(results))
    print(f"wrote {argv[1]} from {len(results)} scenarios")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

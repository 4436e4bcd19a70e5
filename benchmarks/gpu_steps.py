"""Wall time per step against the device's busy time, on the default (asynchronous) pod and on one started
with ``--no-async-scheduling``: benchmarks/gpu.py's "step time" rows (issue 39).

A closed batch of each mix (base only, 64 distinct adapters) runs twice on a pod: unprofiled, for the wall
time from the first request to the last token over the steps the engine ran meanwhile (its
``lorafleet_engine_step_seconds`` count: the batch's prefill steps are in the window too), then the same
shape under torch.profiler, for the device's busy time over its steps: the kernels'
and copies' own device time summed, which is the time the device was busy where they do not overlap (one
stream). Where the loop hides the host behind the device, wall time per step is the busy time; a
synchronous loop adds the host's time between steps. On a CPU the device is the host: only the wall
times are measured, and the asynchronous loop has nothing to overlap with.
"""

from __future__ import annotations

from collections.abc import Callable

from gpu_pods import Request, drive

from data_plane.engine.engine import Engine


def steps_run(engine: Engine) -> int:
    """The steps the engine has run (completed) since it started."""
    for metric in engine.metrics.step_duration.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                return int(sample.value)
    return 0


async def step_times(engine: Engine, device: str, label: str, requests: Callable[[int], list[Request]],
                     new_tokens: int) -> dict:
    """One mix's figures on a running pod (its adapters resident): ``requests(seed)`` gives the closed batch;
    a short warm-up, the unprofiled run, then the profiled one (CUDA only)."""
    await drive(engine, f"{label}, warm-up", requests(600), 4)
    before = steps_run(engine)
    run = await drive(engine, label, requests(601), new_tokens)
    steps = steps_run(engine) - before
    figures = {"mix": label, "steps": steps, "tokens": run.tokens, "wall_ms": run.wall_s * 1e3 / steps,
               "busy_ms": None, "profiled_steps": None}
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        before = steps_run(engine)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            await drive(engine, f"{label}, profiled", requests(602), new_tokens)
        profiled = steps_run(engine) - before
        busy_us = sum(event.self_device_time_total for event in prof.key_averages())
        if busy_us > 0:  # else the profiler saw no device activity: the ratio is left out, not divided by 0
            figures |= {"busy_ms": busy_us / 1e3 / profiled, "profiled_steps": profiled}
    return figures


def step_rows(report, rows: list[dict], batch: int, new_tokens: int) -> None:
    """The table's rows: each pod's wall time per step against its device's busy time (the issue's target
    for the default pod: 1.05), and the asynchronous pod's wall time per step over the synchronous one's."""
    by_pod = {(r["pod"], r["mix"]): r for r in rows}
    for r in rows:
        what = f"{r['pod']} loop, {r['mix']}, batch {batch}, {new_tokens} new tokens: wall time per step"
        if r["busy_ms"] is None:
            report.row("step time", what, r["wall_ms"], "ms", "device busy not measured (CPU)")
        else:
            report.row("step time", what, r["wall_ms"], "ms", f"device busy {r['busy_ms']:.3g} ms a step",
                       r["wall_ms"] / r["busy_ms"], "<= 1.05" if r["pod"] == "asynchronous" else "")
    for mix in dict.fromkeys(r["mix"] for r in rows):
        overlapped, synchronous = by_pod.get(("asynchronous", mix)), by_pod.get(("synchronous", mix))
        if overlapped and synchronous:
            report.row("step time", f"{mix}: wall time per step, asynchronous / synchronous loop",
                       overlapped["wall_ms"] / synchronous["wall_ms"], "", "two pods", None, "<= 1")

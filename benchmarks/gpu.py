"""The whole GPU evaluation of a pod in one command and one process (issue 23, item 7):

    python benchmarks/gpu.py [--model 8b|tiny] [--device cuda|cpu] [--dtype D] [--out PATH]

1. a random-weight checkpoint of the model's shape (``8b``: Llama-3-8B, vocabulary 128,256) with a
   byte-level tokenizer, PEFT adapters of rank 8 and 64 and 64 of rank 16 (gpu_checkpoint.py);
2. correctness first: our pod's greedy tokens and log-probabilities, base and rank-8/16/64 adapters in
   one batch, against transformers (+ peft) in float32 teacher-forced on the same tokens: a pod in the
   run's dtype, and, where that is narrower, a float32 pod held to 2e-3; a
   bfloat16/float16 pod is held to three times what transformers' own rounding to its dtype costs on the
   same tokens, a tolerance that an adapter applied at half strength fails (gpu_reference.py);
3. the device's copy bandwidth, measured here: the floor for everything after it;
4. LoRA shrink+expand at batch 1/16/64 and the unified paged attention (decode steps at batch 1/16/64,
   alone and in a mixed-step grid, and mixed steps with a prefill chunk) against the time to read the
   bytes they touch (gpu_kernels.py);
   The fused layer ops (residual add + RMSNorm, rotary, SiLU x up) at the same batches and a prefill
   chunk, against the torch ops they replace and their bytes floor (gpu_fused.py);
5. decode at batch 1 against the weight-read floor, with CUDA graphs on and off (``enforce_eager``);
6. serving 8 and 64 distinct rank-16 adapters at batch 64 against base-only on the same pod, a pod
   started without LoRA (``--no-enable-lora``), and transformers + peft on the 64-adapter mix; (LoRA step -
   base step) against the time to read those adapters once (gpu_pods.py); each serving pod's CUDA graphs
   (how many, capture time and memory) and its eager steps (steps no captured shape fits: 0 expected);
7. TTFT and inter-token latency p50/p99 of an open-loop (Poisson) load at 70% of the measured capacity, and
   the steps it ran eagerly;
   wall time per step against the device's busy time (torch.profiler) at batch 64, base only and 64
   adapters, on the serving pod (asynchronous scheduling, the default) and on a pod started with
   ``--no-async-scheduling`` for this measurement alone (gpu_steps.py);
8. an FP8 base (``--quantization fp8``) against the bf16 one: W8A8, weight-only and bf16 matmuls per projection
   shape, then decode at batch 1, prefill, base-only and 8-adapter throughput on two pods (gpu_fp8.py).

Prints one table and writes it with every figure as JSON after every part (``--out``; default
$OUT/gpu-MODEL-DEVICE.json when $OUT is set, else under benchmarks/results/). Exits 1 when a check fails
(parity, a kernel against its reference, a section that raised), 3 when every part that ran passed but
``--budget-s`` left some out. ``--model tiny --device cpu`` runs every section at tiny sizes on a
CPU in about 25 s, the Triton kernels under the interpreter (tests/benchmarks/test_gpu_benchmark.py).
What a bare GPU machine must be given first: benchmarks/gpu_wheels.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the packages and tests.tolerances, where lorafleet is not installed (a GPU machine)

from gpu_checkpoint import (  # noqa: E402 (benchmarks/, beside this script)
    BOS_ID,
    EOS_ID,
    PRESETS,
    adapter_bytes,
    decode_weight_bytes,
    write_adapters,
    write_checkpoint,
)
from gpu_clock import Clock, copy_bandwidth, percentile  # noqa: E402
from gpu_pods import (  # noqa: E402
    drive,
    free_device,
    graph_figures,
    pod_config,
    poisson_arrivals,
    prompts,
    running_pod,
)
from gpu_report import Report  # noqa: E402
from gpu_steps import step_rows, step_times  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    batch: int  # requests of a closed serving run, all at once (the serving pods' max_num_seqs)
    prompt_tokens: int
    new_tokens: int  # per request of a serving run
    parity_tokens: int
    decode_tokens: int  # of the batch-1 decode
    peft_new_tokens: int  # per row of the peft batch, and of the lorafleet run it is compared with
    open_requests: int
    rounds: int  # interleaved rounds of the serving runs
    kernel_ranks: tuple[int, ...]
    kernel_batches: tuple[int, ...]
    kernel_max_loras: int
    attention_context: int
    copy_bytes: int
    iters: int
    warmup: int
    step_tokens: int = 32  # per request of the step-time runs (gpu_steps.py)


SIZES = {
    "8b": Sizes(64, 128, 128, 8, 64, 16, 256, 2, (8, 16, 64), (1, 16, 64), 64, 2048, 1 << 30, 50, 5),
    # The Triton interpreter runs a launch per program in Python: few ranks, few tokens, few slots.
    "tiny": Sizes(64, 16, 16, 6, 16, 4, 32, 1, (8, 64), (1, 4), 4, 64, 64 << 20, 1, 0, step_tokens=6),
}
SERVING = [f"r16-{i}" for i in range(64)]  # 64 distinct rank-16 adapters
RANKS = {"r8": 8, "r64": 64, **dict.fromkeys(SERVING, 16)}
PARITY = [(None, 0), ("r8", 8), ("r16-0", 16), ("r64", 64)]  # (adapter, rank): one mixed batch
PARTS = ("kernels", "parity", "serving", "no-lora", "sync", "fp8", "peft")
STEP_MIXES = {"base only": [None], "64 adapters": SERVING}  # the step-time runs' mixes (gpu_steps.py)
OPEN_LOOP_LOAD = 0.7  # open-loop arrival rate over the closed 64-adapter run's request rate


def kernels(report: Report, clock: Clock, config: dict, dtype: torch.dtype, sizes: Sizes, gbs: float) -> None:
    from gpu_kernels import attention_rows, lora_rows  # after TRITON_INTERPRET is set

    rows = lora_rows(clock, config, dtype, list(sizes.kernel_ranks), list(sizes.kernel_batches),
                     sizes.kernel_max_loras, gbs)
    report.sections["lora_kernels"] = rows
    for r in rows:
        report.check(r["ok"], f"LoRA rank {r['rank']} batch {r['batch']}: off the reference by {r['max_err']:.3g} "
                              f"> {r['atol']:.3g}")
        report.row("LoRA", f"shrink+expand, one layer, rank {r['rank']}, batch {r['batch']}, {r['adapters']} "
                           f"distinct adapter(s), {r['timed']}", r["ms"], "ms", f"bytes floor {r['floor_ms']:.3g} ms",
                   r["ratio"], "<= 1.15")
    rows = attention_rows(clock, config, dtype, list(sizes.kernel_batches), sizes.attention_context, 16, gbs)
    report.sections["attention"] = rows
    for r in rows:
        step = f"{r['step']}, batch {r['batch']}" + (f" + a {r['chunk']}-token chunk" if r["chunk"] else "")
        step += f", {r['tiles']} tiles" if r["tiles"] != "default" else ""
        report.check(r["ok"], f"attention {step}: off the reference by {r['max_err']:.3g} > {r['atol']:.3g}")
        target = "" if (r["step"], r["tiles"]) != ("decode", "default") else "<= 3" if r["batch"] == 1 else "<= 1.15"
        report.row("attention", f"paged attention (one launch), {step}, one layer, context {r['context']}, "
                                f"{r['tokens']} tokens, {r['timed']}", r["ms"], "ms",
                   f"bytes floor {r['floor_ms']:.3g} ms", r["ratio"], target)


def fused(report: Report, clock: Clock, config: dict, dtype: torch.dtype, sizes: Sizes, gbs: float) -> None:
    from gpu_fused import fused_rows  # after TRITON_INTERPRET is set

    rows = fused_rows(clock, config, dtype, [*sizes.kernel_batches, sizes.attention_context], gbs)
    report.sections["fused_ops"] = rows
    for r in rows:
        report.check(r["ok"], f"fused {r['op']}, {r['tokens']} tokens: off the reference by {r['max_err']:.3g} "
                              f"> {r['atol']:.3g}")
        report.row("fused ops", f"{r['op']}, one layer, {r['tokens']} tokens, {r['timed']}", r["fused_ms"], "ms",
                   f"bytes floor {r['floor_ms']:.3g} ms; torch ops {r['torch_ms']:.3g} ms ({r['speedup']:.2f}x)",
                   r["ratio"])


def summary(runs: list) -> dict:
    """Throughput (median over rounds) and inter-token p50 (over every gap of every round) of a mix's runs."""
    itl = [g for r in runs for g in r.itl]
    return {"tok_s": statistics.median(r.throughput for r in runs), "itl_p50_ms": percentile(itl, 0.5) * 1e3,
            "requests": len(runs[0].outputs), "new_tokens": runs[0].tokens // len(runs[0].outputs), "rounds": len(runs)}


async def parity_pod(report: Report, args, sizes: Sizes, model_dir: Path, root: Path, floor_ms: float,
                     found: dict, eager: bool, dtype: str) -> None:
    """A small pod in ``dtype``, CUDA graphs on or off (``enforce_eager``): the parity batch (kept for
    transformers), then, in the run's own dtype, decode at batch 1."""
    small = dict(max_loras=3, max_cpu_loras=3, max_lora_rank=64, max_num_seqs=4, adapter_roots=(root,))
    config, absent = pod_config(model_dir, args.device, dtype, enforce_eager=eager, **small)
    if absent and eager:
        report.notes.append("DataPlaneConfig has no enforce_eager: decode with CUDA graphs off not measured")
        return
    async with running_pod(config) as engine:
        parity = await drive(engine, "parity", parity_requests(sizes), sizes.parity_tokens, logprobs=20)
        found["parity"][f"{dtype}, enforce_eager={eager}"] = (dtype, parity.outputs)
        if dtype != args.dtype:
            return
        run = await drive(engine, "decode", [(prompts(1, sizes.prompt_tokens, BOS_ID, 2)[0], None)],
                          sizes.decode_tokens)
    itl = statistics.median(run.itl) * 1e3
    found["runs"][f"decode b1, enforce_eager={eager}"] = {"itl_p50_ms": itl, "floor_ms": floor_ms}
    report.row("decode b1", f"inter-token p50, enforce_eager={eager}", itl, "ms",
               f"weight-read floor {floor_ms:.3g} ms", itl / floor_ms, "" if eager else "<= 1.2")


def requests(count: int, sizes: Sizes, mix: list[str | None], seed: int) -> list[tuple[list[int], str | None]]:
    """``count`` requests over the adapters of ``mix`` in turn, each with its own prompt: prompts differ from
    run to run (``seed``), so that the pod's prefix cache never serves one run from an earlier one."""
    return [(p, mix[i % len(mix)]) for i, p in enumerate(prompts(count, sizes.prompt_tokens, BOS_ID, seed))]


async def serving_pod(args, sizes: Sizes, model_dir: Path, root: Path, found: dict) -> None:
    """The serving pod (64 slots of rank 16): closed batches of each mix in interleaved rounds, the run the
    peft batch is compared with, then the open-loop load."""
    mixes = {"64 adapters": SERVING, "8 adapters": SERVING[:8], "base only": [None]}
    config, _ = pod_config(model_dir, args.device, args.dtype, max_loras=64, max_cpu_loras=64, max_lora_rank=16,
                           max_num_seqs=sizes.batch, adapter_roots=(root,))
    async with running_pod(config) as engine:
        await drive(engine, "adapter loads", requests(64, sizes, SERVING, seed=10), 2)
        runs: dict[str, list] = {label: [] for label in mixes}
        for r in range(sizes.rounds + 1):  # the first round, shorter and untimed, meets every step shape once
            for k, (label, mix) in enumerate(mixes.items()):
                run = await drive(engine, label, requests(sizes.batch, sizes, mix, seed=100 + 10 * r + k),
                                  sizes.new_tokens if r else 4)
                if r:
                    runs[label].append(run)
        for label, rs in runs.items():
            found["runs"][label] = summary(rs)
        found["runs"]["64 adapters, peft's length"] = summary([await drive(
            engine, "as peft", requests(sizes.batch, sizes, SERVING, seed=200), sizes.peft_new_tokens)])
        for label, mix in STEP_MIXES.items():
            found["steps"].append({"pod": "asynchronous", **await step_times(
                engine, args.device, label, lambda seed, mix=mix: requests(sizes.batch, sizes, mix, seed),
                sizes.step_tokens)})
        rate = OPEN_LOOP_LOAD * found["runs"]["64 adapters"]["tok_s"] / sizes.new_tokens
        eager_before = engine.snapshot().eager_steps
        run = await drive(engine, "open loop", requests(sizes.open_requests, sizes, SERVING, seed=300),
                          sizes.new_tokens, arrivals=poisson_arrivals(sizes.open_requests, rate))
        found["graphs"]["serving pod"] = graph_figures(engine)
    found["runs"]["open loop"] = {"rate_rps": rate, "requests": sizes.open_requests, "new_tokens": sizes.new_tokens,
                                  "eager_steps": found["graphs"]["serving pod"]["eager_steps"] - eager_before,
                                  **{f"{k}_p{q}_ms": percentile(getattr(run, k), q / 100) * 1e3
                                     for k in ("ttft", "itl") for q in (50, 99)}}


async def no_lora_pod(args, sizes: Sizes, model_dir: Path, found: dict) -> None:
    """The same base-only load on a pod started without LoRA (no LoRA layers, no slots)."""
    config, _ = pod_config(model_dir, args.device, args.dtype, max_num_seqs=sizes.batch, enable_lora=False)
    async with running_pod(config) as engine:
        await drive(engine, "warm-up", requests(sizes.batch, sizes, [None], seed=400), 4)
        runs = [await drive(engine, "no LoRA", requests(sizes.batch, sizes, [None], seed=401 + r), sizes.new_tokens)
                for r in range(sizes.rounds)]
        found["graphs"]["no-LoRA pod"] = graph_figures(engine)
    found["runs"]["no-LoRA pod, base only"] = summary(runs)


async def sync_pod(args, sizes: Sizes, model_dir: Path, root: Path, found: dict) -> None:
    """The serving pod's config started with ``--no-async-scheduling``, for the step-time runs alone."""
    config, _ = pod_config(model_dir, args.device, args.dtype, max_loras=64, max_cpu_loras=64, max_lora_rank=16,
                           max_num_seqs=sizes.batch, adapter_roots=(root,), async_scheduling=False)
    async with running_pod(config) as engine:
        await drive(engine, "adapter loads", requests(64, sizes, SERVING, seed=10), 2)
        for label, mix in STEP_MIXES.items():
            found["steps"].append({"pod": "synchronous", **await step_times(
                engine, args.device, label, lambda seed, mix=mix: requests(sizes.batch, sizes, mix, seed),
                sizes.step_tokens)})


def graph_rows(report: Report, graphs: dict) -> None:
    """Each serving pod's CUDA graphs (count, capture time and memory) and the steps it ran eagerly."""
    for pod, g in graphs.items():
        report.row("graphs", f"{pod}: steps run eagerly (no captured shape fits them), warm-up and every run",
                   g["eager_steps"], "", "", None, "0")
        if g["capture_s"] is None:
            report.notes.append(f"{pod}: no CUDA graphs captured (CPU, or --enforce-eager)")
            continue
        report.row("graphs", f"{pod}: capture of {g['graphs']} graphs, time", g["capture_s"], "s", "", None, "<= 30")
        report.row("graphs", f"{pod}: capture of {g['graphs']} graphs, device memory", g["capture_mib"], "MiB", "",
                   None, "<= 2048")


def serving_rows(report: Report, runs: dict, sizes: Sizes, adapters_ms: float) -> None:
    """The serving and latency rows of the table, from the runs that completed."""
    for label in ("64 adapters", "8 adapters", "base only", "no-LoRA pod, base only"):
        if label in runs:
            report.row("serving", f"{label}, batch {sizes.batch}, {sizes.new_tokens} new tokens",
                       runs[label]["tok_s"], "tok/s")

    def compare(what: str, a: str, b: str, key: str, against: str, target: str, unit: str = "") -> None:
        if a in runs and b in runs:
            value = runs[a][key] / runs[b][key] if key == "tok_s" else runs[a][key] - runs[b][key]
            reference = 1.0 if key == "tok_s" else adapters_ms
            report.row("serving", what, value, unit, against, value / reference, target)

    compare("8 adapters / base only", "8 adapters", "base only", "tok_s", "same pod", ">= 0.93")
    compare("base only: LoRA pod / no-LoRA pod", "base only", "no-LoRA pod, base only", "tok_s", "two pods", ">= 0.99")
    compare("LoRA step - base step (inter-token p50, 64 adapters)", "64 adapters", "base only", "itl_p50_ms",
            f"adapters read once {adapters_ms:.3g} ms", "<= 1.15", "ms")
    if "peft" in runs and "64 adapters, peft's length" in runs:
        ours, peft = runs["64 adapters, peft's length"]["tok_s"], runs["peft"]["tok_s"]
        report.row("serving", f"transformers + peft, 64 adapters, batch {sizes.batch}, {sizes.peft_new_tokens} new "
                   "tokens", peft, "tok/s", f"lorafleet {ours:.0f} tok/s", ours / peft, ">= 10")
    if "open loop" in runs:
        o = runs["open loop"]
        report.row("latency", f"open loop, {o['rate_rps']:.3g} req/s x {o['requests']}: TTFT p50 / p99",
                   f"{o['ttft_p50_ms']:.3g} / {o['ttft_p99_ms']:.3g}", "ms", "", None, "p99 <= 1000")
        report.row("latency", "open loop: inter-token p50 / p99", f"{o['itl_p50_ms']:.3g} / {o['itl_p99_ms']:.3g}",
                   "ms", "p99 / p50", o["itl_p99_ms"] / o["itl_p50_ms"], "<= 1.5")
        report.row("latency", "open loop: steps run eagerly", o["eager_steps"], "", "", None, "0")


def parity_requests(sizes: Sizes) -> list[tuple[list[int], str | None]]:
    """The parity batch: base and each adapter of PARITY, one prompt each."""
    return [(p, adapter) for p, (adapter, _) in zip(prompts(len(PARITY), sizes.prompt_tokens, BOS_ID, seed=1),
                                                    PARITY, strict=True)]


def parity_check(report: Report, args, sizes: Sizes, model_dir: Path, root: Path, found: dict) -> None:
    """Every parity pod's tokens read by transformers + peft in float32, and, for the pods in a narrower
    dtype, by transformers + peft in that dtype too (how far its own rounding takes it: their tolerance)."""
    from gpu_reference import FLOAT32_ATOL, ROUNDING_FACTOR, Reference, parity_row, read

    report.sections["parity"] = []
    report.check(bool(found["parity"]), "parity: no pod gave tokens to check")
    if not found["parity"]:
        return
    asked, names = parity_requests(sizes), [adapter for adapter, _ in PARITY if adapter]

    def readings(dtype: torch.dtype, pods: dict) -> dict:
        free_device(args.device)  # the pods' KV caches and CUDA graphs before a reference's weights
        reference = Reference(model_dir, root, names, args.device, dtype)
        return {pod: [read(reference, adapter, prompt, tokens) for (prompt, adapter), tokens in zip(asked, outputs,
                                                                                                 strict=True)]
                for pod, (_, outputs) in pods.items()}

    truths = readings(torch.float32, found["parity"])
    narrow = {pod: o for pod, o in found["parity"].items() if o[0] != "float32"}
    rounded = readings(getattr(torch, args.dtype), narrow) if narrow else {}
    free_device(args.device)
    for pod, (dtype, outputs) in found["parity"].items():
        for k, ((adapter, rank), tokens) in enumerate(zip(PARITY, outputs, strict=True)):
            r = {"pod": pod, "dtype": dtype, "rank": rank,
                 **parity_row(adapter, tokens, truths[pod][k], rounded[pod][k] if pod in rounded else None)}
            report.sections["parity"].append(r)
            effect = "" if r["adapter_effect"] is None else f", adapter moves it {r['adapter_effect']:.3g}"
            why = (f"{ROUNDING_FACTOR} x transformers' own {dtype} rounding {r['reference_rounding']:.3g}"
                   if r["reference_rounding"] is not None else f"{FLOAT32_ATOL:g} in float32")
            report.check(r["ok"], f"parity {r['adapter']} ({pod}): |diff| {r['max_diff']:.3g}, greedy gap "
                                  f"{r['greedy_gap']:.3g}{effect}, atol {r['atol']:.3g}")
            report.row("parity", f"{r['adapter']} ({pod}): max |diff log-prob| against float32, {r['tokens']} tokens",
                       r["max_diff"], "", f"atol {r['atol']:.3g} ({why}){effect}", r["max_diff"] / r["atol"], "<= 1")


def peft_batch(args, sizes: Sizes, model_dir: Path, root: Path, found: dict) -> None:
    """transformers + peft in the run's dtype on the 64-adapter mix, one generate over the batch."""
    from gpu_reference import Reference

    free_device(args.device)
    peft = Reference(model_dir, root, SERVING, args.device, getattr(torch, args.dtype))
    wall = peft.generate(requests(sizes.batch, sizes, SERVING, seed=200), sizes.peft_new_tokens, EOS_ID)
    found["runs"]["peft"] = {"tok_s": sizes.batch * sizes.peft_new_tokens / wall, "wall_s": wall}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="8b", choices=list(PRESETS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on a CPU")
    parser.add_argument("--out", type=Path, help="the JSON file (default: $OUT/gpu-MODEL-DEVICE.json or "
                                                 "benchmarks/results/gpu-MODEL-DEVICE-DATE.json)")
    parser.add_argument("--skip", action="append", default=[], choices=PARTS,
                        help="leave a part out (repeatable), to rerun the others within a device lease")
    parser.add_argument("--budget-s", type=float, help="start no part after this many seconds (its figures so far "
                                                       "are kept; the table says which parts were skipped)")
    parser.add_argument("--only", action="append", default=[], choices=PARTS,
                        help="run only these parts (repeatable): every other part is skipped")
    args = parser.parse_args()
    if args.only:
        args.skip = sorted(set(args.skip) | (set(PARTS) - set(args.only)))
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here; run --device cpu (with --model tiny) instead")
    if args.out is None:
        name = f"gpu-{args.model}-{args.device}"
        args.out = (Path(os.environ["OUT"]) / f"{name}.json" if os.environ.get("OUT")
                    else REPO / "benchmarks" / "results" / f"{name}-{time.strftime('%Y-%m-%d')}.json")
    return args


def prepare(tmp: Path, preset: dict, dtype: torch.dtype, device: str) -> tuple[Path, Path]:
    """The model directory and the adapter root."""
    return write_checkpoint(tmp, preset, dtype, device), write_adapters(tmp / "adapters", preset, RANKS, dtype, device)


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are defined (imported)
        torch.set_num_threads(args.threads)
    sizes, dtype, preset = SIZES[args.model], getattr(torch, args.dtype), PRESETS[args.model]
    report = Report(args.device, REPO, out=args.out, model=args.model, budget_s=args.budget_s)
    with tempfile.TemporaryDirectory(prefix="lorafleet-gpu-") as tmp:
        written = report.run("checkpoint and adapters", prepare, Path(tmp), preset, dtype, args.device)
        clock = Clock(torch.device(args.device), sizes.iters, sizes.warmup)
        gbs = report.sections["copy_gbs"] = copy_bandwidth(clock, sizes.copy_bytes)
        report.row("copy", f"device-to-device copy of {sizes.copy_bytes >> 20} MiB (read + write)", gbs, "GB/s")
        if "kernels" not in args.skip:
            report.run("kernels", kernels, report, clock, preset, dtype, sizes, gbs)
            report.run("fused ops", fused, report, clock, preset, dtype, sizes, gbs)
        del clock  # its L2-flush buffer: the pods' KV caches take what the device has free
        if written is not None:
            model_dir, root = written
            floor_ms = decode_weight_bytes(preset, dtype) / gbs / 1e6
            found = {"parity": {}, "runs": {}, "graphs": {}, "steps": []}
            report.sections["serving"] = found["runs"]
            report.sections["graphs"] = found["graphs"]
            report.sections["step_time"] = found["steps"]
            # One event loop per pod: a stopped engine stays referenced until its loop is gone (the cancelled
            # step loop's traceback), and the next pod's KV cache takes what the device has free.
            if "parity" not in args.skip:  # correctness first: the pods, then transformers + peft reads them
                for eager in (False, True):
                    report.run(f"parity pod, enforce_eager={eager}", asyncio.run,
                               parity_pod(report, args, sizes, model_dir, root, floor_ms, found, eager, args.dtype))
                if args.dtype != "float32":  # the strict check: a float32 pod, no rounding to allow for
                    report.run("parity pod, float32", asyncio.run,
                               parity_pod(report, args, sizes, model_dir, root, floor_ms, found, False, "float32"))
                report.run("parity against transformers + peft", parity_check, report, args, sizes, model_dir, root,
                           found)
            if "serving" not in args.skip:
                report.run("serving pod", asyncio.run, serving_pod(args, sizes, model_dir, root, found))
            if "no-lora" not in args.skip:
                report.run("no-LoRA pod", asyncio.run, no_lora_pod(args, sizes, model_dir, found))
            if "sync" not in args.skip:
                report.run("synchronous pod", asyncio.run, sync_pod(args, sizes, model_dir, root, found))
            if "fp8" not in args.skip:
                from gpu_fp8 import section as fp8_section

                report.run("fp8 base", fp8_section, report, args, sizes, preset, model_dir, root, gbs)
            if "peft" not in args.skip:
                report.run("transformers + peft", peft_batch, args, sizes, model_dir, root, found)
            adapters_ms = 64 * adapter_bytes(preset, 16, dtype) / gbs / 1e6
            report.run("table", serving_rows, report, found["runs"], sizes, adapters_ms, always=True)
            report.run("graphs table", graph_rows, report, found["graphs"], always=True)
            report.run("step time table", step_rows, report, found["steps"], sizes.batch, sizes.step_tokens,
                       always=True)
    if args.device == "cpu":
        report.notes.append("CPU run: the Triton kernels ran under the interpreter (their times are not speeds), "
                            "and CUDA graphs do not apply")
    report.print_table()
    report.write_json(args.out, args.model)
    sys.exit(1 if not report.passed else 3 if report.skipped else 0)  # 3: all that ran passed, some parts did not run


if __name__ == "__main__":
    main()

"""An FP8 base against the bf16 base it was quantized from (issue 43): benchmarks/gpu.py's ``fp8`` part.

1. matmuls: each projection shape of one layer at decode batches and a prefill chunk, in the pod's dtype
   (``F.linear``), W8A8 (``quantization.w8a8``: per-token e4m3 activations, ``torch._scaled_mm``) and
   weight-only (``quantization.weight_only``), each checked first against a float64 reference on the same
   operands, timed against the time to read the weights it multiplies by;
2. two pods of the same config on the same checkpoint, one unquantized and one with ``--quantization fp8``:
   decode at batch 1 (inter-token p50), a closed batch's prefill (time to the batch's last first token),
   base-only and 8-adapter closed batches (throughput), and the FP8 pod's greedy tokens against the bf16
   pod's on the same prompts (how many agree: FP8 rounds the weights, so some differ);
3. a third pod, the FP8 one with an FP8 KV cache too (``--kv-cache-dtype fp8``, scales calibrated at start-up),
   the same figures in one round: its KV-cache blocks against the FP8 pod's (1 byte an element: twice as many),
   decode at batch 1 and throughput over e4m3 keys and values, and its greedy tokens against the bf16 pod's.

Targets (issue 43): decode at batch 1 <= 0.6x the bf16 step; base-only batch throughput >= 1.6x bf16;
8 adapters / base >= 0.9 on the FP8 base. On a CPU the FP8 pod dequantizes its weights at load (its
figures are the bf16 pod's computed on FP8 weights), and the matmuls' times say nothing of a GPU's.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_checkpoint import BOS_ID  # benchmarks/, beside gpu.py
from gpu_clock import Clock
from gpu_pods import drive, pod_config, prompts, running_pod

from data_plane.model.config import ModelConfig
from data_plane.model.quantization import FP8_MAX, choose_compute, quantize, w8a8, weight_only
from tests.tolerances import eps, sum_atol

ADAPTERS = [f"r16-{i}" for i in range(8)]


def _reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, quantized_x: bool) -> torch.Tensor:
    """``x @ (w8 · scale)ᵀ`` in float64, ``x`` first rounded per row to e4m3 where ``quantized_x`` (by its
    absmax / 448 in float32, as ``w8a8`` promises)."""
    if quantized_x:
        s = x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX
        x = (x.float() / s).to(w8.dtype).double() * s.double()
    return x.double() @ (w8.double() * scale.double()[:, None]).T


def _paths(x: torch.Tensor, w: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> dict:
    """path -> (its matmul of ``x``, bytes per weight it reads, whether it rounds ``x`` to e4m3; None: the
    unquantized matmul, not checked)."""
    return {"unquantized": (lambda: F.linear(x, w), w.element_size(), None),
            "w8a8": (lambda: w8a8(x, w8, scale, None), 1, True),
            "weight-only": (lambda: weight_only(x, w8, scale, None), 1, False)}


def matmul_rows(clock: Clock, config: dict, dtype: torch.dtype, token_counts: list[int], gbs: float) -> list[dict]:
    """One row per (projection, token count, path): checked against the float64 reference, then timed."""
    c, dev = ModelConfig.from_dict(config), clock.device
    shapes = {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o": (c.hidden_size, c.q_size),
              "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
    compute, reason = choose_compute(dev, dtype)
    rows = []
    for name, (out, k) in shapes.items():
        w = (0.02 * torch.randn(out, k, device=dev)).to(dtype)  # [out, in]
        w8, scale = quantize(w)  # [out, in] e4m3, [out]
        for tokens in token_counts:
            x = torch.randn(tokens, k, device=dev).to(dtype)  # [tokens, in]
            magnitude = (x.double().abs() @ (w8.double().abs() * scale.double()[:, None]).T).max().item()
            atol = sum_atol(k, magnitude) + 2 * eps(dtype) * magnitude  # float32 sums, one rounding to dtype
            for path, (fn, weight_bytes, quantized_x) in _paths(x, w, w8, scale).items():
                row = {"projection": name, "tokens": tokens, "path": path, "shape": [out, k]}
                try:
                    got = fn()
                except (RuntimeError, NotImplementedError) as e:  # W8A8 where the device has no FP8 matmul
                    rows.append(row | {"ok": path == "w8a8", "error": str(e).splitlines()[0]})
                    continue
                err = 0.0 if quantized_x is None else (got.double() - _reference(x, w8, scale, quantized_x)
                                                       ).abs().max().item()
                ms, how = clock.replay_ms(fn)
                floor = out * k * weight_bytes / gbs / 1e6
                rows.append(row | {"ms": ms, "floor_ms": floor, "ratio": ms / floor, "timed": how, "max_err": err,
                                   "atol": atol, "ok": bool(err <= atol)})
    for row in rows:
        row["pod_compute"] = f"{compute.value} ({reason})"
    return rows


async def _pod_runs(model_dir: Path, root: Path, device: str, dtype: str, quantization: str, batch: int,
                    prompt_tokens: int, new_tokens: int, decode_tokens: int, rounds: int,
                    kv_cache_dtype: str = "auto") -> dict:
    fields = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != "auto" else {}
    config, _ = pod_config(model_dir, device, dtype, quantization=quantization, max_loras=len(ADAPTERS),
                           max_cpu_loras=len(ADAPTERS), max_lora_rank=16, max_num_seqs=batch, adapter_roots=(root,),
                           **fields)
    found: dict = {}
    async with running_pod(config) as engine:
        found["precision"] = engine.precision
        found["kv_blocks"] = engine.limits.num_kv_blocks
        mixes = {"base only": [None], "8 adapters": ADAPTERS}
        await drive(engine, "warm-up", [(p, ADAPTERS[i % 8]) for i, p in enumerate(
            prompts(batch, prompt_tokens, BOS_ID, seed=500))], 2)
        runs: dict[str, list] = {label: [] for label in mixes}
        for r in range(rounds):
            for k, (label, mix) in enumerate(mixes.items()):
                reqs = [(p, mix[i % len(mix)]) for i, p in enumerate(prompts(batch, prompt_tokens, BOS_ID,
                                                                            seed=510 + 10 * r + k))]
                runs[label].append(await drive(engine, label, reqs, new_tokens))
        for label, rs in runs.items():
            found[label] = statistics.median(run.throughput for run in rs)
        # prefill: a closed batch's prompts, the time until every request has its first token
        found["prefill_tokens"] = batch * prompt_tokens
        prefills = [await drive(engine, "prefill", [(p, None) for p in prompts(batch, prompt_tokens, BOS_ID,
                                                                              seed=600 + r)], 1)
                    for r in range(rounds)]
        found["prefill_s"] = min(max(run.ttft) for run in prefills)
        decode = await drive(engine, "decode", [(prompts(1, prompt_tokens, BOS_ID, 2)[0], None)], decode_tokens)
        found["decode_b1_ms"] = statistics.median(decode.itl) * 1e3
        same = await drive(engine, "agreement", [(p, None) for p in prompts(8, prompt_tokens, BOS_ID, seed=700)],
                           new_tokens)
        found["tokens"] = [[t.id for t in out] for out in same.outputs]
    return found


async def pod_rows(model_dir: Path, root: Path, device: str, dtype: str, batch: int, prompt_tokens: int,
                   new_tokens: int, decode_tokens: int, rounds: int) -> dict:
    """The unquantized pod's figures, the FP8 pod's and the FP8 pod's with an FP8 KV cache (one round), each a
    dict (see ``_pod_runs``), and how many of the latter two's greedy tokens equal the unquantized pod's (up to
    the first that differs, per request)."""
    found = {}
    for label, quantization, kv, runs in (("unquantized", "auto", "auto", rounds), ("fp8", "fp8", "auto", rounds),
                                          ("fp8+kv-fp8", "fp8", "fp8", 1)):
        found[label] = await _pod_runs(model_dir, root, device, dtype, quantization, batch, prompt_tokens,
                                       new_tokens, decode_tokens, runs, kv)
    unquantized = found["unquantized"].pop("tokens")
    for label, key in (("fp8", "agreeing_prefix_tokens"), ("fp8+kv-fp8", "kv_fp8_agreeing_prefix_tokens")):
        agree = 0
        for a, b in zip(unquantized, found[label].pop("tokens"), strict=True):
            agree += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        found[key] = agree
    found["compared_tokens"] = 8 * new_tokens
    return found


def section(report, args, sizes, preset: dict, model_dir: Path, root: Path, gbs: float) -> None:
    """The FP8 part of gpu.py: the matmul rows, then the two pods, into ``report``'s table and JSON."""
    dtype = getattr(torch, args.dtype)
    clock = Clock(torch.device(args.device), sizes.iters, sizes.warmup)
    rows = matmul_rows(clock, preset, dtype, [*sizes.kernel_batches, sizes.attention_context], gbs)
    del clock  # its L2-flush buffer: the pods' KV caches take what the device has free
    report.sections["fp8_matmuls"] = rows
    timed = {}
    for r in rows:
        what = f"{r['projection']} {r['shape']}, {r['tokens']} tokens"
        if "error" in r:
            report.notes.append(f"fp8 matmul {what}, {r['path']}: not run here ({r['error']})")
            continue
        report.check(r["ok"], f"fp8 matmul {what}, {r['path']}: off the reference by {r['max_err']:.3g} > "
                              f"{r['atol']:.3g}")
        timed.setdefault(what, {})[r["path"]] = r
    for what, paths in timed.items():  # one line a shape: the FP8 paths beside the unquantized matmul
        plain, fp8 = paths["unquantized"], paths.get("w8a8") or paths["weight-only"]
        others = ", ".join(f"{p} {r['ms']:.3g} ms" for p, r in paths.items() if r is not fp8)
        report.row("fp8", f"matmul {what}, {fp8['path']}, {fp8['timed']}", fp8["ms"], "ms",
                   f"{others}; FP8 weight-read floor {fp8['floor_ms']:.3g} ms", fp8["ms"] / plain["ms"])
    found = asyncio.run(pod_rows(model_dir, root, args.device, args.dtype, sizes.batch, sizes.prompt_tokens,
                                 sizes.new_tokens, sizes.decode_tokens, max(1, sizes.rounds)))
    report.sections["fp8_pods"] = found
    bf16, fp8 = found["unquantized"], found["fp8"]
    report.check(fp8["precision"] == bf16["precision"] + "+fp8",
                 f"fp8 pod reports precision {fp8['precision']!r} beside {bf16['precision']!r}")
    where = f"{fp8['precision']} pod / {bf16['precision']} pod"
    report.row("fp8", "decode b1: inter-token p50", fp8["decode_b1_ms"], "ms",
               f"{where} ({bf16['decode_b1_ms']:.3g} ms)", fp8["decode_b1_ms"] / bf16["decode_b1_ms"], "<= 0.6")
    report.row("fp8", f"prefill of {fp8['prefill_tokens']} prompt tokens (batch {sizes.batch}): last first token",
               fp8["prefill_s"] * 1e3, "ms", f"{where} ({bf16['prefill_s'] * 1e3:.3g} ms)",
               fp8["prefill_s"] / bf16["prefill_s"])
    report.row("fp8", f"base only, batch {sizes.batch}, {sizes.new_tokens} new tokens", fp8["base only"], "tok/s",
               f"{where} ({bf16['base only']:.3g} tok/s)", fp8["base only"] / bf16["base only"], ">= 1.6")
    report.row("fp8", "8 adapters / base only, FP8 base", fp8["8 adapters"] / fp8["base only"], "", "same pod",
               fp8["8 adapters"] / fp8["base only"], ">= 0.9")
    report.row("fp8", "greedy tokens as the unquantized pod's, up to each request's first difference",
               found["agreeing_prefix_tokens"], "tokens", f"{found['compared_tokens']} compared")
    kv = found["fp8+kv-fp8"]
    report.check(kv["precision"] == fp8["precision"] + "+kv-fp8",
                 f"FP8-KV pod reports precision {kv['precision']!r} beside {fp8['precision']!r}")
    where = f"{kv['precision']} pod / {fp8['precision']} pod"
    report.row("fp8", "FP8 KV cache: KV-cache blocks", kv["kv_blocks"], "blocks", f"{where} ({fp8['kv_blocks']})",
               kv["kv_blocks"] / fp8["kv_blocks"], ">= 1.9")
    report.row("fp8", "FP8 KV cache: decode b1, inter-token p50", kv["decode_b1_ms"], "ms",
               f"{where} ({fp8['decode_b1_ms']:.3g} ms)", kv["decode_b1_ms"] / fp8["decode_b1_ms"])
    report.row("fp8", f"FP8 KV cache: base only, batch {sizes.batch} (1 round)", kv["base only"], "tok/s",
               f"{where} ({fp8['base only']:.3g} tok/s)", kv["base only"] / fp8["base only"])
    report.row("fp8", "FP8 KV cache: greedy tokens as the unquantized pod's, up to each request's first difference",
               found["kv_fp8_agreeing_prefix_tokens"], "tokens", f"{found['compared_tokens']} compared")

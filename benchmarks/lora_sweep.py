"""Tiles for the LoRA kernels measured on this GPU, ours against the bytes floor and against vLLM's and
SGLang's kernels on the same problems, and the checks that the split shrink keeps a row's bits:

    python benchmarks/lora_sweep.py [--peers PATH] [--budget-s 240] [--tiny --device cpu]

Problems: the four LoRA projections of a decoder layer (``--model``: Llama-3-8B's shapes), every slot
padded to the rank timed (8, 16, 64), token t on adapter t % 64 (up to 64 distinct adapters), as
benchmarks/gpu_kernels.py. For each projection and rank:

1. shrink tiles, then expand tiles: every candidate (all in blocks of 16 rows, see
   kernels/lora_tuning.py) is checked against ``kernels.reference`` once, then timed (CUDA graph
   replay, L2 flushed) at each decode token count (up to SPLIT_TOKENS: the shrink split one program per
   chunk) and at a prefill-sized count; the one with the least geometric-mean time wins, one set for
   every step of the shape, so a row runs the same instructions in any step;
2. the split pair (the two winners, one after the other) against shrink and expand fused in one launch
   (kernels/lora_fused.py, each of its ``candidates``), timed alike at the same counts: where the best
   fused tiles have the lesser geometric mean, the shape's table entry ``fused/...`` holds them and the
   layers run the fused kernel in every step of that shape; else there is none and they run the pair;
3. the winners are merged into ``kernels/tuned/<device>.json`` (read by the launchers at start-up;
   shapes this run did not reach keep their entries, a fused entry of a shape measured again goes where
   the pair won) and written beside the JSON report.

Then one layer (all four projections) per rank and token count: ours as the layers run it (the table's
choice of kernel and tiles), ours split (the pair with the tuned tiles), ours fused (each projection's
best fused tiles), ours with the tiles the kernels had before the split shrink (one program over all of
in_features), each peer, and the time to read the layer's bytes once at this device's copy bandwidth;
``ours / peer`` rows. Last, the bits, for every projection and rank with the kernel and tiles the
layers now take, and with the best fused tiles: a decode row alone, beside 255 others, and inside a
prefill-sized step; the split shrink against the one-program shrink, replayed (200 times for the first
shape: the last program to arrive adds the partials, and a broken ordering would show as a mismatch).

``--tiny --device cpu`` runs all of it at tiny sizes under Triton's interpreter in about a minute
(tests/benchmarks/test_lora_sweep.py); its times say nothing about speed. Figures are printed and
written to the JSON as measured (``--out``), so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_checkpoint import PRESETS  # noqa: E402 (benchmarks/, beside this script)
from gpu_clock import Clock, copy_bandwidth  # noqa: E402

SIZES = {  # ranks, decode token counts, prefill token count, adapters, timed runs, warm-up runs
    "full": ((16, 64, 8), (1, 16, 64, 256), 1024, 64, 30, 3),  # rank 16 first: the serving runs' rank
    "tiny": ((8,), (1, 5), 40, 4, 1, 0),
}


def candidates(kind: str, rank: int, dtype: torch.dtype, tiny: bool):
    """Tiles to try, all in blocks of 16 rows (one kind of tensor-core instruction: kernels/lora_tuning.py).
    Shrink: K steps x chunks x rank tiles; expand: column tiles, warps and column tiles a program walks;
    fused: ``kernels.lora_fused.candidates`` (column groups, in_features steps, warps)."""
    from kernels.lora_launch import Tiles

    rank_tile = min(64, max(16, 1 << (rank - 1).bit_length()))
    if kind == "shrink":
        if tiny:
            return [Tiles(m=16, n=16, k=64, chunk=64), Tiles(m=16, n=16, k=64, chunk=128)]
        steps = (32, 64) if dtype == torch.float32 else (64, 128, 256)
        out = [Tiles(m=16, n=16, k=k, chunk=k * c) for k in steps for c in (1, 2) if k * c >= 64]
        out += [Tiles(m=16, n=16, k=128, chunk=256, num_warps=2)]
        return out + ([Tiles(m=16, n=rank_tile, k=128, chunk=256)] if rank_tile > 16 else [])
    if kind == "fused":
        from kernels.lora_fused import candidates as fused_candidates

        if tiny:
            return [Tiles(m=16, n=32, k=64), Tiles(m=16, n=32, k=64, col_tiles=2)]
        return fused_candidates(rank, dtype)
    if tiny:
        return [Tiles(m=16, n=32, k=rank_tile), Tiles(m=16, n=32, k=rank_tile, col_tiles=2)]
    out = [Tiles(m=16, n=n, k=rank_tile) for n in (32, 64, 128)] + [Tiles(m=16, n=64, k=rank_tile, num_warps=2)]
    return out + [Tiles(m=16, n=n, k=rank_tile, col_tiles=4) for n in (64, 128)]  # fewer programs, each reading more


class Problem:
    """One projection's slots (every slot of rank ``rank``) and a step of ``tokens`` tokens."""

    def __init__(self, in_features: int, widths: tuple[int, ...], rank: int, tokens: int, adapters: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        from kernels.lora_meta import LoraMetaBuilder, partial_rows

        # One generator per tensor: row t of x and y0 is the same at any token count, the weights too.
        gens = [torch.Generator(device="cpu").manual_seed(seed * 4 + i) for i in range(4)]
        s, out = len(widths), sum(widths)
        self.offsets = [0, *torch.tensor(widths).cumsum(0).tolist()]
        self.token_slots = [t % adapters for t in range(tokens)]
        self.x = torch.randn(tokens, in_features, generator=gens[0]).to(device, dtype)  # [tokens, in]
        self.y0 = torch.randn(tokens, out, generator=gens[1]).to(device, dtype)  # [tokens, out]
        self.y = self.y0.clone()
        a = torch.randn(s, adapters, rank, in_features, generator=gens[2]) / in_features**0.5
        self.a = a.to(device, dtype)  # [S, adapters, rank, in]
        b = torch.randn(adapters, out, rank, generator=gens[3]) / rank**0.5
        self.b = b.to(device, dtype)  # [adapters, out, rank]
        self.ranks = torch.full((s, adapters), rank, dtype=torch.int32, device=device)  # [S, adapters]
        self.slice_offsets = torch.tensor(self.offsets, dtype=torch.int32, device=device)
        builder = LoraMetaBuilder(tokens, adapters, device, max_rank=rank, max_slices=s,
                                  partial_rows=partial_rows([(s, in_features)]))
        self.meta = builder.build(self.token_slots)
        self.buf = self.meta.buffer[:s, :tokens]  # [S, tokens, rank] float32

    def shrink(self, tiles) -> None:
        from kernels.lora_shrink import lora_shrink

        lora_shrink(self.x, self.a, self.ranks, self.meta, self.buf, tiles=tiles)

    def expand(self, tiles) -> None:
        from kernels.lora_expand import lora_expand

        lora_expand(self.y, self.buf, self.b, self.ranks, self.slice_offsets, self.meta, tiles=tiles)

    def fused(self, tiles) -> None:
        from kernels.lora_fused import lora_fused

        lora_fused(self.y, self.x, self.a, self.b, self.ranks, self.slice_offsets, self.meta, tiles)

    def split(self, shrink_tiles=None, expand_tiles=None) -> None:
        self.shrink(shrink_tiles)
        self.expand(expand_tiles)

    def apply(self) -> None:
        """What a layer of this shape runs (kernels/lora_backend.py): the kernel and tiles the table chose."""
        from kernels.lora_fused import fused_tiles

        tiles = fused_tiles(self.a, self.b)
        if tiles is None:
            self.split()
        else:
            self.fused(tiles)

    def expected(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(buf, y) by ``kernels.reference`` from the problem's inputs."""
        from kernels import reference

        buf = torch.zeros_like(self.buf)
        reference.lora_shrink(self.x, self.a, self.ranks, self.meta, buf)
        y = self.y0.clone()
        reference.lora_expand(y, buf, self.b, self.ranks, self.offsets, self.meta)
        return buf, y

    def bytes_read_once(self) -> int:
        """x read, y read and written, A and B of the adapters in use read, the float32 buf written and read."""
        s, adapters, rank, in_features = self.a.shape
        used = len(set(self.token_slots))
        tokens, out, e = self.x.shape[0], self.y.shape[1], self.x.element_size()
        return e * tokens * (in_features + 2 * out) + e * used * rank * (s * in_features + out) + 8 * s * tokens * rank


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within the dtype's rounding of the largest value (a check that the tiles compute the right thing;
    tests/kernels hold the exact tolerances)."""
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[got.dtype]
    return bool(((got.float() - want.float()).abs().max() <= tol * want.float().abs().max().clamp(min=1)).item())


class Sweep:
    def __init__(self, args, clock: Clock, gbs: float) -> None:
        self.args, self.clock, self.gbs = args, clock, gbs
        self.report: dict = {"device": device_label(args.device), "torch": torch.__version__,
                             "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                                time.gmtime()),
                             "command": " ".join(sys.argv), "copy_gbs": gbs, "tuning": [], "choices": [],
                             "layer": [], "bits": [], "failures": []}
        self.started = time.perf_counter()
        self.tuned: dict[str, dict] = {}
        self.fused_measured: set[str] = set()  # fused keys of the shapes this run tuned, chosen or not
        self.fused_best: dict[tuple[str, int], object] = {}  # (projection, rank) -> best fused Tiles

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def save(self) -> None:
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.report, indent=1))

    def fail(self, what: str) -> None:
        print(f"FAILED: {what}", flush=True)
        self.report["failures"].append(what)
        self.save()

    def time_ms(self, fn) -> float:
        return self.clock.replay_ms(fn)[0]

    def tune(self, name: str, in_features: int, widths: tuple[int, ...], rank: int) -> None:
        """The shrink's and the expand's tiles for one projection at one rank: one set for every step,
        the least geometric-mean time over decode and prefill token counts; then the pair of winners
        against the fused kernel's best tiles, the choice of kernel for the shape."""
        from kernels.lora_tuning import entry_key

        ranks, decode_counts, prefill_count, adapters, _, _ = SIZES[self.args.size]
        counts = (*decode_counts, prefill_count)
        problems = [Problem(in_features, widths, rank, n, adapters, self.dtype, self.clock.device) for n in counts]
        winners = {}
        fused_key = entry_key("fused", len(widths), in_features, rank, self.dtype, out_features=sum(widths))
        self.fused_measured.add(fused_key)  # whatever wins here, an older table's choice for the shape goes
        for kind in ("shrink", "expand", "fused"):
            best = None
            for tiles in candidates(kind, rank, self.dtype, self.args.size == "tiny"):
                best = self.score(name, rank, kind, tiles, problems, counts, best)
            if best is None:
                self.fail(f"{name} rank {rank} {kind}: no candidate tiles ran correctly")
                continue
            winners[kind] = best
            if kind != "fused":
                features = in_features if kind == "shrink" else sum(widths)
                self.tuned[entry_key(kind, len(widths), features, rank, self.dtype)] = vars(best[1])
            print(f"[{self.elapsed():4.0f} s] {name} r{rank} {kind}: {best[1]} geomean {best[0] * 1e3:.1f} us",
                  flush=True)
        if {"shrink", "expand", "fused"} <= winners.keys():
            pair = (winners["shrink"][1], winners["expand"][1])
            split = self.score(name, rank, "split", pair, problems, counts, None)
            self.fused_best[(name, rank)] = winners["fused"][1]
            chosen = split is not None and winners["fused"][0] < split[0]  # only where both ran correctly
            if chosen:
                self.tuned[fused_key] = vars(winners["fused"][1])
            self.report["choices"].append({
                "projection": name, "rank": rank, "kernel": "fused" if chosen else "split",
                "fused_geomean_ms": winners["fused"][0], "split_geomean_ms": split[0] if split else None})
            print(f"[{self.elapsed():4.0f} s] {name} r{rank}: {'fused' if chosen else 'split'} (fused "
                  f"{winners['fused'][0] * 1e3:.1f} us, split {split[0] * 1e3 if split else math.nan:.1f} us geomean)",
                  flush=True)
        self.save()

    def score(self, name: str, rank: int, kind: str, tiles, problems: list[Problem], counts: tuple[int, ...], best):
        """Times one candidate at every count (a row in the report); (geomean, tiles) of it or ``best``,
        whichever is less; ``best`` where it computes wrong."""
        times = self.try_tiles(kind, tiles, problems)
        if times is None:
            return best
        score = math.exp(sum(math.log(t) for t in times) / len(times))
        shown = [vars(t) for t in tiles] if kind == "split" else vars(tiles)
        self.report["tuning"].append({"projection": name, "rank": rank, "kernel": kind, "tiles": shown,
                                      "tokens": list(counts), "ms": times, "geomean_ms": score})
        return (score, tiles) if best is None or score < best[0] else best

    def try_tiles(self, kind: str, tiles, problems: list[Problem]) -> list[float] | None:
        """Times of ``tiles`` at each problem's token count; None (and a failure) if it computes wrong."""
        times = []
        for p in problems:
            buf_ref, y_ref = p.expected()
            if kind == "shrink":
                p.buf.fill_(float("nan"))
                p.shrink(tiles)
                got, want = p.buf, buf_ref
                fn = lambda p=p: p.shrink(tiles)  # noqa: E731
            elif kind == "expand":
                p.buf.copy_(buf_ref)
                p.y.copy_(p.y0)
                p.expand(tiles)
                got, want = p.y, y_ref
                fn = lambda p=p: p.expand(tiles)  # noqa: E731
            else:  # fused, or split: the shrink and expand tiles, one launch after the other
                p.y.copy_(p.y0)
                fn = (lambda p=p: p.fused(tiles)) if kind == "fused" else (lambda p=p: p.split(*tiles))  # noqa: E731
                fn()
                got, want = p.y, y_ref
            if not close(got, want):
                self.fail(f"{kind} {tiles} at {p.x.shape[0]} tokens: off the reference")
                return None
            times.append(self.time_ms(fn))
        return times

    def layer_rows(self, layer: dict, rank: int, tokens: int) -> None:
        """One layer's four projections: ours (tuned), ours before the split, each peer; against the floor."""
        from kernels.lora_launch import Tiles

        _, _, _, adapters, _, _ = SIZES[self.args.size]
        problems = [Problem(i, w, rank, tokens, adapters, self.dtype, self.clock.device) for i, w in layer.values()]
        floor = sum(p.bytes_read_once() for p in problems) / self.gbs / 1e6
        before = (Tiles(m=16, n=16, k=256 if self.dtype != torch.float32 else 128), Tiles(m=16, n=64, k=min(64, max(
            16, 1 << (rank - 1).bit_length())))) if tokens <= 256 else (None, None)
        runs = {"ours": lambda: [p.apply() for p in problems],
                "ours split": lambda: [p.split() for p in problems]}
        fused = [self.fused_best.get((name, rank)) for name in layer]
        if all(fused):
            runs["ours fused"] = lambda: [p.fused(t) for p, t in zip(problems, fused, strict=True)]
        if before[0] is not None:
            runs["ours before"] = lambda: [(p.shrink(before[0]), p.expand(before[1])) for p in problems]
        expected = [p.expected()[1] for p in problems]
        for peer, module in self.peers.items():
            from lora_peers import RUNNERS

            try:
                fns = [RUNNERS[peer](module, p.x, p.y, p.a, p.b, p.offsets, p.token_slots) for p in problems]
                for p, fn, want in zip(problems, fns, expected, strict=True):  # each peer checked once, as ours
                    p.y.copy_(p.y0)
                    fn()
                    if not close(p.y, want):
                        raise ValueError("off the reference")
            except Exception as e:  # noqa: BLE001 - a peer that fails here is reported, not fatal
                self.fail(f"{peer} at rank {rank}, {tokens} tokens: {type(e).__name__}: {e}")
                continue
            runs[peer] = lambda fns=fns: [fn() for fn in fns]
        row = {"rank": rank, "tokens": tokens, "adapters": min(tokens, adapters), "floor_ms": floor}
        for p, want in zip(problems, expected, strict=True):
            p.y.copy_(p.y0)
            p.apply()
            if not close(p.y, want):
                self.fail(f"ours at rank {rank}, {tokens} tokens: off the reference")
        for label, fn in runs.items():
            try:
                row[f"{label}_ms"] = self.time_ms(fn)
            except Exception as e:  # noqa: BLE001 - a peer that fails here is reported, not fatal
                self.fail(f"{label} at rank {rank}, {tokens} tokens: {type(e).__name__}: {e}")
        row["ours_over_floor"] = row.get("ours_ms", math.nan) / floor
        for peer in self.peers:
            row[f"ours_over_{peer}"] = row.get("ours_ms", math.nan) / row.get(f"{peer}_ms", math.nan)
        self.report["layer"].append(row)
        self.save()
        cells = "  ".join(f"{k} {v * 1e3:.1f} us" for k, v in row.items() if k.endswith("_ms"))
        ratios = "  ".join(f"{k} {v:.2f}" for k, v in row.items() if k.startswith("ours_over"))
        print(f"[{self.elapsed():4.0f} s] layer r{rank} {tokens} tok: {cells}  {ratios}", flush=True)

    def bits(self, name: str, in_features: int, widths: tuple[int, ...], rank: int, replays: int) -> None:
        """A decode row's bits alone, beside others and in a prefill-sized step, with the kernel and tiles
        the layers take, and with the best fused tiles; the split shrink against one program, replayed."""
        ranks, decode_counts, prefill_count, adapters, _, _ = SIZES[self.args.size]
        fused = self.fused_best.get((name, rank))
        runs = {"": Problem.apply} | ({"fused: ": lambda p: p.fused(fused)} if fused else {})
        same = {}
        for label, run in runs.items():
            rows = {}
            for tokens in (1, decode_counts[-1], prefill_count):
                p = Problem(in_features, widths, rank, tokens, adapters, self.dtype, self.clock.device)
                run(p)
                rows[tokens] = p.y[0].clone()
            same |= {f"{label}alone = in {n} tokens": bool(torch.equal(rows[1], rows[n])) for n in list(rows)[1:]}
        p = Problem(in_features, widths, rank, decode_counts[-1], adapters, self.dtype, self.clock.device, seed=7)
        from kernels.lora_shrink import default_tiles
        from kernels.lora_tuning import on_device

        tiles = (on_device("shrink", len(widths), in_features, rank, self.dtype, self.clock.device)
                 or default_tiles(self.dtype))
        p.shrink(tiles)
        split = p.buf.clone()
        serial = torch.full_like(split, float("nan"))
        meta, p.meta = p.meta, dataclasses.replace(p.meta, partials=None, counters=None)
        p.shrink(tiles)
        serial.copy_(p.buf)
        p.meta = meta
        mismatches = 0
        for _ in range(replays):
            p.shrink(tiles)
            mismatches += int(not torch.equal(p.buf, serial))
        row = {"projection": name, "in_features": in_features, "rank": rank, **same, "replays": replays,
               "split = one program": bool(torch.equal(split, serial)), "replays unlike one program": mismatches}
        self.report["bits"].append(row)
        self.save()
        print(f"[{self.elapsed():4.0f} s] bits {row}", flush=True)
        if not all(same.values()) or not row["split = one program"] or mismatches:
            self.fail(f"bits: {row}")


def device_label(device: str) -> str:
    from gpu_report import device_name

    return device_name(device)


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        torch.set_num_threads(2)
    ranks, decode_counts, prefill_count, _, iters, warmup = SIZES[args.size]
    clock = Clock(torch.device(args.device), iters, warmup)
    gbs = copy_bandwidth(clock, (1 << 30) if args.size == "full" else (16 << 20))
    sweep = Sweep(args, clock, gbs)
    sweep.dtype = getattr(torch, args.dtype)
    sweep.peers = {}
    if args.peers:
        from lora_peers import load

        try:
            sweep.peers = load(args.peers)
        except ImportError as e:
            sweep.fail(f"peers: {e}")
    print(f"{sweep.report['device']}: copy {gbs:.0f} GB/s; torch {torch.__version__}, triton "
          f"{sweep.report['triton']}; peers: {', '.join(sweep.peers) or 'none'}", flush=True)
    from gpu_kernels import layer_projections

    layer = layer_projections(PRESETS[args.model])
    for rank in ranks:
        for name, (in_features, widths) in layer.items():
            if sweep.elapsed() > args.budget_s * 0.6:
                sweep.fail(f"tuning stopped at {name} rank {rank}: past 60% of --budget-s {args.budget_s}")
                break
            try:
                sweep.tune(name, in_features, widths, rank)
            except Exception as e:  # noqa: BLE001 - recorded; the other shapes still run
                sweep.fail(f"tuning {name} rank {rank}: {type(e).__name__}: {e}")
    if args.device == "cuda" and sweep.tuned:
        from kernels.lora_tuning import table_path

        path = table_path(sweep.report["device"])
        kept = json.loads(path.read_text())["tiles"] if path.exists() else {}
        kept = {k: v for k, v in kept.items() if k not in sweep.fused_measured}  # tuned now: kept where chosen again
        table = {"device": sweep.report["device"], "date": sweep.report["date"], "command": sweep.report["command"],
                 "tiles": {**kept, **sweep.tuned}}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        (args.out.parent / path.name).write_text(path.read_text())  # beside the report: what the run measured
        print(f"tuned table: {path} ({len(sweep.tuned)} entries measured, {len(kept.keys() - sweep.tuned.keys())} "
              "kept)", flush=True)
        from kernels import lora_tuning

        lora_tuning._table.cache_clear()
    sweep.report["tuned"] = sweep.tuned
    # tiny: one row (the interpreter runs vLLM's kernels a program at a time, seconds a launch)
    layer_tokens = (decode_counts[-1],) if args.size == "tiny" else (*decode_counts, prefill_count)
    for rank in ranks:
        for tokens in layer_tokens:
            if sweep.elapsed() > args.budget_s * 0.9:
                sweep.fail(f"layer rows stopped at rank {rank}, {tokens} tokens: past 90% of --budget-s")
                break
            try:
                sweep.layer_rows(layer, rank, tokens)
            except Exception as e:  # noqa: BLE001 - recorded; the other rows still run
                sweep.fail(f"layer rank {rank}, {tokens} tokens: {type(e).__name__}: {e}")
    # Every shape and rank with the tiles it now runs; many replays for the first, a few for the others.
    replays = 200 if args.size == "full" else 2
    for rank in ranks:
        for name, (in_features, widths) in layer.items():
            if sweep.elapsed() > args.budget_s:
                sweep.fail(f"bits stopped at {name} rank {rank}: past --budget-s")
                break
            try:
                sweep.bits(name, in_features, widths, rank, replays)
            except Exception as e:  # noqa: BLE001 - recorded; the other shapes still run
                sweep.fail(f"bits {name} rank {rank}: {type(e).__name__}: {e}")
            replays = max(2, replays // 10)
    sweep.save()
    print(f"done in {sweep.elapsed():.0f} s; {len(sweep.report['failures'])} failure(s); {args.out}", flush=True)
    sys.exit(1 if sweep.report["failures"] else 0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and few tiles (the CPU test)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 on CUDA, float16 on a CPU (the interpreter misreads bf16 dots)")
    parser.add_argument("--peers", type=Path, help="folder holding vllm_lora and sglang_lora (../shared/peers)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop tuning at 60%% and layer rows at 90%%")
    parser.add_argument("--out", type=Path, help="JSON report (default $OUT/lora-sweep.json, else benchmarks/results/)")
    args = parser.parse_args()
    args.size, args.model = ("tiny", "tiny") if args.tiny else ("full", "8b")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float16")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here; run --tiny --device cpu instead")
    if args.out is None:
        args.out = (Path(os.environ["OUT"]) / "lora-sweep.json" if os.environ.get("OUT")
                    else REPO / "benchmarks" / "results" / f"lora-sweep-{args.device}-{time.strftime('%Y-%m-%d')}.json")
    return args


if __name__ == "__main__":
    main()

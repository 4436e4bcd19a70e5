"""torch.compile (inductor, CPU C++ backend) of the pod's decode step against eager, on the demo model,
in one command: compile times, step times interleaved with eager's, deviation of the logits.

The pod's forward (``LlamaForCausalLM.forward`` as ``ModelRunner.execute`` runs it) holds Python that a
compiled graph cannot: the LoRA layers' packs and thread switch (``kernels.lora_backend``) and
oneDNN's opaque reordered weights (``cpu_linear``). Variants, each beside eager:

- ``blocks``: every projection (base matmul + LoRA) stays eager; the pure tensor code between
  projections is compiled, three functions shared by all layers: rotary + paged attention (as
  ``attention.paged_attention``), residual add + RMSNorm, SiLU·up.
- ``decode-attn``: as ``blocks``, but attention is written for decode steps (one query per
  sequence) as gather-multiply-reduce, so that inductor can read keys and values straight from the
  paged cache instead of gathering them into copies for scaled-dot-product attention.
- ``forward``: the whole ``LlamaForCausalLM.forward`` compiled, each projection excluded
  (``torch.compiler.disable``, one graph break per projection), layer ints unspecialised so the
  layers share graphs.

Each variant runs in a process of its own, with eager beside it, and compiles with ``dynamic=True``
into a fresh inductor cache (cold: the compile time a pod would pay at start-up); inductor fixes a
kernel's thread count when it compiles, so each thread count has its own processes too. Then, per
sequence count and adapter mix, eager and the variant run in turn for ``--steps`` rounds. With 1
thread the figures are the calling thread's CPU time (``time.thread_time``, which a shared
machine's descheduling does not inflate), with more, wall time. Prints markdown for
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from cpu_matmul import build_demo_engine, decode_batch  # benchmarks/cpu_matmul.py
from processes import cpu_flags, cpu_model, load_average  # benchmarks/processes.py

from data_plane.engine.step_runner import forward_batch
from data_plane.lora.layer import LoRAProjection
from data_plane.model.llama import ForwardBatch, LlamaForCausalLM
from data_plane.model.torch_attention import TiledAttention

Forward = Callable[[ForwardBatch], torch.Tensor]


def split_forward(model: LlamaForCausalLM, decode_attention: bool, compile_fn: Callable) -> Forward:
    """The model's forward with the code between projections in three functions, each passed
    through ``compile_fn``; the same arithmetic as ``LlamaForCausalLM.forward``."""
    c = model.config
    nh, nkv, hd, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    scale, group = hd**-0.5, nh // nkv
    assert set(c.sliding_windows) == {None}, "the demo model has no sliding window"

    def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: TiledAttention) -> torch.Tensor:
        qk, v = qkv.split([(nh + nkv) * hd, nkv * hd], dim=-1)
        qk = qk.view(-1, nh + nkv, hd)
        qk = torch.addcmul(qk * cos, qk.roll(hd // 2, dims=-1), sin)
        q, k, v = qk[:, :nh], qk[:, nh:], v.view(-1, nkv, hd)
        if not decode_attention:
            return meta(q, k, v, k_cache, v_cache, None, scale)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        (g,) = meta.groups  # a decode step: one group, one query per sequence (query_index is [seqs, 1])
        seqs, ctx = g.key_index.shape
        keys, values = k_cache[g.key_index], v_cache[g.key_index]  # [seqs, ctx, kv_heads, head_dim]
        q = q[g.query_index.view(-1)].view(seqs, 1, nkv, group, hd)
        scores = (q * keys.unsqueeze(3)).sum(-1) * scale  # [seqs, ctx, kv_heads, group]
        scores = scores.masked_fill(g.hidden[None].view(seqs, ctx, 1, 1), float("-inf"))
        out = (scores.softmax(1).unsqueeze(-1) * values.unsqueeze(3)).sum(1)  # [seqs, kv_heads, group, head_dim]
        return out.reshape(seqs, nh * hd)[g.rows]

    def add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        return x, F.rms_norm(x, weight.shape, weight, eps)

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(c.intermediate_size, dim=-1)
        return F.silu(gate) * up

    attend, add_norm, silu_mul = compile_fn(attend), compile_fn(add_norm), compile_fn(silu_mul)
    layers = model.layers
    norms = [layer.input_layernorm.weight for layer in layers[1:]] + [model.norm.weight]

    def forward(batch: ForwardBatch) -> torch.Tensor:
        x = model.embed_tokens(batch.input_ids)
        cos, sin = model.rotary.tables(batch.positions, x.dtype)
        step_attention = model.attention.prepare(batch.attn)
        batch = replace(batch, rope=((cos, sin),), attention=step_attention)
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            a = attend(attn.qkv_proj(h, batch), cos, sin, batch.kv_cache.k[i], batch.kv_cache.v[i],
                       step_attention)
            x, h = add_norm(x, attn.o_proj(a, batch), layer.post_attention_layernorm.weight)
            x, h = add_norm(x, mlp.down_proj(silu_mul(mlp.gate_up_proj(h, batch)), batch), norms[i])
        return h

    return forward


def whole_forward(model: LlamaForCausalLM) -> Forward:
    """``model.forward`` compiled with every projection run eagerly (a graph break each)."""
    projections = [m for m in model.modules() if isinstance(m, LoRAProjection)]
    disabled = {m: torch.compiler.disable(m.forward) for m in projections}
    torch._dynamo.config.allow_unspec_int_on_nn_module = True  # Attention.layer would recompile per layer
    torch._dynamo.config.recompile_limit = 64
    compiled = torch.compile(model.forward, dynamic=True)

    def forward(batch: ForwardBatch) -> torch.Tensor:
        for m, f in disabled.items():  # only while the compiled forward runs: eager pays nothing for it
            m.forward = f
        try:
            return compiled(batch)
        finally:
            for m in projections:
                del m.forward

    return forward


def variants(model: LlamaForCausalLM, names: list[str]) -> dict[str, Forward]:
    compile_fn = lambda f: torch.compile(f, dynamic=True)  # noqa: E731
    made = {"blocks": lambda: split_forward(model, False, compile_fn),
            "decode-attn": lambda: split_forward(model, True, compile_fn),
            "forward": lambda: whole_forward(model)}
    return {name: made[name]() for name in names}


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def run_one(args: argparse.Namespace, threads: int, tmp: Path) -> None:
    torch.set_num_threads(threads)
    engine, slots = build_demo_engine(max(args.seqs), tmp)
    model, runner = engine.model, engine.runner
    forwards: dict[str, Forward] = {"eager": model.forward, **variants(model, args.variants)}
    cpu_time = threads == 1
    timer = time.thread_time if cpu_time else time.perf_counter

    def step(forward: Forward, batch) -> tuple[torch.Tensor, float]:
        with torch.inference_mode():
            prepared = runner.prepare(batch)
            started = timer()
            hidden = forward(forward_batch(prepared.inputs, runner.kv_cache))
            logits = model.logits(hidden.index_select(0, prepared.inputs.sample_rows))
            return logits, timer() - started

    shapes = [(n, args.context) for n in sorted(args.seqs, reverse=True)] + [(max(args.seqs), 2 * args.context)]
    compile_rows, failed = [], {}
    for name in args.variants:
        row = [name]
        for n, ctx in shapes:  # the first call compiles; later shapes show what recompiles
            before, started = graphs(), time.perf_counter()
            try:
                step(forwards[name], decode_batch(engine, slots, n, ctx))
            except Exception as e:  # a variant that fails to compile is reported, the others still run
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                break
            row.append(f"{time.perf_counter() - started:.1f} s ({graphs() - before} graphs)")
        compile_rows.append(row)
    for name in failed:
        del forwards[name]

    times: dict[tuple[str, int, str], list[float]] = {}
    deviation = {}
    for n in sorted(args.seqs, reverse=True):
        for mix, mix_slots in (("base + 4 adapters", slots), ("base only", [-1])):
            batch = decode_batch(engine, mix_slots, n, args.context)
            for forward in forwards.values():  # warm
                step(forward, batch)
            for _ in range(args.steps):
                for name, forward in forwards.items():
                    times.setdefault((name, n, mix), []).append(step(forward, batch)[1])
            if mix == "base + 4 adapters":
                ref = step(model.forward, batch)[0]
                for name, forward in forwards.items():
                    if name != "eager":
                        out = step(forward, batch)[0]
                        deviation[(name, n)] = ((out - ref).abs().max().item(), ref.abs().max().item(),
                                                int((out.argmax(-1) == ref.argmax(-1)).sum()), ref.shape[0])

    kind = "CPU time (thread_time), 1 thread" if cpu_time else f"wall time, {threads} threads"
    print(f"### {kind}\n\n{time.strftime('%Y-%m-%d %H:%M %Z')}, {cpu_model()} ({cpu_flags()}), torch "
          f"{torch.__version__}, load average {load_average()}; demo model, decode steps at context "
          f"{args.context}, {args.steps} interleaved rounds\n")
    print("Compile (cold inductor cache), first call of each shape (seqs × context):\n")
    print("| variant | " + " | ".join(f"{n} × {ctx}" for n, ctx in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for row in compile_rows:
        print("| " + " | ".join(row + ["failed"] * (len(shapes) + 1 - len(row))) + " |")
    for name, error in failed.items():
        print(f"\n{name} failed: `{error}`")
    names = [name for name in forwards if name != "eager"]
    print("\nStep time in ms, min / median over the rounds (ratio: median against eager's):\n")
    print("| seqs | mix | eager | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for (name, n, mix), _ in sorted(times.items(), key=lambda kv: (-kv[0][1], kv[0][2])):
        if name != "eager":
            continue
        eager = statistics.median(times[("eager", n, mix)])
        cells = [f"{min(times[(v, n, mix)]) * 1e3:.1f} / {statistics.median(times[(v, n, mix)]) * 1e3:.1f}"
                 + ("" if v == "eager" else f" ({statistics.median(times[(v, n, mix)]) / eager:.2f})")
                 for v in ("eager", *names)]
        print(f"| {n} | {mix} | " + " | ".join(cells) + " |")
    if deviation:
        print("\nLogits against eager on the adapter mix: largest |Δlogit| (largest |logit|), greedy tokens "
              "that agree\n")
        for (name, n), (diff, top, agree, rows) in deviation.items():
            print(f"- {name}, {n} seqs: {diff:.2e} ({top:.1f}), {agree}/{rows}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--steps", type=int, default=15, help="interleaved rounds per sequence count and mix")
    parser.add_argument("--threads", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2],
                        help="one process per thread count and variant: 1 measures CPU time, more wall time")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=["blocks", "decode-attn", "forward"])
    args = parser.parse_args()
    runs = [(t, v) for t in args.threads for v in args.variants]
    if len(runs) > 1:  # each in a fresh process: it compiles cold, for its thread count, untouched by the others
        for threads, variant in runs:
            subprocess.run([sys.executable, *sys.argv, f"--threads={threads}", f"--variants={variant}"], check=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        # Inductor reads its cache directory when it first compiles: a fresh one makes compiles cold.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        run_one(args, args.threads[0], Path(tmp))


if __name__ == "__main__":
    main()

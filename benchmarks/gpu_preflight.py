"""What the GPU evaluation needs, checked in seconds before it spends a lease's minutes
(benchmarks/gpu_run.sh runs it first):

    python benchmarks/gpu_preflight.py [--device cuda|cpu]

1. every module the evaluation imports, the project's generated gRPC stubs among them (``make proto``
   writes them; on a GPU machine they travel with the checkout);
2. the device: its name, memory, and for CUDA a capability the kernels compile for (sm_80 or newer);
3. the Triton kernels compiled and run once on small problems against ``kernels.reference``: the LoRA
   shrink + expand (split and one program), paged attention (a split decode beside a chunk, the same
   bits launch after launch, its counters back at zero) and the fused layer ops;
4. where the tuned tiles go (``kernels/tuned``) is writable.

One line per check; exits 1 at the end if any failed, so a run that cannot work stops before it starts.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MODULES = ("torch", "triton", "transformers", "peft", "safetensors", "grpc", "google.protobuf", "llguidance",
           "lorafleet.v1.generation_pb2", "data_plane.pod", "kernels.lora_tuning")


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.started = time.perf_counter()

    def run(self, name: str, fn: Callable[[], str]) -> None:
        try:
            detail = fn()
        except Exception as e:  # noqa: BLE001 - a failed check is reported, and the others still run
            self.failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            return
        print(f"ok   {name}: {detail} ({time.perf_counter() - self.started:.1f} s)", flush=True)


def imports() -> str:
    missing = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        raise ImportError("missing: " + "; ".join(missing) + ". Carry build/gpu-wheels (benchmarks/gpu_wheels.py) "
                          "and protos/lorafleet/v1 (make proto), and put protos/ on PYTHONPATH")
    return f"{len(MODULES)} modules"


def device(name: str) -> str:
    import torch

    if name == "cpu":
        return "CPU (the Triton kernels run under the interpreter)"
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        raise RuntimeError(f"sm_{major}{minor}: the kernels need sm_80 or newer")
    free, total = torch.cuda.mem_get_info()
    return f"{torch.cuda.get_device_name()}, sm_{major}{minor}, {free / 2**30:.0f} of {total / 2**30:.0f} GiB free"


def lora_kernels(dev: str) -> str:
    import torch

    from kernels import reference
    from kernels.lora_expand import lora_expand
    from kernels.lora_meta import LoraMetaBuilder, partial_rows
    from kernels.lora_shrink import launch_grid, lora_shrink

    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(0)
    slots, rank, in_features, widths = [0, 2, -1, 1, 0], 16, 256, (64, 32, 32)
    x = torch.randn(len(slots), in_features, generator=gen).to(dev, dtype)
    a = (torch.randn(3, 3, rank, in_features, generator=gen) / in_features**0.5).to(dev, dtype)
    b = (torch.randn(3, sum(widths), rank, generator=gen) / rank**0.5).to(dev, dtype)
    ranks = torch.full((3, 3), rank, dtype=torch.int32, device=dev)
    offsets = [0, 64, 96, 128]
    y0 = torch.randn(len(slots), sum(widths), generator=gen).to(dev, dtype)
    results = []
    for split in (True, False):
        meta = LoraMetaBuilder(len(slots), 3, dev, max_rank=rank,
                               partial_rows=partial_rows([(3, in_features)]) if split else 0).build(slots)
        from kernels.lora_launch import Tiles

        tiles = Tiles(m=16, n=16, k=64, chunk=64)
        if launch_grid(len(slots), 3, in_features, rank, 3, tiles, meta)[1] != split:
            raise RuntimeError("the split launch was not taken as asked")
        buf, y = meta.buffer[:3, : len(slots)], y0.clone()
        lora_shrink(x, a, ranks, meta, buf, tiles=tiles)
        lora_expand(y, buf, b, ranks, torch.tensor(offsets, dtype=torch.int32, device=dev), meta)
        if split and meta.counters.any():
            raise RuntimeError("the split shrink left its arrival counters non-zero")
        results.append(y)
    expected, buf = y0.clone(), torch.zeros(3, len(slots), rank, device=dev)
    reference.lora_shrink(x, a, ranks, meta, buf)
    reference.lora_expand(expected, buf, b, ranks, offsets, meta)
    err = (results[0].float() - expected.float()).abs().max().item()
    if err > 0.05 * expected.float().abs().max().item() or not torch.equal(results[0], results[1]):
        raise RuntimeError(f"off the reference by {err:.3g}, or split and one program differ")
    return f"shrink (split and one program) + expand on {len(slots)} tokens match the reference ({err:.2g})"


def attention(dev: str) -> str:
    import torch

    from kernels import reference
    from kernels.attention_unified import AttentionWorkspace, default_tiles
    from kernels.paged_attention import paged_attention

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(1)
    # A decode of 3 splits (merged by the last to arrive), one of 1, and a 5-token chunk, in one launch.
    seqs, heads, kv_heads, head_dim, block = [(1, 300), (5, 40), (1, 40)], 4, 2, 64, 16
    per_seq = -(-max(n for _, n in seqs) // block)
    k = torch.randn(len(seqs) * per_seq * block, kv_heads, head_dim, generator=gen).to(dev, dtype)
    v = torch.randn(len(seqs) * per_seq * block, kv_heads, head_dim, generator=gen).to(dev, dtype)
    tables = torch.arange(len(seqs) * per_seq, dtype=torch.int32, device=dev).view(len(seqs), per_seq)
    lens = torch.tensor([n for _, n in seqs], dtype=torch.int32, device=dev)
    starts = torch.tensor([0, 1, 6, 7], dtype=torch.int32, device=dev)
    q = torch.randn(7, heads, head_dim, generator=gen).to(dev, dtype)
    want = torch.full_like(q, float("nan"))
    kwargs = dict(block_size=block, scale=head_dim**-0.5, window=None, max_query_len=5, max_seq_len=300)
    reference.paged_attention(q, k, v, tables, lens, starts, want, **kwargs)
    workspace = AttentionWorkspace.allocate(len(seqs), heads, kv_heads, head_dim,
                                            default_tiles(head_dim, dtype).max_splits, torch.device(dev))
    runs = []
    for _ in range(20 if dev == "cuda" else 2):  # which split merges varies from run to run, the bits may not
        got = torch.full_like(q, float("nan"))
        paged_attention(q, k, v, tables, lens, starts, got, **kwargs, workspace=workspace)
        runs.append(got)
    if workspace.counters.any():
        raise RuntimeError("the decode splits left their arrival counters non-zero")
    err = (runs[0].float() - want.float()).abs().max().item()
    if not err <= 0.05:
        raise RuntimeError(f"off the reference by {err:.3g}")
    if not all(torch.equal(runs[0], r) for r in runs[1:]):
        raise RuntimeError("the same step gave other bits from one launch to the next")
    return (f"paged attention (split decode, chunk, decode in one launch) matches the reference ({err:.2g}), "
            f"the same bits in {len(runs)} launches")


def fused_ops(dev: str) -> str:
    import torch

    from kernels import reference
    from kernels.fused_activation import act_mul
    from kernels.fused_norm import add_rms_norm
    from kernels.fused_rotary import rotary

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(2)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    x, residual, weight = randn(3, 96), randn(3, 96), randn(96)
    angles = torch.randn(3, 1, 16, generator=gen)
    cos, sin = (torch.cat([f, f], -1).to(dev, dtype) for f in (angles.cos(), angles.sin()))
    sin[..., :16] *= -1
    qk, gate_up = randn(3, 6, 48), randn(3, 160)
    pairs = {f"norm (offset {o})": (add_rms_norm(x, residual.clone(), weight, 1e-6, o),
                                    reference.add_rms_norm(x, residual.clone(), weight, 1e-6, o)) for o in (0.0, 1.0)}
    pairs["rotary"] = rotary(qk.clone(), cos, sin), reference.rotary(qk.clone(), cos, sin)
    for act in ("silu", "gelu_pytorch_tanh"):
        pairs[act] = act_mul(gate_up, act), reference.act_mul(gate_up, act)
    errs = {k: ((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for k, (g, w) in pairs.items()}
    if not max(errs.values()) <= 0.05:
        raise RuntimeError(f"off the reference (relative to its largest value): {errs}")
    return f"residual add + RMSNorm, rotary and the gated activations match the reference ({max(errs.values()):.2g})"


def tuned_folder() -> str:
    from kernels.lora_tuning import TABLES

    TABLES.mkdir(parents=True, exist_ok=True)
    probe = TABLES / ".preflight"
    probe.write_text("")
    probe.unlink()
    return str(TABLES.relative_to(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    checks = Checks()
    checks.run("imports", imports)
    checks.run("device", lambda: device(args.device))
    if "device" not in checks.failed and "imports" not in checks.failed:
        checks.run("LoRA kernels", lambda: lora_kernels(args.device))
        checks.run("attention kernel", lambda: attention(args.device))
        checks.run("fused layer ops", lambda: fused_ops(args.device))
    checks.run("tuned tiles folder", tuned_folder)
    if checks.failed:
        sys.exit(f"preflight failed: {', '.join(checks.failed)}")
    print("preflight passed")


if __name__ == "__main__":
    main()

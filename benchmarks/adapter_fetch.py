"""Download → ready in a slot from an S3 store on loopback, with a cold and a warm disk tier, next to the
same adapter loaded from a local directory in the same run.

The store is moto's S3 server (benchmarks/object_store.py: a real S3 API over HTTP, IAM authentication
on) started by this script on 127.0.0.1; the pod's objects do the work: ``LoraRuntime.read`` through its
``AdapterFetcher`` (boto3 download into a staging directory, sha256 check, read + validate, rename into
the disk tier), then ``AdapterCache.insert`` and ``acquire`` (the copy into a slot). Per repeat:

- ``local``: the adapter's directory under an adapter root, its weights' pages dropped first (as
  benchmarks/adapter_load.py measures it);
- ``s3 cold``: the disk tier emptied first, so the bytes come from the store;
- ``s3 warm``: the copy already in the disk tier (a restarted pod, or one that evicted the adapter from
  its CPU tier), its pages dropped first: no request to the store.

The store runs on the same machine and CPUs as the pod, so ``s3 cold`` includes moto's own work of
serving the object (in Python) and no network. Adapters: the demo adapters on the demo model (float32),
and a random rank-16 adapter of Llama-3-8B shape (bfloat16) on a stand-in model whose base weights take
no memory (see benchmarks/adapter_load.py). Prints markdown rows (medians of ``--repeats``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from adapter_load import cpu_name, drop_page_cache, stand_in_model  # beside this script
from synthetic import LLAMA3_8B, write_random_adapter

from benchmarks.object_store import MotoS3
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from data_plane.lora.fetcher import AdapterFetcher, FetchSettings
from data_plane.lora.runtime import LoraRuntime
from data_plane.lora.s3_source import S3Settings
from data_plane.model import load_model
from data_plane.model.demo_model import ensure_demo_model

HEADER = ("| date | CPU | torch | adapter | dtype | file MB | local ready ms | s3 cold ready ms | s3 warm ready ms "
          "| cold / local | warm / local |\n|---|---|---|---|---|---|---|---|---|---|---|")
WEIGHTS = "adapter_model.safetensors"


def ready_in_slot(runtime: LoraRuntime, name: str, source: str, sha256: str, device: str) -> float:
    """Seconds from ``source`` to ``name`` in a slot; the adapter is unloaded again, untimed."""
    t0 = time.perf_counter()
    runtime.cache.insert(runtime.read(name, source, sha256))
    runtime.cache.acquire(name)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    runtime.cache.release(name)
    runtime.cache.unload(name)
    return seconds


def measure(runtime: LoraRuntime, name: str, local: Path, s3_url: str, repeats: int, device: str) -> dict[str, float]:
    sha = hashlib.sha256((local / WEIGHTS).read_bytes()).hexdigest()
    tier = runtime.downloads.tier
    times: dict[str, list[float]] = {"local": [], "cold": [], "warm": []}
    for _ in range(repeats):
        drop_page_cache(local / WEIGHTS)
        times["local"].append(ready_in_slot(runtime, name, str(local), sha, device))
        tier.discard(sha)
        times["cold"].append(ready_in_slot(runtime, name, s3_url, sha, device))
        drop_page_cache(tier.root / sha / WEIGHTS)
        times["warm"].append(ready_in_slot(runtime, name, s3_url, sha, device))
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def row(label: str, dtype: torch.dtype, local: Path, ms: dict[str, float], threads: int) -> str:
    size = (local / WEIGHTS).stat().st_size / 1e6
    return (f"| {time.strftime('%Y-%m-%d')} | {cpu_name()}, {threads} threads | {torch.__version__} | {label} "
            f"| {str(dtype).removeprefix('torch.')} | {size:.2f} | {ms['local']:.1f} | {ms['cold']:.1f} "
            f"| {ms['warm']:.1f} | {ms['cold'] / ms['local']:.2f}× | {ms['warm'] / ms['local']:.2f}× |")


def runtime_for(model, roots: tuple[Path, ...], disk: Path, store: MotoS3, rank: int) -> LoraRuntime:
    settings = FetchSettings(disk, s3=S3Settings(endpoint_url=store.endpoint, region="us-east-1"))
    return LoraRuntime(model, max_loras=2, max_cpu_loras=2, max_rank=rank, max_tokens=256, adapter_roots=roots,
                       fetcher=AdapterFetcher(settings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the slots live")
    parser.add_argument("--skip-8b", action="store_true", help="only the demo adapters")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="lorafleet-fetch-") as tmp:
        tmp = Path(tmp)
        store = MotoS3(tmp).start()
        try:
            # The pod's credentials, as the standard AWS variables give them.
            os.environ.update({k: v for k, v in store.reader.env(store.endpoint).items() if k != "AWS_ENDPOINT_URL"})
            print(HEADER)
            demo = load_model(ensure_demo_model(quiet=True), "float32", args.device)
            root = demo_adapter_dir(DEMO_ADAPTERS[0]).parent
            runtime = runtime_for(demo, (root,), tmp / "disk-demo", store, 64)
            for name in DEMO_ADAPTERS:
                url = store.put_adapter(f"demo/{name}", demo_adapter_dir(name))
                ms = measure(runtime, name, demo_adapter_dir(name), url, args.repeats, args.device)
                print(row(f"{name} (demo model, 135M)", torch.float32, demo_adapter_dir(name), ms, args.threads),
                      flush=True)
            del runtime, demo
            if not args.skip_8b:
                path = write_random_adapter(tmp / "llama3-8b-r16", LLAMA3_8B, rank=16)
                url = store.put_adapter("8b/r16", path)
                model = stand_in_model(LLAMA3_8B, torch.bfloat16, args.device)
                runtime = runtime_for(model, (tmp,), tmp / "disk-8b", store, 16)
                ms = measure(runtime, path.name, path, url, args.repeats, args.device)
                print(row("random r16, all 7 (Llama-3-8B shape)", torch.bfloat16, path, ms, args.threads))
        finally:
            store.stop()


if __name__ == "__main__":
    main()

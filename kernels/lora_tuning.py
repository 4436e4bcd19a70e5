"""Which tiles the LoRA launchers use: a table measured on each GPU model, else a stated default.

``benchmarks/lora_sweep.py`` times a grid of tiles per projection shape on a GPU and writes
``kernels/tuned/<device>.json`` (device = ``torch.cuda.get_device_name``, lower case, spaces as
``-``). An entry is keyed by kernel, slices, in/out features, max rank and dtype, and holds the one
``Tiles`` that ran fastest over decode and prefill token counts together. One set of tiles serves every
step of a shape, so a row runs the same instructions in any step: on a GPU, tiles of 16 rows compile to
one kind of tensor-core instruction and tiles of 64 to another (Hopper's warpgroup MMA), and nothing
promises the two sum a row alike. The shrink then differs between steps only in who adds its chunks'
partial sums, in the same order (``kernels.lora_shrink``). Shapes or devices without an entry take the
launchers' ``default_tiles``; on a CPU (the interpreter) there is no table. A ``fused`` entry (keyed by
in and out features) says the sweep measured shrink and expand in one launch (``kernels.lora_fused``)
faster than the pair for that shape, and holds its tiles: without one, the pair runs.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

from kernels.lora_launch import Tiles

TABLES = Path(__file__).resolve().parent / "tuned"


def table_path(device_name: str) -> Path:
    return TABLES / f"{re.sub(r'[^a-z0-9]+', '-', device_name.lower()).strip('-')}.json"


def entry_key(kernel: str, slices: int, features: int, max_rank: int, dtype: torch.dtype,
              out_features: int = 0) -> str:
    """``features``: in_features for the shrink, out_features for the expand; the fused kernel
    (``kernels.lora_fused``) is keyed by both, ``out_features`` too."""
    shape = f"f{features}x{out_features}" if out_features else f"f{features}"
    return f"{kernel}/s{slices}/{shape}/r{max_rank}/{str(dtype).removeprefix('torch.')}"


@functools.cache
def _table(device_name: str) -> dict[str, Tiles]:
    """The tuned tiles of one GPU model, read once (an empty table where none was measured)."""
    path = table_path(device_name)
    if not path.exists():
        return {}
    return {key: Tiles(**tiles) for key, tiles in json.loads(path.read_text())["tiles"].items()}


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


def tuned(kernel: str, slices: int, features: int, max_rank: int, dtype: torch.dtype, device_name: str,
          out_features: int = 0) -> Tiles | None:
    """The tuned tiles of a launch on the GPU named ``device_name``, None where none were measured."""
    if not device_name:
        return None
    return _table(device_name).get(entry_key(kernel, slices, features, max_rank, dtype, out_features))


def on_device(kernel: str, slices: int, features: int, max_rank: int, dtype: torch.dtype,
              device: torch.device, out_features: int = 0) -> Tiles | None:
    """The tuned tiles of a launch on ``device``, None off a GPU or where none were measured: the
    launcher then takes its ``default_tiles`` (the fused kernel: not chosen, ``kernels.lora_fused``)."""
    return tuned(kernel, slices, features, max_rank, dtype, _device_name(device), out_features)

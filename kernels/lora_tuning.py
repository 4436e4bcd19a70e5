"""Which tiles the LoRA launchers use: a table measured on each GPU model, else a stated default.

``benchmarks/lora_sweep.py`` times a grid of tiles per projection shape on a GPU and writes
``kernels/tuned/<device>.json`` (device = ``torch.cuda.get_device_name``, lower case, spaces as
``-``). An entry is keyed by kernel, phase, slices, in/out features, max rank and dtype, and holds
the ``Tiles`` that ran fastest over that phase's token counts. The phase is ``decode`` for launches of
up to ``SPLIT_TOKENS`` tokens and ``prefill`` above; the sweep keeps the shrink's ``k`` and ``chunk``
the same in both phases of a shape, so a row sums in the same steps whichever phase its step is in
(see ``kernels.lora_shrink``). Shapes or devices without an entry take the launchers'
``default_tiles``; on a CPU (the interpreter) there is no table.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

from kernels.lora_launch import Tiles
from kernels.lora_meta import SPLIT_TOKENS

TABLES = Path(__file__).resolve().parent / "tuned"


def phase(num_tokens: int) -> str:
    return "decode" if num_tokens <= SPLIT_TOKENS else "prefill"


def table_path(device_name: str) -> Path:
    return TABLES / f"{re.sub(r'[^a-z0-9]+', '-', device_name.lower()).strip('-')}.json"


def entry_key(kernel: str, phase_name: str, slices: int, features: int, max_rank: int, dtype: torch.dtype) -> str:
    """``features``: in_features for the shrink, out_features for the expand."""
    return f"{kernel}/{phase_name}/s{slices}/f{features}/r{max_rank}/{str(dtype).removeprefix('torch.')}"


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


def tuned(kernel: str, num_tokens: int, slices: int, features: int, max_rank: int, dtype: torch.dtype,
          device_name: str) -> Tiles | None:
    """The tuned tiles of a launch on the GPU named ``device_name``, None where none were measured."""
    if not device_name:
        return None
    return _table(device_name).get(entry_key(kernel, phase(num_tokens), slices, features, max_rank, dtype))


def shrink_tiles(num_tokens: int, slices: int, in_features: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> Tiles:
    from kernels.lora_shrink import default_tiles

    found = tuned("shrink", num_tokens, slices, in_features, max_rank, dtype, _device_name(device))
    return found or default_tiles(num_tokens, max_rank, dtype)


def expand_tiles(num_tokens: int, slices: int, out_features: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> Tiles:
    from kernels.lora_expand import default_tiles

    found = tuned("expand", num_tokens, slices, out_features, max_rank, dtype, _device_name(device))
    return found or default_tiles(num_tokens, max_rank)

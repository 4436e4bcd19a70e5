"""vLLM's and SGLang's multi-LoRA Triton kernels, run on the same weights and tokens as ours, for
side-by-side timings (benchmarks/lora_sweep.py). They are not part of the project: they are imported
from a folder given on the command line (``--peers PATH``, the standalone copies described in that
folder's README), never copied here.

Each peer gets the same problem in its own layout: vLLM per-slice lists of A ``[L, R, in]`` and B
``[L, out_s, R]`` with metadata from its ``LoRAKernelMeta``; SGLang's ``csgmv`` backend (its default),
A packed ``[L + 1, S * R, in]`` and B ``[L + 1, out, R]`` with an empty slot for rank 0, tokens grouped
by adapter through a permutation, segments cut to 16 tokens. Metadata is built before timing (both
peers prepare it on the host); what is timed is the shrink and the expand, as ours.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

CSGMV_CHUNK = 16  # SGLang's default --max-lora-chunk-size


def load(path: Path) -> dict[str, object]:
    """The peers' modules by name, from ``path``; raises ImportError naming what is missing."""
    if not (path / "vllm_lora").is_dir() or not (path / "sglang_lora").is_dir():
        raise ImportError(f"--peers {path}: expected the folders vllm_lora and sglang_lora there")
    sys.path.insert(0, str(path))
    # SGLang's launch cache keys its compiled kernels on some constexprs only (not on the rank), so a
    # second rank would reuse the first one's kernel: off, as the peers' README says.
    os.environ["SGLANG_USE_CUSTOM_TRITON_KERNEL_CACHE"] = "0"
    import sglang_lora
    import vllm_lora

    return {"vllm": vllm_lora, "sglang": sglang_lora}


def vllm_runner(vl, x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                offsets: list[int], token_slots: list[int]) -> Callable[[], None]:
    """``y += LoRA(x)`` through vLLM's lora_shrink and lora_expand. ``lora_a``: ours, [S, L, R, in];
    ``lora_b``: ours, [L, out, R]."""
    num_slices, num_slots, rank, _ = lora_a.shape
    vl.clear_ptr_cache()  # its pointer cache is keyed by the weights' addresses
    a = [lora_a[s] for s in range(num_slices)]  # S x [L, R, in], equal strides
    b = [lora_b[:, lo:hi].contiguous() for lo, hi in zip(offsets, offsets[1:], strict=False)]  # S x [L, out_s, R]
    tokens = len(token_slots)
    meta = vl.LoRAKernelMeta.make(max_loras=num_slots, max_num_tokens=tokens, device=x.device)
    meta.prepare_tensors(torch.tensor(token_slots, dtype=torch.int32, device=x.device))
    args = meta.meta_args(tokens, specialize_active_lora=False)
    buf = torch.empty(num_slices, tokens, rank, dtype=torch.float32, device=x.device)  # zeroed by lora_shrink

    def run() -> None:
        vl.lora_shrink(x, a, buf, *args, 1.0)
        vl.lora_expand(buf, b, y, *args, offset_start=0, add_inputs=True)

    return run


def sglang_runner(sg, x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  offsets: list[int], token_slots: list[int]) -> Callable[[], None]:
    """``y += LoRA(x)`` through SGLang's chunked SGMV shrink and expand (every slot of rank R)."""
    num_slices, num_slots, rank, in_features = lora_a.shape
    dev = x.device
    a = torch.zeros(num_slots + 1, num_slices * rank, in_features, dtype=x.dtype, device=dev)
    a[:num_slots] = lora_a.permute(1, 0, 2, 3).reshape(num_slots, num_slices * rank, in_features)
    b = torch.zeros(num_slots + 1, lora_b.shape[1], rank, dtype=x.dtype, device=dev)
    b[:num_slots] = lora_b
    ranks = torch.tensor([rank] * num_slots + [0], dtype=torch.int32, device=dev)
    scalings = torch.tensor([1.0] * num_slots + [0.0], dtype=torch.float32, device=dev)
    slots = [num_slots if s < 0 else s for s in token_slots]
    perm = sorted(range(len(slots)), key=lambda t: slots[t])  # stable: grouped by adapter
    ids, lens = [], []
    for t in perm:  # runs of one adapter in permuted order, cut to CSGMV_CHUNK tokens
        if ids and ids[-1] == slots[t] and lens[-1] < CSGMV_CHUNK:
            lens[-1] += 1
        else:
            ids.append(slots[t])
            lens.append(1)
    i32 = dict(dtype=torch.int32, device=dev)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], **i32)
    info = sg.LoRABatchInfo(use_cuda_graph=False, bs=len(ids), num_segments=len(ids), seg_indptr=indptr,
                            weight_indices=torch.tensor(ids, **i32), lora_ranks=ranks, scalings=scalings,
                            max_len=CSGMV_CHUNK, seg_lens=None, permutation=torch.tensor(perm, **i32))
    slice_offsets = torch.tensor(offsets, **i32)
    slice_offsets_cpu = slice_offsets.cpu()
    widest = max(hi - lo for lo, hi in zip(offsets, offsets[1:], strict=False))

    def run() -> None:
        h = sg.chunked_sgmv_lora_shrink_forward(x, a, info, num_slices=num_slices)
        sg.chunked_sgmv_lora_expand_forward(h, b, info, slice_offsets, widest, base_output=y,
                                            slice_offsets_cpu=slice_offsets_cpu)

    return run


RUNNERS = {"vllm": vllm_runner, "sglang": sglang_runner}

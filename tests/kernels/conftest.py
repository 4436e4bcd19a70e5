"""Kernel tests run the Triton kernels for real on a GPU, and under Triton's interpreter on CPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # triton.jit picks the interpreter when a kernel is defined, i.e. when kernels.lora_shrink and
    # kernels.lora_expand are first imported: this must run before the test modules import them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

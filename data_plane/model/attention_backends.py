"""Which attention backend a model runs, chosen once by device: the Triton paged kernels on CUDA; on CPU
the native kernel that reads the cache in place where it builds and takes the cache, else tiled
attention over gathered contexts. Apart from ``attention``, whose Protocol and inputs both backends import, so that no
module imports a backend that imports it back."""

from __future__ import annotations

import torch

from data_plane.model import native_attention
from data_plane.model.attention import AttentionBackend
from data_plane.model.native_attention import NativeAttention
from data_plane.model.torch_attention import TorchAttention


def attention_backend(device: torch.device | str, windows: set[int | None], row_multiple: int | None = None,
                      native: tuple[torch.dtype, int] | None = None) -> AttentionBackend:
    """The backend for ``device``: the Triton paged kernels on CUDA; on CPU the native kernel where
    ``native`` (the cache's dtype and head dimension) is given and the kernel takes it
    (``native_attention.unusable``), else tiled attention. ``windows``: the sliding windows of the model's
    layers (None: full attention); ``row_multiple``: the query rows tiled attention's matmuls compute a
    multiple of (default: ``tiled_attention.ROW_MULTIPLE``)."""
    if torch.device(device).type == "cuda":
        from data_plane.model.triton_attention import TritonAttention  # Triton: the `cuda` extra

        return TritonAttention()
    if native is not None and not native_attention.unusable(*native):
        return NativeAttention(native_attention.kernel())
    return TorchAttention(windows) if row_multiple is None else TorchAttention(windows, row_multiple)

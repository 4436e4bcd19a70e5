"""An adapter's weights file, memory-mapped and hashed in one pass over its bytes.

A safetensors file is mapped, not read into a bytes object: its tensors are views of the mapping,
so the staging copy (``peft_adapter``) is the only copy the bytes get, and sha256 runs over the
same mapping on another thread (hashlib releases the GIL) while the header is parsed and the
tensors are checked and staged. The sha256 is of the whole file, as the registry records it.

The header is parsed here rather than by the safetensors package: the names, dtypes and shapes come
from it without building a tensor per entry, and every way a file can be truncated or corrupt is
checked (and named) before a byte of data is used.

A file mapped here must not be truncated in place while it is read (a write to a new file and a
rename, as the download cache does, is safe): reading a page past a shrunk end raises SIGBUS.
"""

from __future__ import annotations

import _thread
import hashlib
import io
import json
import math
import mmap
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from data_plane.errors import InvalidAdapter

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16,
    "U32": torch.uint32, "U64": torch.uint64,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own bound
# Smaller files are hashed on the reading thread, before the header is parsed: their hash takes a
# millisecond or two, less than handing it to another thread can cost on a busy machine. The pass
# still reads the file (through the mapping) for the staging that follows.
BACKGROUND_HASH_BYTES = 16 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its dtype and shape, and its elements as a flat view."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    flat: torch.Tensor  # [numel], a view of the file's bytes (or of a loaded tensor)


class HashedFile:
    """A file's bytes (mapped when it has any) and its sha256, computed on a thread of its own."""

    def __init__(self, path: Path, size: int) -> None:
        if size:
            with open(path, "rb") as f:
                # A private mapping: writable for torch.frombuffer, and never written, so never copied.
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # [size]
        else:
            self._map = b""
            self.bytes = torch.empty(0, dtype=torch.uint8)
        self._hash = hashlib.sha256()
        self._hashed = threading.Event()
        self._error: BaseException | None = None
        if size < BACKGROUND_HASH_BYTES:
            self._run()
        else:
            # Not threading.Thread: its start() waits until the new thread runs, which on a busy machine
            # costs a scheduling round before any of the work that overlaps the hash can begin.
            _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        try:
            self._hash.update(self._map)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, on whose thread it is raised
            self._error = e
        finally:
            self._hashed.set()

    def sha256(self) -> str:
        """The file's sha256 (waits for the hashing thread)."""
        self._hashed.wait()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()


def open_weights(name: str, path: Path, max_bytes: int) -> HashedFile:
    """Maps ``path`` and starts hashing it; refuses a file over ``max_bytes``."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise InvalidAdapter(f"adapter {name!r}: {path.name} is {size} bytes, over the pod's limit of {max_bytes}")
        return HashedFile(path, size)
    except OSError as e:
        raise InvalidAdapter(f"adapter {name!r}: cannot read {path.name}: {e.strerror}") from None


def safetensors_entries(name: str, data: torch.Tensor) -> dict[str, Entry]:
    """The tensors of a safetensors file whose bytes are ``data`` ([size] uint8), as views of it.

    Raises InvalidAdapter when the header is not a JSON object of well-formed entries, or when the
    entries' data do not tile the rest of the file exactly (a truncated or padded file)."""

    def corrupt(detail: str) -> InvalidAdapter:
        return InvalidAdapter(f"adapter {name!r}: adapter_model.safetensors is truncated or corrupt: {detail}")

    size = data.numel()
    if size < 8:
        raise corrupt(f"it is {size} bytes, shorter than the 8-byte header length")
    header_len = int.from_bytes(data[:8].numpy().tobytes(), "little")
    if header_len > min(size - 8, MAX_HEADER_BYTES):
        raise corrupt(f"its header claims {header_len} bytes, but the file holds {size - 8} after the length")
    try:
        header = json.loads(data[8 : 8 + header_len].numpy().tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    header.pop("__metadata__", None)
    body = data[8 + header_len :]
    spans = []
    for key, info in header.items():
        try:
            dtype, shape, (start, end) = DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
            numel = math.prod(shape)
            # type() rather than isinstance(): JSON's true and false must not pass for numbers.
            if type(numel) is not int or type(start) is not int or type(end) is not int or \
                    min(shape, default=0) < 0 or start < 0:
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"the header entry {key!r} is malformed: {info!r}") from None
        if end - start != numel * dtype.itemsize:
            raise corrupt(f"{key!r} has shape {list(shape)} of {info['dtype']}, but {end - start} bytes of data")
        spans.append((start, end, key, dtype, shape))
    spans.sort()
    expected = 0
    for start, end, key, _, _ in spans:
        if start != expected:
            raise corrupt(f"{key!r} starts at byte {start} of the data, where {expected} was expected")
        expected = end
    if expected != body.numel():
        raise corrupt(f"its tensors need {expected} bytes of data, but the file holds {body.numel()}")
    dtypes = {dtype for *_, dtype, _ in spans}
    if len(dtypes) == 1:  # the usual file: the whole body as that dtype, split in one call into views
        (dtype,) = dtypes
        pieces = torch.split(_as_dtype(body, dtype), [(end - start) // dtype.itemsize for start, end, *_ in spans])
    else:
        pieces = [_as_dtype(p, dtype) for p, (*_, dtype, _) in
                  zip(torch.split(body, [end - start for start, end, *_ in spans]), spans, strict=True)]
    return {key: Entry(dtype, shape, piece) for piece, (_, _, key, dtype, shape) in zip(pieces, spans, strict=True)}


def pickle_entries(name: str, file: HashedFile) -> dict[str, Entry]:
    """The tensors of a pickled state dict (``adapter_model.bin``), loaded with ``weights_only``."""
    try:
        tensors = torch.load(io.BytesIO(file.bytes.numpy().tobytes()), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise InvalidAdapter(f"adapter {name!r}: adapter_model.bin was refused by the safe loader: {e}") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise InvalidAdapter(f"adapter {name!r}: adapter_model.bin must hold a dict of tensors")
    return {key: Entry(t.dtype, tuple(t.shape), t.reshape(-1)) for key, t in tensors.items()}


def _as_dtype(piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        return piece.view(dtype)
    except RuntimeError:  # an offset not aligned to the element size (old writers did not pad the header)
        return piece.clone().view(dtype)

"""An adapter's weights file, read into host memory and hashed in one pass over its bytes.

The file is read in chunks into one buffer (page-locked when the slots are on a GPU), by a thread
of its own once the header is in, and sha256 runs over each chunk on another thread as soon as it
has arrived (hashlib and the reads release the GIL), so the hash ends one chunk's hash after the
read does. The tensors lie in that buffer (each entry is an offset into one view of it): the
adapter keeps it as its host copy, and a slot write copies from it, so the bytes are written once
in host memory (by the read) and once into the slots. The sha256 is of the whole file, as the
registry records it, and of the very bytes the views hold: a file rewritten after the read
changes nothing that was verified.

The header is parsed here rather than by the safetensors package: the names, dtypes and shapes come
from it without building a tensor per entry, and every way a file can be truncated or corrupt is
checked (and named) before a byte of data is used.
"""

from __future__ import annotations

import _thread
import hashlib
import io
import json
import math
import pickle
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from data_plane.errors import InvalidAdapter

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16,
    "U32": torch.uint32, "U64": torch.uint64,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own bound
# Smaller files are hashed on the reading thread after the read: their hash takes well under a
# millisecond, less than handing it to another thread can cost.
BACKGROUND_HASH_BYTES = 1 << 20
# The hashing thread follows the read one chunk behind: the hash ends one chunk's hash (~2 ms at
# 2 GB/s) after the read. Each chunk is a handover between the threads, each needing the GIL, which the
# caller holds while it parses the header: read in one chunk rather than three of 1 MiB, the demo's
# shouty (2.5 MB) loaded 0.2-0.4 ms sooner (medians of 61 cold loads, two runs).
CHUNK_BYTES = 4 << 20
_ALIGN = 8  # bytes; every dtype's element size divides it


class Entry(NamedTuple):
    """One tensor of the file: its dtype and shape, and where its elements lie (a file has hundreds:
    a tuple, with no view of its own, is the cheapest thing to make per entry)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: torch.Tensor  # [n] of ``dtype``, a view of the weights' buffer that holds its elements
    at: int  # the index in ``data`` of its first element


@dataclass(frozen=True)
class Weights:
    """The tensors of a weights file, all views of one buffer."""

    entries: dict[str, Entry]
    buffer: torch.Tensor  # [nbytes] uint8, the host memory every entry views
    runs: tuple[torch.Tensor, ...]  # flat views that together hold every entry's elements (one when one dtype)


class HashedFile:
    """A file's bytes, read into ``bytes``, and their sha256, computed on a thread of its own.

    With ``lead`` (given the file's first 8 bytes, how many leading bytes are needed at once: a
    safetensors header), a file of at least BACKGROUND_HASH_BYTES returns once those are read and
    reads the rest on a thread of its own too, so that the header's entries are parsed and checked
    while the data arrives; ``wait_read`` waits for the rest, and raises what the read raised. Without
    it, or for a smaller file, the whole file is read before the constructor returns."""

    def __init__(self, path: Path, size: int, pin_memory: bool = False,
                 lead: Callable[[bytes], int] | None = None) -> None:
        self.path = path
        self.bytes = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)  # [size]
        self._hash = hashlib.sha256()
        self._hashed = threading.Event()
        self._read = threading.Event()
        self._error: BaseException | None = None
        self._read_error: BaseException | None = None
        view = memoryview(self.bytes.numpy())
        f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by whichever thread reads the end
        try:
            if size < BACKGROUND_HASH_BYTES:
                _read_into(f, view)
                _at_end(f)
                self._run([view, None])
                self._read.set()
                return
            head = 0
            if lead is not None and size >= 8:
                _read_into(f, view[:8])
                head = min(size, max(8, lead(bytes(view[:8]))))
                _read_into(f, view[8:head])
            chunks: queue.SimpleQueue = queue.SimpleQueue()  # memoryviews read so far, then None
            # Not threading.Thread: its start() waits until the new thread runs, which on a busy machine
            # costs a scheduling round before any of the work that overlaps the hash can begin.
            try:
                _thread.start_new_thread(self._run, (iter(chunks.get, None),))
            except RuntimeError as e:
                raise OSError(0, f"no thread to hash it on ({e})") from None
            if head:
                chunks.put(view[:head])
                begun = _thread.allocate_lock()
                begun.acquire()
                try:
                    _thread.start_new_thread(self._read_rest, (f, view, head, chunks, begun.release))
                except RuntimeError as e:  # no thread to be had: the hash thread must still end
                    chunks.put(None)
                    raise OSError(0, f"no thread to read it on ({e})") from None
                f = None  # the reading thread closes it
                # A new thread needs the GIL to begin, and the caller goes on to parse the header in Python,
                # which holds it for milliseconds: wait until the read is under way, so that it overlaps the parse.
                begun.acquire()
                return
            self._read_rest(f, view, 0, chunks)
            f = None
            if self._read_error is not None:
                raise self._read_error
        finally:
            if f is not None:
                f.close()

    def _read_rest(self, f: io.RawIOBase, view: memoryview, start: int, chunks: queue.SimpleQueue,
                   begun: Callable[[], None] = lambda: None) -> None:
        """Calls ``begun``, then reads ``view[start:]`` chunk by chunk, handing each to the hash; closes ``f``."""
        begun()
        try:
            for at in range(start, len(view), CHUNK_BYTES):
                chunk = view[at : at + CHUNK_BYTES]
                _read_into(f, chunk)
                chunks.put(chunk)
            _at_end(f)
        except BaseException as e:  # noqa: BLE001 - raised by wait_read, on the caller's thread
            self._read_error = e
        finally:
            chunks.put(None)
            f.close()
            self._read.set()

    def wait_read(self) -> None:
        """Waits until every byte is in ``bytes``; raises what the read raised (OSError)."""
        self._read.wait()
        if self._read_error is not None:
            raise self._read_error

    def _run(self, chunks) -> None:
        try:
            for chunk in chunks:
                if chunk is None:
                    break
                self._hash.update(chunk)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, on whose thread it is raised
            self._error = e
        finally:
            self._hashed.set()

    def sha256(self) -> str:
        """The file's sha256 (waits for the read and the hashing thread)."""
        self.wait_read()
        self._hashed.wait()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()


class _Changed(OSError):
    """The file's size changed while it was read."""


def _read_into(f: io.RawIOBase, view: memoryview) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise _Changed(0, "it got shorter while it was read (is it still being written?)")
        done += n


def _at_end(f: io.RawIOBase) -> None:
    if f.read(1):
        raise _Changed(0, "it got longer while it was read (is it still being written?)")


def open_weights(name: str, path: Path, max_bytes: int, pin_memory: bool = False,
                 lead: Callable[[bytes], int] | None = None) -> HashedFile:
    """Reads ``path`` and hashes it; refuses a file over ``max_bytes``. ``pin_memory``: read it into
    page-locked memory (for slots on a GPU). ``lead``: see ``HashedFile``; then ``wait_read`` before
    any byte past the lead is looked at."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise InvalidAdapter(f"adapter {name!r}: {path.name} is {size} bytes, over the pod's limit of {max_bytes}")
        return HashedFile(path, size, pin_memory, lead)
    except OSError as e:
        raise _unreadable(name, path, e) from None


def wait_read(name: str, file: HashedFile) -> None:
    """Waits for the rest of ``file``; a read that failed is refused as ``open_weights`` refuses it."""
    try:
        file.wait_read()
    except OSError as e:
        raise _unreadable(name, file.path, e) from None


def _unreadable(name: str, path: Path, e: OSError) -> InvalidAdapter:
    return InvalidAdapter(f"adapter {name!r}: cannot read {path.name}: {e.strerror}")


def safetensors_lead(first: bytes) -> int:
    """The leading bytes of a safetensors file to read at once, from its first 8: the length field and
    the header (8 alone when the length is implausible: ``safetensors_weights`` refuses it unread)."""
    header_len = int.from_bytes(first, "little")
    return 8 + header_len if header_len <= MAX_HEADER_BYTES else 8


def safetensors_weights(name: str, data: torch.Tensor, ready: Callable[[], None] = lambda: None) -> Weights:
    """The tensors of a safetensors file whose bytes are ``data`` ([size] uint8), as views of it.

    Only the length field and the header are read here, unless the data must be copied to be aligned:
    ``ready`` is called first then (a file still being read: ``wait_read``). Raises InvalidAdapter when
    the header is not a JSON object of well-formed entries, or when the entries' data do not tile the
    rest of the file exactly (a truncated or padded file)."""

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
    if (8 + header_len) % _ALIGN:  # old writers did not pad the header: one aligned copy of the data
        ready()
        body = body.clone()
    dtypes = {dtype for *_, dtype, _ in spans}
    if len(dtypes) == 1:  # the usual file: the whole body as that dtype, each entry an offset into it
        (dtype,) = dtypes
        run = body.view(dtype)
        entries = {key: Entry(dtype, shape, run, start // dtype.itemsize) for start, _, key, dtype, shape in spans}
        return Weights(entries, body, (run,))
    raw = torch.split(body, [end - start for start, end, *_ in spans])
    try:
        runs = tuple(p.view(dtype) for p, (*_, dtype, _) in zip(raw, spans, strict=True))
    except RuntimeError:  # a tensor not aligned to its element size: a copy of each, aligned
        ready()
        return _copied({key: (dtype, shape, p) for p, (_, _, key, dtype, shape) in zip(raw, spans, strict=True)})
    entries = {key: Entry(dtype, shape, run, 0) for run, (_, _, key, dtype, shape) in zip(runs, spans, strict=True)}
    return Weights(entries, body, runs)


def pickle_weights(name: str, file: HashedFile) -> Weights:
    """The tensors of a pickled state dict (``adapter_model.bin``), loaded with ``weights_only`` and
    copied into one buffer."""
    try:
        tensors = torch.load(io.BytesIO(file.bytes.numpy().tobytes()), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise InvalidAdapter(f"adapter {name!r}: adapter_model.bin was refused by the safe loader: {e}") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise InvalidAdapter(f"adapter {name!r}: adapter_model.bin must hold a dict of tensors")
    return _copied({key: (t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8)) for key, t in tensors.items()})


def _copied(tensors: dict[str, tuple[torch.dtype, tuple[int, ...], torch.Tensor]]) -> Weights:
    """Weights holding a copy of each (dtype, shape, bytes) in one buffer, each aligned."""
    starts, total = [], 0
    for _, _, raw in tensors.values():
        starts.append(total)
        total += -(-raw.numel() // _ALIGN) * _ALIGN
    buffer = torch.empty(total, dtype=torch.uint8)  # [total]
    entries = {}
    for start, (key, (dtype, shape, raw)) in zip(starts, tensors.items(), strict=True):
        target = buffer[start : start + raw.numel()]
        target.copy_(raw)
        entries[key] = Entry(dtype, shape, target.view(dtype), 0)
    return Weights(entries, buffer, tuple(e.data for e in entries.values()))

"""``DiskTier``: the pod's downloaded adapters on local disk, below the CPU tier.

Content-addressed: ``<root>/<sha256 of the weights>/`` holds ``adapter_config.json`` and
``adapter_model.safetensors`` (and ``source.json``, where the copy came from), so two names or two
sources with the same weights share one copy, and a copy is found by the registered digest alone. At
most ``capacity_bytes`` are kept; the least recently used copies go first, never one being read. The
directory outlives the process: a restarted pod scans it and serves what it finds (the recency order
is kept in the copies' modification times), and removes downloads a crash left unfinished.

A download is staged in ``<root>/.staging-*`` and enters the tier by one rename, after its digest
was verified, so a half-written copy is never found. Safe to use from several threads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SOURCE_FILE = "source.json"
_STAGING = ".staging-"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_OLD_LAYOUT = re.compile(r"^[0-9a-f]{32}$")  # per-URL directories of earlier versions; content addressing replaced them


@dataclass(frozen=True)
class DiskUsage:
    """The tier at one moment, for metrics: bytes and copies held, and counters since start."""

    capacity_bytes: int
    used_bytes: int
    entries: int
    hits: int
    evictions: int
    downloads: dict[tuple[str, str], int]  # (scheme, outcome) -> downloads
    download_seconds: dict[str, float]  # scheme -> seconds spent in successful downloads


class DiskTier:
    def __init__(self, root: Path, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"the disk tier's capacity must be >= 0 bytes, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, least recently used first
        self._held: Counter[str] = Counter()
        self._guard = threading.Lock()
        self.hits = 0
        self.evictions = 0
        self.downloads: Counter[tuple[str, str]] = Counter()
        self.download_seconds: Counter[str] = Counter()
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        found = []
        for path in self.root.iterdir():
            if path.name.startswith(_STAGING) or (_OLD_LAYOUT.match(path.name) and path.is_dir()):
                shutil.rmtree(path, ignore_errors=True)
            elif _DIGEST.match(path.name) and (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file():
                found.append((path.stat().st_mtime, path.name, dir_size(path)))
        for _, digest, size in sorted(found):
            self._entries[digest] = size
        with self._guard:
            self._evict()

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, digest: str) -> Path | None:
        """The copy whose weights have ``digest``, held (not evicted) until ``release``; None when absent."""
        with self._guard:
            if digest not in self._entries:
                return None
            self._entries.move_to_end(digest)
            self._held[digest] += 1
            self.hits += 1
        path = self.root / digest
        try:
            os.utime(path)  # the recency a restarted pod reads back
        except OSError:
            pass
        return path

    def release(self, digest: str) -> None:
        with self._guard:
            self._held[digest] -= 1
            if self._held[digest] <= 0:
                del self._held[digest]
            self._evict()

    def discard(self, digest: str) -> None:
        """Drops the copy of ``digest`` (one that failed to load: the next load downloads it again)."""
        with self._guard:
            if self._entries.pop(digest, None) is not None:
                shutil.rmtree(self.root / digest, ignore_errors=True)

    # ---- downloads -----------------------------------------------------------------------
    def new_staging(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=_STAGING, dir=self.root))

    def install(self, staging: Path, digest: str, source: dict[str, str]) -> Path:
        """Moves a verified download into the tier (one rename) and returns it, held like a lookup.
        Copies past the capacity are evicted, least recently used first, once no reader holds them."""
        (staging / SOURCE_FILE).write_text(json.dumps(source, sort_keys=True))
        final = self.root / digest
        with self._guard:
            if digest in self._entries:  # the same weights arrived meanwhile, by another name or source
                shutil.rmtree(staging, ignore_errors=True)
            else:
                shutil.rmtree(final, ignore_errors=True)  # a copy the scan found incomplete
                os.rename(staging, final)
                self._entries[digest] = dir_size(final)
            self._entries.move_to_end(digest)
            self._held[digest] += 1
        return final

    def record_download(self, scheme: str, ok: bool, seconds: float) -> None:
        with self._guard:
            self.downloads[(scheme, "ok" if ok else "error")] += 1
            if ok:
                self.download_seconds[scheme] += seconds

    def digests(self, limit: int) -> list[str]:
        """The sha256 of the copies the tier holds, the most recently used ``limit`` of them, least recent first."""
        with self._guard:
            return list(self._entries)[-limit:] if limit > 0 else []

    def usage(self) -> DiskUsage:
        with self._guard:
            return DiskUsage(self.capacity_bytes, sum(self._entries.values()), len(self._entries), self.hits,
                             self.evictions, dict(self.downloads), dict(self.download_seconds))

    def _evict(self) -> None:
        """Drops least recently used copies no reader holds until the tier fits. Under the guard."""
        used = sum(self._entries.values())
        for digest in list(self._entries):
            if used <= self.capacity_bytes:
                return
            if self._held[digest] > 0:
                continue
            used -= self._entries.pop(digest)
            shutil.rmtree(self.root / digest, ignore_errors=True)
            self.evictions += 1


def dir_size(path: Path) -> int:
    """Bytes of the files directly in ``path``."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())

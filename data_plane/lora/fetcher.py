"""``AdapterFetcher``: brings a remote adapter (``http(s)://``, ``s3://``, ``hf://``) into the disk tier
and hands its local directory to the reader.

Order of a fetch: the source must pass the allow-list; a copy in the disk tier whose digest is the
registered sha256 is used as it is (a disk hit); otherwise the files are downloaded into a staging
directory, the weights' sha256 is compared with the registered one (FAILED_PRECONDITION when they
differ: nothing is kept), and the reader validates the staged copy. Only a copy the reader accepted
enters the tier, by one rename, so a failed or partial download leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from data_plane.errors import DigestMismatch, InvalidAdapter
from data_plane.lora.disk_tier import WEIGHTS_FILE, DiskTier, dir_size
from data_plane.lora.http_source import HttpSource, redact
from data_plane.lora.hub_source import HubSettings, HubSource
from data_plane.lora.load_times import LoadTimes
from data_plane.lora.s3_source import S3Settings, S3Source
from data_plane.lora.source_policy import SourcePolicy, source_scheme

log = logging.getLogger("lorafleet.adapters")
REMOTE_SCHEMES = ("http", "https", "s3", "hf")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FetchSettings:
    """Where downloads go and how they are made: one per pod, built from its config."""

    cache_dir: Path
    disk_cache_bytes: int = 10 << 30
    timeout_s: float = 30.0
    max_bytes: int = 2 << 30
    policy: SourcePolicy = field(default_factory=SourcePolicy)
    s3: S3Settings = field(default_factory=S3Settings)
    hub: HubSettings = field(default_factory=HubSettings)


def is_remote(source: str) -> bool:
    return source_scheme(source) in REMOTE_SCHEMES


def shown(source: str) -> str:
    """``source`` as messages, logs and metrics may show it: no credentials, query or fragment."""
    return redact(source)


class AdapterFetcher:
    def __init__(self, settings: FetchSettings) -> None:
        self.settings = settings
        self.policy = settings.policy
        self.tier = DiskTier(settings.cache_dir, settings.disk_cache_bytes)
        self.times = LoadTimes()  # downloads' times here; the pod's other load times beside them (LoraRuntime)
        http = HttpSource(settings.policy, settings.max_bytes, settings.timeout_s)
        self._sources = {"http": http, "https": http,
                         "s3": S3Source(settings.s3, settings.max_bytes, settings.timeout_s),
                         "hf": HubSource(settings.hub, settings.max_bytes, settings.timeout_s)}
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    @contextmanager
    def fetched(self, name: str, source: str, sha256: str = "") -> Iterator[Path]:
        """The local directory holding the adapter at ``source``: the disk tier's copy whose weights
        have digest ``sha256``, else a fresh, verified download (always one when no digest is given).

        A fresh download enters the tier only if the ``with`` block ends without an exception, so a
        copy the reader refused is never reused; a cached copy the reader refused is dropped, so the
        next load downloads it again. Raises SourceDenied, AdapterNotFound, SourceUnavailable,
        DigestMismatch or InvalidAdapter."""
        scheme = self.policy.check(name, source, shown(source))
        expected = sha256.lower()
        with self._lock(expected or source):
            if expected and (hit := self.tier.lookup(expected)) is not None:
                try:
                    yield hit
                except BaseException:
                    self.tier.discard(expected)
                    raise
                finally:
                    self.tier.release(expected)
                return
            staging = self.tier.new_staging()
            try:
                resolved, digest, seconds = self._download(name, scheme, source, expected, staging)
                yield staging
                self.tier.install(staging, digest, {"source": shown(source), "resolved": resolved})
                self.tier.release(digest)
                log.info("adapter downloaded", extra={"adapter": name, "source": shown(source), "sha256": digest,
                                                      "resolved": resolved, "seconds": round(seconds, 3)})
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    def prefetch(self, name: str, source: str, sha256: str) -> bool:
        """Brings the adapter at ``source`` into the disk tier without reading it as an adapter: only
        its digest is checked (the registered one, required). Returns whether it was downloaded (False:
        already on disk). Raises like ``fetched``."""
        scheme = self.policy.check(name, source, shown(source))
        expected = sha256.lower()
        if not expected:
            raise InvalidAdapter(f"adapter {name!r}: a prefetch needs the registered sha256 of its weights")
        with self._lock(expected):
            if self.tier.lookup(expected) is not None:
                self.tier.release(expected)
                return False
            staging = self.tier.new_staging()
            try:
                resolved, digest, seconds = self._download(name, scheme, source, expected, staging)
                self.tier.install(staging, digest, {"source": shown(source), "resolved": resolved})
                self.tier.release(digest)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        log.info("adapter prefetched", extra={"adapter": name, "source": shown(source), "sha256": digest,
                                              "resolved": resolved, "seconds": round(seconds, 3)})
        return True

    def _download(self, name: str, scheme: str, source: str, expected: str,
                  staging: Path) -> tuple[str, str, float]:
        """Fetches into ``staging``; returns (what the source resolved to, the weights' sha256, seconds)."""
        start = time.monotonic()
        ok = False
        try:
            resolved = self._sources[scheme].fetch(name, source, staging)
            digest = _digest(staging / WEIGHTS_FILE)
            if expected and digest != expected:
                raise DigestMismatch(
                    f"adapter {name!r}: sha256 of {WEIGHTS_FILE} from {shown(source)} is {digest}, but {expected} "
                    "was registered; the source holds other weights than the registered adapter (register it "
                    "again with the new sha256 if the change is intended)")
            ok = True
            seconds = time.monotonic() - start
            self.times.remote_to_disk(seconds, dir_size(staging))
            return resolved, digest, seconds
        finally:
            self.tier.record_download(scheme, ok, time.monotonic() - start)

    def _lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()

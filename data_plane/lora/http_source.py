"""Adapters served over HTTP(S): downloaded into a pod-local cache, then read like a local directory.

A source ``http(s)://host/path`` is the base URL of a PEFT adapter directory; the pod fetches
``<url>/adapter_config.json`` and ``<url>/adapter_model.safetensors``. The registered sha256 is the
digest of adapter_model.safetensors, the same bytes a local directory's digest covers.

Cache layout: ``<cache_dir>/<url key>/<sha256 of the weights>/``. A download is staged in
``<cache_dir>/.staging-*`` and renamed into place only after every byte arrived and the digest
matched, so a half-download is never read and a failed one leaves the cache as it was. The cache
directory belongs to one pod: staging left by a crashed process is removed at start.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from data_plane.errors import AdapterNotFound, InvalidAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
HTTP_SCHEMES = ("http", "https")
_CHUNK = 1 << 20
_MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few KB; anything near this is not one
_STAGING = ".staging-"


def is_http_source(source: str) -> bool:
    return urlparse(source).scheme in HTTP_SCHEMES


def redact(url: str) -> str:
    """``url`` without credentials, query or fragment: what messages and logs may show."""
    p = urlparse(url)
    return f"{p.scheme}://{p.netloc.rpartition('@')[2]}{p.path}"


class _RedirectRefused(urllib.error.URLError):
    pass


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects only to http(s): urllib alone would also follow one to ftp."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        scheme = urlparse(newurl).scheme
        if scheme not in HTTP_SCHEMES:
            fp.close()
            raise _RedirectRefused(f"redirected ({code}) to {redact(newurl)}; only redirects to http and https "
                                   "are followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class HttpAdapterCache:
    """Downloads http(s) adapter sources into ``cache_dir``, at most ``max_bytes`` per file, each
    socket operation bounded by ``timeout_s``. Safe to use from several threads."""

    def __init__(self, cache_dir: Path, max_bytes: int, timeout_s: float) -> None:
        self.root = Path(cache_dir)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(_HttpOnlyRedirects)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(f"{_STAGING}*"):
            shutil.rmtree(leftover, ignore_errors=True)

    @contextmanager
    def fetched(self, name: str, url: str, sha256: str = "") -> Iterator[Path]:
        """The local directory holding the adapter at ``url``: a cached copy whose weights have
        digest ``sha256``, else a fresh download (always one when no digest is given).

        A fresh download enters the cache only if the ``with`` block ends without an exception,
        so a copy the caller refused is never reused. The directory is not replaced by another
        download of the same URL until the block ends.

        Raises AdapterNotFound when the server answers 404, InvalidAdapter for every other failure.
        """
        base = _base_url(name, url)
        expected = sha256.lower()
        key = hashlib.sha256(base.encode()).hexdigest()[:32]
        with self._lock(key):
            entry = self.root / key
            if expected and _weights_digest(entry / expected) == expected:
                yield entry / expected
                return
            staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=self.root))
            try:
                digest = self._download(name, base, expected, staging)
                yield staging
                _install(staging, entry, digest)
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    def _lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def _download(self, name: str, base: str, expected: str, staging: Path) -> str:
        """Fetches both files into ``staging``; returns the sha256 of the weights."""
        self._fetch(name, f"{base}/{CONFIG_FILE}", staging / CONFIG_FILE, min(self.max_bytes, _MAX_CONFIG_BYTES))
        digest = self._fetch(name, f"{base}/{WEIGHTS_FILE}", staging / WEIGHTS_FILE, self.max_bytes)
        if expected and digest != expected:
            raise InvalidAdapter(
                f"adapter {name!r}: sha256 of {WEIGHTS_FILE} from {redact(base)} is {digest}, but {expected} "
                "was registered; the server holds other weights than the registered adapter"
            )
        return digest

    def _fetch(self, name: str, url: str, dest: Path, limit: int) -> str:
        """Streams ``url`` into ``dest``; returns the sha256 of the bytes received."""
        shown = redact(url)
        digest, received, declared = hashlib.sha256(), 0, None
        try:
            with self._opener.open(url, timeout=self.timeout_s) as resp, open(dest, "wb") as out:
                length = resp.headers.get("Content-Length")
                declared = int(length) if length and length.isdigit() else None
                if declared is not None and declared > limit:
                    raise InvalidAdapter(f"adapter {name!r}: {shown} is {declared} bytes, over the pod's limit "
                                         f"of {limit} (--max-adapter-bytes)")
                while chunk := resp.read(_CHUNK):
                    received += len(chunk)
                    if received > limit:
                        raise InvalidAdapter(f"adapter {name!r}: {shown} sent more than the pod's limit of "
                                             f"{limit} bytes (--max-adapter-bytes)")
                    digest.update(chunk)
                    out.write(chunk)
        except urllib.error.HTTPError as e:
            e.close()
            if e.code == 404:
                raise AdapterNotFound(
                    f"adapter {name!r}: {shown} answered 404 Not Found; the source must be the base URL of a "
                    f"directory serving {CONFIG_FILE} and {WEIGHTS_FILE}"
                ) from None
            raise InvalidAdapter(f"adapter {name!r}: {shown} answered HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:
            why = f"no answer within {self.timeout_s:g}s" if isinstance(e.reason, TimeoutError) else e.reason
            raise InvalidAdapter(f"adapter {name!r}: cannot fetch {shown}: {why}") from None
        except TimeoutError:
            raise InvalidAdapter(f"adapter {name!r}: {shown} stalled for {self.timeout_s:g}s after "
                                 f"{received} bytes") from None
        except http.client.IncompleteRead:
            raise InvalidAdapter(f"adapter {name!r}: {shown} closed the connection mid-body after {received} "
                                 "bytes; the download is incomplete") from None
        except (http.client.HTTPException, OSError, ValueError) as e:
            raise InvalidAdapter(f"adapter {name!r}: downloading {shown} failed: {e}") from None
        if declared is not None and received != declared:
            raise InvalidAdapter(f"adapter {name!r}: {shown} closed the connection after {received} of "
                                 f"{declared} bytes")
        return digest.hexdigest()


def _base_url(name: str, url: str) -> str:
    p = urlparse(url)
    try:
        valid = p.scheme in HTTP_SCHEMES and bool(p.hostname) and (p.port or 0) > -1
    except ValueError:  # a port that is not a number in 0..65535
        valid = False
    if not valid:
        raise InvalidAdapter(f"adapter {name!r}: {redact(url)} is not an http(s)://host[:port]/path URL")
    if p.username or p.password:
        raise InvalidAdapter(f"adapter {name!r}: the source URL for {redact(url)} carries credentials, which "
                             "would be stored and shown; serve the adapter from a URL that needs none")
    if p.query or p.fragment:
        raise InvalidAdapter(f"adapter {name!r}: the source {redact(url)} has a query or fragment; give the "
                             f"base URL of the directory that serves {CONFIG_FILE} and {WEIGHTS_FILE}")
    return url.rstrip("/")


def _install(staging: Path, entry: Path, digest: str) -> None:
    """Moves a validated download to ``entry/digest`` (one rename) and drops earlier versions of its URL."""
    entry.mkdir(exist_ok=True)
    final = entry / digest
    if final.exists():  # the same weights, fetched again because no digest was given to check against
        shutil.rmtree(final)
    os.rename(staging, final)
    for old in entry.iterdir():
        if old != final:
            shutil.rmtree(old, ignore_errors=True)


def _weights_digest(adapter_dir: Path) -> str | None:
    """The sha256 of a cached copy's weights, or None when the copy is absent or incomplete."""
    if not (adapter_dir / CONFIG_FILE).is_file():
        return None
    digest = hashlib.sha256()
    try:
        with open(adapter_dir / WEIGHTS_FILE, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()

"""Adapters served over HTTP(S): fetched into the pod's disk tier, then read like a local directory.

A source ``http(s)://host/path`` is the base URL of a PEFT adapter directory; the pod fetches
``<url>/adapter_config.json`` and ``<url>/adapter_model.safetensors``. The registered sha256 is the
digest of adapter_model.safetensors, the same bytes a local directory's digest covers. Where the
bytes go, and when they count as downloaded, is ``fetcher.AdapterFetcher``'s business.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from data_plane.errors import AdapterNotFound, InvalidAdapter, SourceDenied, SourceUnavailable
from data_plane.lora.disk_tier import CONFIG_FILE, WEIGHTS_FILE
from data_plane.lora.source_policy import SourcePolicy

HTTP_SCHEMES = ("http", "https")
_CHUNK = 1 << 20
_MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few KB; anything near this is not one


def is_http_source(source: str) -> bool:
    return urlparse(source).scheme in HTTP_SCHEMES


def redact(url: str) -> str:
    """``url`` without credentials, query or fragment: what messages and logs may show."""
    p = urlparse(url)
    return f"{p.scheme}://{p.netloc.rpartition('@')[2]}{p.path}"


class _RedirectRefused(urllib.error.URLError):
    pass


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects only to http(s) sources the policy admits: urllib alone would also follow
    one to ftp, or to a host the allow-list leaves out."""

    def __init__(self, policy: SourcePolicy) -> None:
        super().__init__()
        self._policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        scheme = urlparse(newurl).scheme
        if scheme not in HTTP_SCHEMES:
            fp.close()
            raise _RedirectRefused(f"redirected ({code}) to {redact(newurl)}; only redirects to http and https "
                                   "are followed")
        try:
            self._policy.check("", newurl, redact(newurl))
        except SourceDenied:
            fp.close()
            raise _RedirectRefused(f"redirected ({code}) to {redact(newurl)}, which the pod's "
                                   "--adapter-source-allow does not admit") from None
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _guarded(connection: type[http.client.HTTPConnection], policy: SourcePolicy, scheme: str):
    """``connection`` that refuses, once connected and before sending anything, a peer address the
    policy does not permit (the check sees where the name resolved to this time, not an earlier time)."""

    class Guarded(connection):
        def connect(self):
            super().connect()
            peer = self.sock.getpeername()[0]
            if not policy.permits_address(scheme, self.host, self.port, peer):
                self.sock.close()
                raise SourceDenied(f"{scheme}://{self.host}:{self.port} is {peer}, a loopback or link-local "
                                   f"address; such sources are refused unless --adapter-source-allow names the "
                                   f"host ({scheme}://{self.host})")

    return Guarded


class _GuardedHttp(urllib.request.HTTPHandler):
    def __init__(self, policy: SourcePolicy) -> None:
        super().__init__()
        self._connection = _guarded(http.client.HTTPConnection, policy, "http")

    def http_open(self, req):
        return self.do_open(self._connection, req)


class _GuardedHttps(urllib.request.HTTPSHandler):
    def __init__(self, policy: SourcePolicy) -> None:
        super().__init__()
        self._connection = _guarded(http.client.HTTPSConnection, policy, "https")

    def https_open(self, req):
        return self.do_open(self._connection, req, context=self._context)


class HttpSource:
    """Fetches http(s) adapter sources, at most ``max_bytes`` per file, each socket operation bounded by
    ``timeout_s``; every connection's peer address is checked against ``policy``. Thread-safe."""

    def __init__(self, policy: SourcePolicy, max_bytes: int, timeout_s: float) -> None:
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(_HttpOnlyRedirects(policy), _GuardedHttp(policy),
                                                   _GuardedHttps(policy))

    def fetch(self, name: str, url: str, staging: Path) -> str:
        """Downloads both files of the adapter at ``url`` into ``staging``; returns "" (an http URL
        names no revision to record)."""
        base = _base_url(name, url)
        self._fetch(name, f"{base}/{CONFIG_FILE}", staging / CONFIG_FILE, min(self.max_bytes, _MAX_CONFIG_BYTES))
        self._fetch(name, f"{base}/{WEIGHTS_FILE}", staging / WEIGHTS_FILE, self.max_bytes)
        return ""

    def _fetch(self, name: str, url: str, dest: Path, limit: int) -> None:
        """Streams ``url`` into ``dest``, at most ``limit`` bytes."""
        shown = redact(url)
        received, declared = 0, None
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
                    out.write(chunk)
        except SourceDenied as e:
            raise SourceDenied(f"adapter {name!r}: {e}") from None
        except urllib.error.HTTPError as e:
            e.close()
            raise _http_error(name, shown, e.code, e.reason) from None
        except urllib.error.URLError as e:
            if isinstance(e, _RedirectRefused):
                raise InvalidAdapter(f"adapter {name!r}: cannot fetch {shown}: {e.reason}") from None
            why = f"no answer within {self.timeout_s:g}s" if isinstance(e.reason, TimeoutError) else e.reason
            raise SourceUnavailable(f"adapter {name!r}: cannot fetch {shown}: {why}") from None
        except TimeoutError:
            raise SourceUnavailable(f"adapter {name!r}: {shown} stalled for {self.timeout_s:g}s after "
                                    f"{received} bytes") from None
        except http.client.IncompleteRead:
            raise SourceUnavailable(f"adapter {name!r}: {shown} closed the connection mid-body after {received} "
                                    "bytes; the download is incomplete") from None
        except (http.client.HTTPException, OSError, ValueError) as e:
            raise SourceUnavailable(f"adapter {name!r}: downloading {shown} failed: {e}") from None
        if declared is not None and received != declared:
            raise SourceUnavailable(f"adapter {name!r}: {shown} closed the connection after {received} of "
                                    f"{declared} bytes")


def _http_error(name: str, shown: str, code: int, reason: str) -> Exception:
    if code == 404:
        return AdapterNotFound(f"adapter {name!r}: {shown} answered 404 Not Found; the source must be the base URL "
                               f"of a directory serving {CONFIG_FILE} and {WEIGHTS_FILE}")
    if code in (401, 403):
        return SourceDenied(f"adapter {name!r}: {shown} answered HTTP {code} {reason}; serve the adapter from a URL "
                            "that needs no credentials")
    if code == 429 or code >= 500:
        return SourceUnavailable(f"adapter {name!r}: {shown} answered HTTP {code} {reason}; retry later")
    return InvalidAdapter(f"adapter {name!r}: {shown} answered HTTP {code} {reason}")


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

"""A Hugging Face Hub on loopback: the two routes the real ``huggingface_hub`` client downloads a model
repository's files with, answered as the Hub documents them.

- ``GET /api/models/{repo}/revision/{revision}``: the repository's info, ``sha`` = the revision's commit.
- ``HEAD|GET /{repo}/resolve/{revision}/{filename}``: the file at that revision, with ``X-Repo-Commit``
  (the commit), ``ETag`` (the git blob id, or the sha256 for a large-file-storage file such as
  safetensors weights) and ``Content-Length``; ``Range: bytes=N-`` resumes.

Errors carry ``X-Error-Code`` as the Hub sends it (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``), which the client turns into its typed errors. A repository may require a token
(``Authorization: Bearer ...``); a request without the right one gets 401, as a private repository
answers. Every request's method, path and authorization header is recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import pytest

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<filename>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<revision>[^/]+))?$")
_LFS_SUFFIXES = (".safetensors", ".bin")


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> filename -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    token: str = ""  # "" = public

    def commit_of(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


# Offline switches of huggingface_hub (a shell where models run offline often sets one): with either set,
# the client refuses every request, to a Hub on loopback too.
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextlib.contextmanager
def hub_online() -> Iterator[None]:
    """huggingface_hub allowed to make requests within the block, whatever the shell set: the offline
    variables cleared for processes started meanwhile, and this process's client (which read them when
    imported) told so too."""
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        for name in OFFLINE_VARIABLES:
            patch.delenv(name, raising=False)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield


class HubServer:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, authorization)
        self.truncate: dict[str, int] = {}  # filename -> bytes actually sent of a GET
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}"

    def publish(self, repo: str, files: dict[str, bytes], branch: str = "main", token: str = "") -> str:
        """Commits ``files`` as the new head of ``branch`` of ``repo``; returns the commit id."""
        r = self.repos.setdefault(repo, Repo())
        r.token = token
        commit = hashlib.sha1(repr((repo, len(r.commits), sorted(files))).encode()).hexdigest()
        r.commits[commit] = dict(files)
        r.refs[branch] = commit
        return commit

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- routes ----------------------------------------------------------------------------
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Authorization", "")))
        if m := _INFO.match(path):
            self._info(h, m["repo"], m["revision"] or "main", body)
        elif m := _RESOLVE.match(path):
            self._resolve(h, m["repo"], m["revision"], m["filename"], body)
        else:
            _send(h, 404, b'{"error":"not found"}', {}, body)

    def _repo(self, h, repo: str, body: bool) -> Repo | None:
        r = self.repos.get(repo)
        if r is None:
            _error(h, 404, "RepoNotFound", "Repository not found", body)
            return None
        if r.token and h.headers.get("Authorization") != f"Bearer {r.token}":
            _error(h, 401, "", "Invalid credentials in Authorization header", body)
            return None
        return r

    def _commit(self, h, repo: str, revision: str, body: bool) -> tuple[Repo, str] | None:
        """The repository and the commit ``revision`` names, or None once the error is sent."""
        if (r := self._repo(h, repo, body)) is None:
            return None
        commit = r.commit_of(revision)
        if commit is None:
            _error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
            return None
        return r, commit

    def _info(self, h, repo: str, revision: str, body: bool) -> None:
        if (found := self._commit(h, repo, revision, body)) is None:
            return
        r, commit = found
        info = {"_id": repo, "id": repo, "modelId": repo, "sha": commit, "private": bool(r.token),
                "siblings": [{"rfilename": f} for f in sorted(r.commits[commit])]}
        _send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

    def _resolve(self, h, repo: str, revision: str, filename: str, body: bool) -> None:
        if (found := self._commit(h, repo, revision, body)) is None:
            return
        r, commit = found
        data = r.commits[commit].get(filename)
        if data is None:
            _error(h, 404, "EntryNotFound", f"{filename} does not exist on {revision}", body,
                   {"X-Repo-Commit": commit})
            return
        start = int(m[1]) if (m := re.match(r"bytes=(\d+)-$", h.headers.get("Range", ""))) else 0
        headers = {"X-Repo-Commit": commit, "ETag": f'"{_etag(filename, data)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        sent = data[start:]
        cut = self.truncate.get(filename)
        _send(h, 206 if start else 200, sent, headers, body, length=len(sent),
              limit=None if cut is None else cut)


def _etag(filename: str, data: bytes) -> str:
    """What the Hub names a file by: the sha256 of a large-file-storage file, else its git blob id."""
    if filename.endswith(_LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _error(h, status: int, code: str, message: str, body: bool, extra: dict | None = None) -> None:
    headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(extra or {})}
    _send(h, status, json.dumps({"error": message}).encode(), {"Content-Type": "application/json", **headers}, body)


def _send(h, status: int, data: bytes, headers: dict, body: bool, length: int | None = None,
          limit: int | None = None) -> None:
    h.send_response(status)
    for k, v in headers.items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(data) if length is None else length))
    h.end_headers()
    if body:
        h.wfile.write(data if limit is None else data[:limit])
        if limit is not None:
            h.close_connection = True

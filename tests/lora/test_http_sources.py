"""http(s) adapter sources: a real HTTP server on loopback serves PEFT directories; the pod
downloads them into its disk tier, verifies size and sha256, and reads them like a local directory.
Every failure is typed, names the adapter, and changes neither the adapter caches nor the disk tier.
Loopback addresses are refused unless --adapter-source-allow names the host: these tests name 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from data_plane.errors import AdapterNotFound, DigestMismatch, InvalidAdapter, SourceDenied, SourceUnavailable
from data_plane.lora.fetcher import AdapterFetcher, FetchSettings
from data_plane.lora.peft_adapter import AdapterLimits
from data_plane.lora.runtime import LoraRuntime
from data_plane.lora.source_policy import SourcePolicy
from data_plane.model import load_model

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
LIMIT = 1 << 20
TIMEOUT_S = 1.0


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client that hangs up on an oversized body is what these tests expect


class AdapterServer:
    """Serves ``files`` (URL path -> bytes); ``rules`` (URL path -> function of the handler) replace
    the answer for one path. Every request's path is recorded."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.rules: dict = {}
        self.requests: list[str] = []
        self.release = threading.Event()  # ends a stalled answer
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append(self.path)
                if self.path in server.rules:
                    server.rules[self.path](self)
                elif self.path in server.files:
                    body = server.files[self.path]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    self.send_error(404)

            def log_message(self, *args):
                pass

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}{path}"

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _answer(handler, body: bytes, declared: int | None, sent: int | None = None) -> None:
    """200 with Content-Length ``declared`` (none when None), then the first ``sent`` bytes of body."""
    handler.send_response(200)
    if declared is not None:
        handler.send_header("Content-Length", str(declared))
    handler.end_headers()
    handler.wfile.write(body[:sent] if sent is not None else body)
    handler.close_connection = True


@pytest.fixture(scope="module")
def server():
    s = AdapterServer()
    yield s
    s.close()


@pytest.fixture
def web(server, tiny_adapters):
    """The server serving rank-8 and rank-1 adapters at /r8 and /r1, with no rules and no requests yet."""
    server.files.clear()
    for name in ("r8", "r1"):
        for f in (CONFIG, WEIGHTS):
            server.files[f"/{name}/{f}"] = (tiny_adapters / name / f).read_bytes()
    server.rules.clear()
    server.requests.clear()
    server.release.clear()
    yield server
    server.release.set()


@pytest.fixture(scope="module")
def runtime(tiny_base, tiny_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(tiny_adapters / "r8", root / "r8")
    model = load_model(tiny_base[0], "float32")
    rt = LoraRuntime(model, max_loras=2, max_cpu_loras=3, max_rank=16, max_tokens=64, adapter_roots=(root,),
                     limits=AdapterLimits(max_rank=16, max_bytes=LIMIT),
                     fetcher=_fetcher(tmp_path_factory.mktemp("downloads"), ("file", "http://127.0.0.1")))
    rt.load("resident", "r8")
    return rt


def _fetcher(cache_dir, allow: tuple[str, ...]) -> AdapterFetcher:
    return AdapterFetcher(FetchSettings(cache_dir, timeout_s=TIMEOUT_S, max_bytes=LIMIT, policy=SourcePolicy(allow)))


def _sha(tiny_adapters, name: str) -> str:
    return hashlib.sha256((tiny_adapters / name / WEIGHTS).read_bytes()).hexdigest()


def _disk(runtime) -> list[str]:
    root = runtime.downloads.tier.root
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _state(runtime):
    c = runtime.cache
    return c.list(), c.slot_usage(), c.cpu_usage(), _disk(runtime)


def _refused(runtime, source, error, match, sha256=""):
    before = _state(runtime)
    with pytest.raises(error, match=match) as info:
        runtime.load("web", source, sha256)
    assert "adapter 'web'" in str(info.value)
    assert _state(runtime) == before
    assert "web" not in runtime.cache
    return info.value


def _unload(runtime, name):
    if name in runtime.cache:
        runtime.cache.unload(name)


def test_downloaded_adapter_equals_the_local_directory(runtime, web, tiny_adapters):
    sha = _sha(tiny_adapters, "r8")
    remote = runtime.read("web", web.url("/r8"), sha)
    local = runtime.read("local", "r8", sha)
    assert remote.sha256 == local.sha256 == sha
    assert remote.rank == local.rank == 8
    assert remote.deltas.keys() == local.deltas.keys()
    for path, slices in local.deltas.items():
        assert remote.deltas[path].keys() == slices.keys()
        for s, d in slices.items():
            assert torch.equal(remote.deltas[path][s].a, d.a) and torch.equal(remote.deltas[path][s].b, d.b)
    assert sorted(web.requests) == ["/r8/adapter_config.json", "/r8/adapter_model.safetensors"]
    runtime.load("web", web.url("/r8/"), sha)  # a trailing slash names the same directory
    assert runtime.cache.residency("web").rank == 8
    _unload(runtime, "web")


def test_a_cached_copy_with_the_registered_digest_is_reused_without_a_request(runtime, web, tiny_adapters):
    sha = _sha(tiny_adapters, "r1")
    runtime.read("web", web.url("/r1"), sha)
    assert len(web.requests) == 2
    web.files.clear()  # the server no longer has it: only the cache can answer
    adapter = runtime.read("web", web.url("/r1"), sha)
    assert adapter.sha256 == sha and adapter.rank == 1
    assert len(web.requests) == 2


def test_without_a_digest_the_adapter_is_downloaded_each_time(runtime, web, tiny_adapters):
    runtime.read("web", web.url("/r1"), "")
    runtime.read("web", web.url("/r1"), "")
    assert len(web.requests) == 4


def test_new_weights_at_the_same_url_are_downloaded_and_kept_by_their_own_digest(runtime, web, tiny_adapters):
    url = web.url("/moving")
    for f in (CONFIG, WEIGHTS):
        web.files[f"/moving/{f}"] = web.files[f"/r8/{f}"]
    r8, r1 = _sha(tiny_adapters, "r8"), _sha(tiny_adapters, "r1")
    for digest in (r8, r1):  # earlier tests left both on disk
        runtime.downloads.tier.discard(digest)
    runtime.read("web", url, r8)
    for f in (CONFIG, WEIGHTS):
        web.files[f"/moving/{f}"] = web.files[f"/r1/{f}"]
    assert runtime.read("web", url, r1).rank == 1
    assert len(web.requests) == 4
    assert {r8, r1} <= set(os.listdir(runtime.downloads.tier.root))  # content-addressed: one copy per digest
    assert runtime.read("web", url, r8).rank == 8  # the older weights are still on disk: no request
    assert len(web.requests) == 4


def test_digest_mismatch_is_refused(runtime, web, tiny_adapters):
    runtime.downloads.tier.discard(_sha(tiny_adapters, "r1"))  # else the disk tier holds the registered weights
    err = _refused(runtime, web.url("/r8"), DigestMismatch, "sha256 of adapter_model.safetensors .* was registered",
                   sha256=_sha(tiny_adapters, "r1"))
    assert _sha(tiny_adapters, "r8") in str(err)


def test_missing_adapter_is_not_found(runtime, web):
    _refused(runtime, web.url("/nowhere"), AdapterNotFound, "/nowhere/adapter_config.json answered 404")


def test_missing_weights_are_not_found(runtime, web):
    web.files["/half/adapter_config.json"] = web.files["/r8/adapter_config.json"]
    _refused(runtime, web.url("/half"), AdapterNotFound, "adapter_model.safetensors answered 404")


def test_server_error_is_refused(runtime, web):
    web.rules["/r8/adapter_model.safetensors"] = lambda h: h.send_error(503)
    _refused(runtime, web.url("/r8"), SourceUnavailable, "answered HTTP 503")


def test_a_server_refusing_access_is_permission_denied(runtime, web):
    web.rules["/r8/adapter_config.json"] = lambda h: h.send_error(403)
    _refused(runtime, web.url("/r8"), SourceDenied, "answered HTTP 403")


def test_declared_size_over_the_limit_is_refused_before_reading(runtime, web):
    web.rules["/r8/adapter_model.safetensors"] = lambda h: _answer(h, b"", LIMIT + 1)
    _refused(runtime, web.url("/r8"), InvalidAdapter, f"is {LIMIT + 1} bytes, over the pod's limit of {LIMIT}")


def test_undeclared_body_over_the_limit_is_cut_off_while_streaming(runtime, web):
    web.rules["/r8/adapter_model.safetensors"] = lambda h: _answer(h, b"\0" * (3 * LIMIT), None)
    _refused(runtime, web.url("/r8"), InvalidAdapter, f"sent more than the pod's limit of {LIMIT} bytes")


def test_body_longer_than_declared_is_not_taken(runtime, web):
    weights = web.files["/r8/adapter_model.safetensors"]
    padded = weights + b"\0" * (2 * LIMIT)  # more than the limit in all, behind a small Content-Length
    web.rules["/r8/adapter_model.safetensors"] = lambda h: _answer(h, padded, len(weights) // 2)
    _refused(runtime, web.url("/r8"), InvalidAdapter, "truncated or corrupt")


def test_server_closing_mid_body_is_refused(runtime, web):
    weights = web.files["/r8/adapter_model.safetensors"]
    web.rules["/r8/adapter_model.safetensors"] = lambda h: _answer(h, weights, len(weights), len(weights) // 2)
    _refused(runtime, web.url("/r8"), SourceUnavailable, f"closed the connection .*after {len(weights) // 2}")


def test_connection_refused(runtime, web):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _refused(runtime, f"http://127.0.0.1:{port}/r8", SourceUnavailable, "cannot fetch .*[Rr]efused")


def test_stalled_server_times_out(runtime, web):
    def stall(h):
        h.send_response(200)
        h.send_header("Content-Length", "100")
        h.end_headers()
        h.wfile.write(b"{")
        h.wfile.flush()
        web.release.wait(10)

    web.rules["/r8/adapter_config.json"] = stall
    _refused(runtime, web.url("/r8"), SourceUnavailable, f"stalled for {TIMEOUT_S:g}s")


def _redirect(location: str):
    def answer(h):
        h.send_response(302)
        h.send_header("Location", location)
        h.end_headers()

    return answer


def test_redirect_to_http_is_followed(runtime, web, tiny_adapters):
    web.rules["/old/adapter_model.safetensors"] = _redirect("/r8/adapter_model.safetensors")
    web.files["/old/adapter_config.json"] = web.files["/r8/adapter_config.json"]
    assert runtime.read("web", web.url("/old"), _sha(tiny_adapters, "r8")).rank == 8


def test_redirect_to_another_scheme_is_refused(runtime, web):
    web.rules["/r8/adapter_model.safetensors"] = _redirect("ftp://127.0.0.1/adapter_model.safetensors")
    _refused(runtime, web.url("/r8"), InvalidAdapter, "redirected .302. to ftp://127.0.0.1/adapter_model.safetensors")


def test_credentials_in_the_url_are_refused_and_never_shown(runtime, web):
    err = _refused(runtime, web.url("/r8").replace("http://", "http://reader:s3cret@"), InvalidAdapter,
                   "carries credentials")
    assert "s3cret" not in str(err) and "reader" not in str(err)
    assert web.requests == []


def test_a_pod_without_a_download_cache_refuses_http_sources(tiny_base, tmp_path):
    model = load_model(tiny_base[0], "float32")
    rt = LoraRuntime(model, max_loras=1, max_cpu_loras=1, max_rank=8, max_tokens=16, adapter_roots=(tmp_path,))
    with pytest.raises(InvalidAdapter, match="adapter 'web': this pod has no download cache"):
        rt.read("web", "https://example.invalid/r8")


@pytest.mark.parametrize("allow", [(), ("http",), ("http://localhost",), ("http://127.0.0.1:1",)])
def test_loopback_is_refused_unless_an_entry_names_the_host(tiny_base, web, tmp_path, tiny_adapters, allow):
    model = load_model(tiny_base[0], "float32")
    rt = LoraRuntime(model, max_loras=1, max_cpu_loras=1, max_rank=8, max_tokens=16, adapter_roots=(tmp_path,),
                     fetcher=_fetcher(tmp_path / "downloads", allow))
    # (): every scheme but no loopback; ("http",): every http host but no loopback; the others name other hosts
    with pytest.raises(SourceDenied, match=r"127\.0\.0\.1.*(loopback or link-local|admits no such source).*"
                                           r"--adapter-source-allow"):
        rt.read("web", web.url("/r8"), _sha(tiny_adapters, "r8"))
    assert web.requests == []  # refused on the connected socket, before a byte of the request was sent
    assert os.listdir(tmp_path / "downloads") == []


def test_a_redirect_to_a_host_the_allow_list_leaves_out_is_refused(runtime, web):
    web.rules["/r8/adapter_model.safetensors"] = _redirect("http://elsewhere.invalid/r8/adapter_model.safetensors")
    _refused(runtime, web.url("/r8"), InvalidAdapter, "redirected .302. to http://elsewhere.invalid/.* does not admit")


def test_a_scheme_the_allow_list_leaves_out_is_refused_before_any_request(tiny_base, web, tmp_path):
    (tmp_path / "r8").mkdir()
    model = load_model(tiny_base[0], "float32")
    rt = LoraRuntime(model, max_loras=1, max_cpu_loras=1, max_rank=8, max_tokens=16, adapter_roots=(tmp_path,),
                     fetcher=_fetcher(tmp_path / "downloads", ("s3://adapters",)))  # a pod that fetches only s3
    with pytest.raises(SourceDenied, match=r"does not fetch http://127.0.0.1:\d+/r8: its --adapter-source-allow "
                                           r"\(s3://adapters\) .* add http://127.0.0.1"):
        rt.read("web", web.url("/r8"))
    with pytest.raises(SourceDenied, match="does not fetch r8"):
        rt.read("local", "r8")  # a local directory is a file source, which this pod does not allow
    assert web.requests == []

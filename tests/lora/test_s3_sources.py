"""s3:// adapter sources against a real S3 API on loopback (moto's server, with IAM authentication on):
the pod's boto3 client finds its key in the standard AWS variables, downloads into the disk tier,
verifies the registered sha256, and reads the copy like a local directory. Bad credentials, missing
keys, truncated or other weights, and an unreachable store are typed errors that leave nothing behind
and never show the credentials."""

from __future__ import annotations

import hashlib
import os
import socket

import pytest
import torch

from benchmarks.object_store import Key, MotoS3
from data_plane.errors import AdapterNotFound, DigestMismatch, InvalidAdapter, SourceDenied, SourceUnavailable
from data_plane.lora.fetcher import AdapterFetcher, FetchSettings
from data_plane.lora.runtime import LoraRuntime
from data_plane.lora.s3_source import S3Settings
from data_plane.lora.source_policy import SourcePolicy
from data_plane.model import load_model

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_adapters):
    s3 = MotoS3(tmp_path_factory.mktemp("moto")).start()
    s3.put_adapter("r8", tiny_adapters / "r8")
    s3.put_adapter("r1", tiny_adapters / "r1")
    weights = (tiny_adapters / "r8" / WEIGHTS).read_bytes()
    s3.put_adapter("truncated", tiny_adapters / "r8", weights[: len(weights) // 2])
    s3.put_adapter("other", tiny_adapters / "r8", (tiny_adapters / "r1" / WEIGHTS).read_bytes())
    yield s3
    s3.stop()


@pytest.fixture
def model(tiny_base):
    return load_model(tiny_base[0], "float32")  # a runtime wraps its model's layers: one model each


def _runtime(model, tmp_path, monkeypatch, key: Key, endpoint: str, allow=(), settings=None, roots=()):
    for k, v in key.env(endpoint).items():
        monkeypatch.setenv(k, v)
    fetcher = AdapterFetcher(FetchSettings(tmp_path / "disk", timeout_s=5.0, policy=SourcePolicy(allow),
                                        s3=settings or S3Settings()))
    return LoraRuntime(model, max_loras=2, max_cpu_loras=2, max_rank=16, max_tokens=16,
                       adapter_roots=(tmp_path, *roots), fetcher=fetcher)


def _sha(tiny_adapters, name):
    return hashlib.sha256((tiny_adapters / name / WEIGHTS).read_bytes()).hexdigest()


def _refused(rt, source, sha, error, match, key: Key | None = None):
    with pytest.raises(error, match=match) as info:
        rt.read("remote", source, sha)
    message = str(info.value)
    assert "adapter 'remote'" in message
    if key is not None:
        assert key.access_key_id not in message and key.secret_access_key not in message
    assert os.listdir(rt.downloads.tier.root) == []  # nothing kept, not even a staging directory
    return rt.downloads.tier.usage()


def test_an_s3_adapter_equals_the_local_directory_and_comes_from_disk_the_second_time(
        model, store, tiny_adapters, tmp_path, monkeypatch):
    rt = _runtime(model, tmp_path, monkeypatch, store.reader, store.endpoint, roots=(tiny_adapters,))
    sha = _sha(tiny_adapters, "r8")
    remote = rt.read("remote", "s3://adapters/r8/", sha)
    local = rt.read("local", str(tiny_adapters / "r8"), sha)
    assert remote.sha256 == sha and remote.rank == local.rank == 8
    for path, slices in local.deltas.items():
        for s, d in slices.items():
            assert torch.equal(remote.deltas[path][s].a, d.a) and torch.equal(remote.deltas[path][s].b, d.b)
    usage = rt.downloads.tier.usage()
    assert usage.downloads == {("s3", "ok"): 1} and usage.hits == 0 and usage.entries == 1
    assert (rt.downloads.tier.root / sha / WEIGHTS).read_bytes() == (tiny_adapters / "r8" / WEIGHTS).read_bytes()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the store is gone: only the disk can answer
    assert rt.read("again", "s3://adapters/r8", sha).sha256 == sha
    assert rt.downloads.tier.usage().hits == 1 and rt.downloads.tier.usage().downloads == {("s3", "ok"): 1}


@pytest.mark.parametrize("who", ["unknown key", "wrong secret", "no policy"])
def test_bad_credentials_are_permission_denied_and_never_shown(model, store, tiny_adapters, tmp_path, monkeypatch,
                                                               who):
    key = {"unknown key": Key("AKIAUNKNOWNKEY000000", "not-the-secret-0123"),
           "wrong secret": Key(store.reader.access_key_id, "wrong-secret-0123456789"),
           "no policy": store.outsider}[who]
    rt = _runtime(model, tmp_path, monkeypatch, key, store.endpoint)
    usage = _refused(rt, "s3://adapters/r8", _sha(tiny_adapters, "r8"), SourceDenied,
                     r"refused to let this pod read s3://adapters/r8/adapter_config.json .*check the pod's S3 "
                     "credentials", key)
    assert usage.downloads == {("s3", "error"): 1}


def test_a_missing_key_is_not_found(model, store, tmp_path, monkeypatch):
    rt = _runtime(model, tmp_path, monkeypatch, store.reader, store.endpoint)
    _refused(rt, "s3://adapters/nowhere", "", AdapterNotFound, r"s3://adapters/nowhere/adapter_config.json does "
             r"not exist \(NoSuchKey\)")


def test_a_truncated_object_fails_its_digest_or_its_parse_and_leaves_nothing(model, store, tiny_adapters, tmp_path,
                                                                              monkeypatch):
    rt = _runtime(model, tmp_path, monkeypatch, store.reader, store.endpoint)
    _refused(rt, "s3://adapters/truncated", _sha(tiny_adapters, "r8"), DigestMismatch,
             f"sha256 of {WEIGHTS} from s3://adapters/truncated is [0-9a-f]{{64}}, but {_sha(tiny_adapters, 'r8')}")
    _refused(rt, "s3://adapters/truncated", "", InvalidAdapter, "safetensors")  # no digest: the reader refuses it


def test_other_weights_than_registered_are_a_failed_precondition(model, store, tiny_adapters, tmp_path, monkeypatch):
    rt = _runtime(model, tmp_path, monkeypatch, store.reader, store.endpoint)
    err = _refused(rt, "s3://adapters/other", _sha(tiny_adapters, "r8"), DigestMismatch, "other weights")
    assert err.downloads == {("s3", "error"): 1}
    assert DigestMismatch.status == "FAILED_PRECONDITION"


def test_an_unreachable_store_is_unavailable(model, store, tiny_adapters, tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    rt = _runtime(model, tmp_path, monkeypatch, store.reader, closed)
    _refused(rt, "s3://adapters/r8", _sha(tiny_adapters, "r8"), SourceUnavailable, "did not answer in full")


def test_the_endpoint_flag_overrides_the_environment(model, store, tiny_adapters, tmp_path, monkeypatch):
    rt = _runtime(model, tmp_path, monkeypatch, store.reader, "http://127.0.0.1:9",
                  settings=S3Settings(endpoint_url=store.endpoint, addressing_style="path"))
    assert rt.read("remote", "s3://adapters/r1", _sha(tiny_adapters, "r1")).rank == 1


def test_a_bucket_the_allow_list_leaves_out_is_refused_before_any_request(model, store, tmp_path, monkeypatch):
    rt = _runtime(model, tmp_path, monkeypatch, store.reader, "http://127.0.0.1:9", allow=("s3://models",))
    _refused(rt, "s3://adapters/r8", "", SourceDenied, r"does not fetch s3://adapters/r8: .*\(s3://models\).* add "
             "s3://adapters")
    assert rt.downloads.tier.usage().downloads == {}


@pytest.mark.parametrize("source", ["s3://Bad_Bucket/x", "s3://key:secret@adapters/x", "s3://adapters/x?versionId=1"])
def test_malformed_s3_sources_are_invalid(model, store, tmp_path, monkeypatch, source):
    rt = _runtime(model, tmp_path, monkeypatch, store.reader, store.endpoint)
    err = pytest.raises(InvalidAdapter, rt.read, "remote", source, "").value
    assert "secret" not in str(err)


def test_a_prefetch_puts_the_verified_copy_on_disk_for_the_next_load(model, store, tiny_adapters, tmp_path,
                                                                      monkeypatch):
    rt = _runtime(model, tmp_path, monkeypatch, store.reader, store.endpoint)
    sha = _sha(tiny_adapters, "r8")
    assert rt.prefetch("remote", "s3://adapters/r8", sha) is True
    assert rt.prefetch("remote", "s3://adapters/r8", sha) is False  # on disk already: no request
    assert rt.prefetch("local", "r8", sha) is False  # a local source: nothing to fetch
    assert "remote" not in rt.cache  # fetched, not loaded
    assert rt.read("remote", "s3://adapters/r8", sha).sha256 == sha
    usage = rt.downloads.tier.usage()
    assert (usage.downloads, usage.hits, usage.entries) == ({("s3", "ok"): 1}, 2, 1)
    with pytest.raises(DigestMismatch):
        rt.prefetch("cut", "s3://adapters/truncated", _sha(tiny_adapters, "r1"))
    with pytest.raises(InvalidAdapter, match="a prefetch needs the registered sha256"):
        rt.prefetch("remote", "s3://adapters/r1", "")
    assert rt.downloads.tier.usage().entries == 1

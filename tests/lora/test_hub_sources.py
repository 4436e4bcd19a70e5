"""hf:// adapter sources, downloaded by the real huggingface_hub client from a Hub on loopback
(tests/hub_server.py) named by --hf-endpoint: the revision is resolved to a commit, both files are read
at that commit, the commit is recorded with the copy, and a token is sent only when the pod has one.
Failures are typed, leave nothing behind and never show the token."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from data_plane.errors import AdapterNotFound, DigestMismatch, InvalidAdapter, SourceDenied, SourceUnavailable
from data_plane.lora.fetcher import AdapterFetcher, FetchSettings
from data_plane.lora.hub_source import HubSettings
from data_plane.lora.runtime import LoraRuntime
from data_plane.lora.source_policy import SourcePolicy
from data_plane.model import load_model
from tests.hub_server import HubServer, hub_online

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
TOKEN = "hf_private_token_for_tests_0123456789"


def _files(tiny_adapters, name):
    return {f: (tiny_adapters / name / f).read_bytes() for f in (CONFIG, WEIGHTS)}


def _sha(tiny_adapters, name):
    return hashlib.sha256((tiny_adapters / name / WEIGHTS).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def hub(tiny_adapters):
    server = HubServer()
    server.old = server.publish("acme/style", _files(tiny_adapters, "r1"))
    server.new = server.publish("acme/style", _files(tiny_adapters, "r8"))  # main moves to r8
    server.publish("acme/style", _files(tiny_adapters, "r1"), branch="v1")
    server.publish("acme/private", _files(tiny_adapters, "r8"), token=TOKEN)
    server.publish("acme/config-only", {CONFIG: _files(tiny_adapters, "r8")[CONFIG]})
    with hub_online():  # whatever the shell says: these tests download from the Hub on loopback
        yield server
    server.close()


@pytest.fixture
def make(tiny_base, tmp_path, hub):
    def runtime(token: str | None = None, endpoint: str | None = None, allow=()):
        token_file = None
        if token is not None:
            token_file = tmp_path / "hf-token"
            token_file.write_text(token + "\n")
        settings = FetchSettings(tmp_path / "disk", timeout_s=5.0, policy=SourcePolicy(allow),
                                 hub=HubSettings(endpoint or hub.endpoint, token_file))
        return LoraRuntime(load_model(tiny_base[0], "float32"), max_loras=2, max_cpu_loras=2, max_rank=16,
                           max_tokens=16, adapter_roots=(tmp_path,), fetcher=AdapterFetcher(settings))
    hub.requests.clear()
    hub.truncate.clear()
    return runtime


def _refused(rt, source, sha, error, match):
    with pytest.raises(error, match=match) as info:
        rt.read("remote", source, sha)
    assert "adapter 'remote'" in str(info.value) and TOKEN not in str(info.value)
    assert os.listdir(rt.downloads.tier.root) == []


def test_a_branch_resolves_to_its_commit_which_is_recorded_with_the_copy(make, hub, tiny_adapters):
    rt = make()
    sha = _sha(tiny_adapters, "r8")
    adapter = rt.read("remote", "hf://acme/style", sha)  # no revision: main
    assert adapter.sha256 == sha and adapter.rank == 8
    recorded = json.loads((rt.downloads.tier.root / sha / "source.json").read_text())
    assert recorded == {"source": "hf://acme/style", "resolved": f"commit {hub.new}"}
    # both files were read at the commit, not at the moving branch name
    resolves = [path for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path]
    assert sorted(resolves) == [f"/acme/style/resolve/{hub.new}/{f}" for f in (CONFIG, WEIGHTS)]
    assert all(auth == "" for _, _, auth in hub.requests)  # no token configured, none sent


@pytest.mark.parametrize("revision", ["v1", "old commit"])
def test_a_tag_or_commit_gets_the_weights_it_names(make, hub, tiny_adapters, revision):
    rev = hub.old if revision == "old commit" else revision
    assert make().read("remote", f"hf://acme/style@{rev}", _sha(tiny_adapters, "r1")).rank == 1


def test_a_private_repository_needs_the_token_which_is_sent_and_never_shown(make, hub, tiny_adapters):
    sha = _sha(tiny_adapters, "r8")
    _refused(make(), "hf://acme/private", sha, SourceDenied, r"refused this pod access to hf://acme/private@main "
             r"\(HTTP 401\); give the pod a token")
    _refused(make(token="hf_wrong_token"), "hf://acme/private", sha, SourceDenied, "HTTP 401")
    hub.requests.clear()
    assert make(token=TOKEN).read("remote", "hf://acme/private", sha).rank == 8
    assert {auth for _, _, auth in hub.requests} == {f"Bearer {TOKEN}"}


@pytest.mark.parametrize(("source", "match"), [
    ("hf://acme/nothing", "the Hub has no hf://acme/nothing@main"),
    ("hf://acme/style@no-such-branch", "the Hub has no hf://acme/style@no-such-branch"),
    ("hf://acme/config-only", f"holds no {CONFIG} and {WEIGHTS}"),
])
def test_missing_repositories_revisions_and_files_are_not_found(make, source, match):
    _refused(make(), source, "", AdapterNotFound, match)


def test_other_weights_than_registered_are_a_failed_precondition(make, tiny_adapters):
    _refused(make(), "hf://acme/style", _sha(tiny_adapters, "r1"), DigestMismatch, "other weights")


def test_a_download_cut_short_is_unavailable(make, hub, tiny_adapters):
    hub.truncate[WEIGHTS] = 100
    _refused(make(), "hf://acme/style", _sha(tiny_adapters, "r8"), SourceUnavailable, "retry later")


def test_an_unreachable_hub_is_unavailable(make, tiny_adapters):
    _refused(make(endpoint="http://127.0.0.1:9"), "hf://acme/style", "", SourceUnavailable, "from the Hub failed")


def test_an_organisation_the_allow_list_leaves_out_is_refused(make, hub):
    _refused(make(allow=("hf://trusted",)), "hf://acme/style", "", SourceDenied, "add hf://acme")
    assert hub.requests == []


@pytest.mark.parametrize("source", ["hf://acme", "hf://acme/style/extra", "hf://acme/../style", "hf://acme/style@"])
def test_malformed_hub_sources_are_invalid(make, source):
    _refused(make(), source, "", InvalidAdapter, "is not hf://ORG/REPO")

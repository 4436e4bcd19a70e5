"""Adapters from where they live, end to end with real processes: an S3 API (moto, IAM on) and a Hub
(huggingface_hub's routes) on loopback, a redis-server, a control plane, two CPU pods on the demo model
with their credentials in the standard AWS variables, and a router. s3:// and hf:// adapters are
registered and pinned through the control plane, serve through the router with the tokens their local
copies give, are prefetched to the other pod's disk, move to it from there when their pod is killed,
and the killed pod, started again alone on its disk tier, loads them through DataPlaneAdmin without a
download. No credential shows anywhere."""

from __future__ import annotations

import os
import signal
from unittest import mock

import grpc
import pytest
from lorafleet.v1 import data_plane_admin_pb2 as dpa

from benchmarks.object_store import MotoS3
from benchmarks.processes import Fleet, PodProcess, RouterProcess, copy_demo_adapters, wait_until
from cli.admin_client import sha256_of
from tests.grpc_helpers import collect, request
from tests.hub_server import HubServer, hub_online

pytestmark = pytest.mark.slow
READY_WITHIN_S = 60
ALLOW = ("--adapter-source-allow", "file", "--adapter-source-allow", "s3://adapters",
         "--adapter-source-allow", "hf://acme")
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def stack(demo_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("remote-fleet")
    root = copy_demo_adapters(tmp_path_factory.mktemp("remote-adapters"))
    s3, hub = MotoS3(workdir), HubServer()
    fleet = router = None
    try:
        s3.start()
        s3.put_adapter("team/pirate", root / "pirate")
        hub.publish("acme/signoff", {f: (root / "signoff" / f).read_bytes() for f in FILES})
        env = {**s3.reader.env(s3.endpoint), "LORAFLEET_HOME": str(workdir / "home")}
        # what the pods inherit: the key, the endpoint, their disk tiers' home, and the Hub online
        with mock.patch.dict(os.environ, env), hub_online():
            # Demand decays over 5 s and 0.5 requests/s earns a disk copy: a handful of requests make a rising adapter.
            fleet = Fleet(workdir, root, "--model", str(demo_model_dir), "--hf-endpoint", hub.endpoint,
                          "--demand-window", "5", *ALLOW, control_plane_args=("--prefetch-rate", "0.5")).start()
            router = RouterProcess(workdir, fleet.cp.target, fleet.token_file, "--refresh-interval", "0.3").start()
            yield fleet, router, s3, hub, root, workdir
    finally:
        for part in (router, fleet, s3):
            if part is not None:
                part.stop()
        hub.close()


def _register(fleet, name, source, directory):
    from lorafleet.v1 import adapter_admin_pb2 as pb

    return fleet.admin().RegisterAdapter(pb.RegisterAdapterRequest(
        name=name, source=source, sha256=sha256_of(directory), base_model="SmolLM2-135M-Instruct"),
        metadata=fleet.auth(), timeout=5)


def _secretless(s3, *texts):
    for text in texts:
        assert s3.reader.secret_access_key not in text and s3.reader.access_key_id not in text


def test_a_request_goes_to_the_pod_that_holds_its_adapter_on_disk_not_to_one_that_would_download_it(stack):
    """Runs first: the Hub adapter it prefetches is its own, and the test below counts only S3 downloads."""
    fleet, router, s3, hub, root, workdir = stack
    hub.publish("acme/shouty", {f: (root / "shouty" / f).read_bytes() for f in FILES})
    _register(fleet, "shouty-hf", "hf://acme/shouty", root / "shouty")
    # The pod the tie-break by id would not pick holds it on disk: only its disk tier can draw the request there.
    lacks, holds = sorted(fleet.pods)
    token = wait_until(lambda: int(fleet.cp.metric("lorafleet_control_plane_fencing_token")), READY_WITHIN_S,
                       "a leader")  # the pod takes commands of the current leader's token only
    prefetch = dpa.PrefetchAdapterRequest(name="shouty-hf", source="hf://acme/shouty",
                                          sha256=sha256_of(root / "shouty"), fencing_token=token)
    assert fleet.pods[holds].admin().PrefetchAdapter(prefetch, metadata=fleet.pods[holds].auth(), timeout=60).downloaded
    state = fleet.pods[holds].state()
    assert int(sha256_of(root / "shouty")[:16], 16) in state.disk_digests and state.disk.entries >= 1
    assert state.load_times.remote_to_disk_seconds > 0
    downloads = {name: pod.metric("lorafleet_adapter_downloads_total", outcome="ok", scheme="hf")
                 for name, pod in fleet.pods.items()}
    wait_until(lambda: router.metric("lorafleet_router_pods_routable") == 2 and
               router.metric("lorafleet_router_disk_tier_copies") >= 1, READY_WITHIN_S,
               "the router reads the disk tier")
    assert collect(router, request("Why is the sky blue?", "shouty-hf", max_tokens=4))[2].usage.completion_tokens
    assert "shouty-hf" in {a.name for a in fleet.pods[holds].state().adapters}
    assert "shouty-hf" not in {a.name for a in fleet.pods[lacks].state().adapters}
    assert {name: pod.metric("lorafleet_adapter_downloads_total", outcome="ok", scheme="hf")
            for name, pod in fleet.pods.items()} == downloads  # read from the disk tier: nothing downloaded
    assert fleet.pods[holds].state().load_times.disk_to_host_seconds > 0

    # Its demand rises on the pod serving it: the leader has the other pod prefetch it before any request goes there.
    for i in range(8):
        assert collect(router, request(f"Question {i}?", "shouty-hf", max_tokens=1))[2].usage.completion_tokens
    wait_until(lambda: fleet.pods[lacks].metric("lorafleet_adapter_downloads_total", outcome="ok", scheme="hf")
               == downloads[lacks] + 1, READY_WITHIN_S, "the rising adapter prefetched to the other pod's disk")
    state = fleet.pods[lacks].state()
    assert int(sha256_of(root / "shouty")[:16], 16) in state.disk_digests
    assert "shouty-hf" not in {a.name for a in state.adapters}  # on disk only: no slot, no host memory taken
    assert fleet.cp.metric("lorafleet_control_plane_pod_commands_total", command="prefetch", outcome="ok") >= 1


def test_s3_and_hub_adapters_serve_through_the_router_move_when_their_pod_dies_and_load_from_disk_again(
        stack, demo_model_dir):
    fleet, router, s3, hub, root, workdir = stack
    _register(fleet, "pirate-s3", "s3://adapters/team/pirate", root / "pirate")
    _register(fleet, "signoff-hf", "hf://acme/signoff", root / "signoff")
    fleet.register("pirate")  # the same weights from a local directory: the reference
    for name in ("pirate-s3", "signoff-hf"):
        fleet.pin(name, 1)
    for name in ("pirate-s3", "signoff-hf"):
        wait_until(lambda n=name: fleet.placements(n), READY_WITHIN_S, f"{name} READY")
    question = "What is the tallest mountain?"
    text, tokens, _ = collect(router, request(question, "pirate-s3", max_tokens=16))
    _, reference, _ = collect(router, request(question, "pirate", max_tokens=16))
    assert [t.id for t in tokens] == [t.id for t in reference] and text  # the same weights, the same tokens
    assert collect(router, request(question, "signoff-hf", max_tokens=8))[2].usage.completion_tokens > 0
    assert fleet.adapter("pirate-s3").source == "s3://adapters/team/pirate"

    # the pod its pin is on (the router may also have loaded it on the other pod from a disk copy there)
    (holder,) = wait_until(lambda: fleet.pinned_on("pirate-s3"), READY_WITHIN_S, "pirate-s3 pinned on one pod")
    survivor = next(p for p in fleet.pods if p != holder)
    s3_downloads = lambda: fleet.pods[survivor].metric("lorafleet_adapter_downloads_total", outcome="ok", scheme="s3")
    # The leader asks the other pod to prefetch the pinned adapter to its disk ahead of demand.
    downloads_before = wait_until(s3_downloads, READY_WITHIN_S, "pirate-s3 prefetched to the other pod's disk")
    hits_before = fleet.pods[survivor].metric("lorafleet_adapter_disk_cache_hits_total")
    in_a_slot = any(a.name == "pirate-s3" for a in fleet.pods[survivor].state().adapters)
    fleet.pods[holder].signal(signal.SIGKILL)
    fleet.pods[holder].proc.wait(timeout=10)
    for name in ("pirate-s3", "signoff-hf"):
        wait_until(lambda n=name: fleet.pinned_on(n) == {survivor}, READY_WITHIN_S, f"{name} pinned on the survivor")
    assert s3_downloads() == downloads_before  # restored from its disk tier, not from storage
    if not in_a_slot:  # else the pin took the copy a request had already loaded there (from that disk copy)
        assert fleet.pods[survivor].metric("lorafleet_adapter_disk_cache_hits_total") > hits_before
    assert collect(router, request(question, "pirate-s3", max_tokens=4))[2].usage.completion_tokens > 0

    # The killed pod again, alone (no control plane), on the disk tier it left behind.
    alone = PodProcess(workdir, "--model", str(demo_model_dir), "--adapter-cache-dir",
                       str(workdir / "home" / "adapter-cache" / holder),
                       "--hf-endpoint", hub.endpoint, *ALLOW, name=f"{holder}-alone")
    with mock.patch.dict(os.environ, s3.reader.env("http://127.0.0.1:9")):  # the store is out of reach now
        alone.start()
    try:
        assert alone.metric("lorafleet_adapter_disk_cache_entries") >= 1
        load = dpa.LoadAdapterRequest(name="pirate", source="s3://adapters/team/pirate",
                                      sha256=sha256_of(root / "pirate"))
        alone.admin().LoadAdapter(load, metadata=alone.auth(), timeout=120)
        assert alone.metric("lorafleet_adapter_disk_cache_hits_total") == 1
        assert alone.metric("lorafleet_adapter_downloads_total", outcome="error", scheme="s3") == 0
        assert [t.id for t in collect(alone, request(question, "pirate", max_tokens=16))[1]] == \
            [t.id for t in reference]
        refusals = {
            "other weights": (dpa.LoadAdapterRequest(name="x", source="hf://acme/signoff", sha256="0" * 64),
                              grpc.StatusCode.FAILED_PRECONDITION, "other weights"),
            "missing repository": (dpa.LoadAdapterRequest(name="x", source="hf://acme/nothing"),
                                   grpc.StatusCode.NOT_FOUND, "the Hub has no hf://acme/nothing"),
            "unreachable store": (dpa.LoadAdapterRequest(name="x", source="s3://adapters/team/other"),
                                  grpc.StatusCode.UNAVAILABLE, "s3://adapters/team/other"),
            "bucket not allowed": (dpa.LoadAdapterRequest(name="x", source="s3://secrets/x"),
                                   grpc.StatusCode.PERMISSION_DENIED, "--adapter-source-allow"),
            "cloud metadata": (dpa.LoadAdapterRequest(name="x", source="http://169.254.169.254/latest"),
                               grpc.StatusCode.PERMISSION_DENIED, "a loopback or link-local address"),
        }
        for case, (req, code, words) in refusals.items():
            with pytest.raises(grpc.RpcError) as e:
                alone.admin().LoadAdapter(req, metadata=alone.auth(), timeout=120)
            assert (e.value.code(), words in e.value.details()) == (code, True), (case, e.value.details())
            _secretless(s3, e.value.details())
        assert {a.name for a in alone.state().adapters} == {"pirate"}  # the refusals changed nothing
        _secretless(s3, alone.metrics(), alone.log_path.read_text(), str(fleet.adapter("pirate-s3")),
                    *(pod.log_path.read_text() for pod in fleet.pods.values()))
    finally:
        alone.stop()

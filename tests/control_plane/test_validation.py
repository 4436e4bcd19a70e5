"""Invalid requests: each is refused with the right status code and a message that says what to
fix, and leaves the registry as it was."""

from __future__ import annotations

import asyncio

import grpc
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc
from lorafleet.v1 import membership_pb2 as mpb
from lorafleet.v1 import membership_pb2_grpc as mpb_grpc

from tests.control_plane.conftest import auth, serving

SHA = "0123456789abcdef" * 4
C = grpc.StatusCode


def register(**fields) -> tuple[str, pb.RegisterAdapterRequest]:
    base = {"name": "new", "source": "file:///adapters/new", "sha256": SHA, "base_model": "smollm2-135m"}
    return "RegisterAdapter", pb.RegisterAdapterRequest(**(base | fields))


INVALID_REGISTRATIONS = {
    "empty name": (register(name=""), C.INVALID_ARGUMENT, "use 1-64 characters"),
    "name starting with a dash": (register(name="-x"), C.INVALID_ARGUMENT, "starting with a letter or a digit"),
    "name ending in a newline": (register(name="x\n"), C.INVALID_ARGUMENT, "[A-Za-z0-9._-]"),
    "name with a slash": (register(name="a/b"), C.INVALID_ARGUMENT, "[A-Za-z0-9._-]"),
    "name of 65 characters": (register(name="x" * 65), C.INVALID_ARGUMENT, "1-64 characters"),
    "ftp source": (register(source="ftp://host/a"), C.INVALID_ARGUMENT, "s3://BUCKET/PREFIX or hf://ORG/REPO"),
    "s3 source without a bucket": (register(source="s3:///a"), C.INVALID_ARGUMENT, "s3://BUCKET/PREFIX"),
    "s3 source with credentials": (register(source="s3://AKIAKEY:s3cr3t@bucket/a"), C.INVALID_ARGUMENT,
                                   r"source s3://…@bucket/a carries credentials"),
    "http source with credentials": (register(source="https://reader:pw@host/a"), C.INVALID_ARGUMENT,
                                     "source https://…@host/a carries credentials"),
    "relative file source": (register(source="file://adapters/a"), C.INVALID_ARGUMENT, "file:///absolute/path"),
    "http source without host": (register(source="http:///a"), C.INVALID_ARGUMENT, "http(s)://host/path"),
    "empty source": (register(source=""), C.INVALID_ARGUMENT, "must be a file:///"),
    "NUL in a source": (register(source="file:///adapters/a\x00b"), C.INVALID_ARGUMENT, "control character"),
    "escaped NUL in a source": (register(source="file:///adapters/a%00b"), C.INVALID_ARGUMENT, "control character"),
    "newline in a source": (register(source="http://host/a\nb"), C.INVALID_ARGUMENT, "control character"),
    "short sha256": (register(sha256="abc"), C.INVALID_ARGUMENT, "64 hex characters"),
    "non-hex sha256": (register(sha256="g" * 64), C.INVALID_ARGUMENT, "sha256sum prints it"),
    "other base model": (register(base_model="llama-3-8b"), C.INVALID_ARGUMENT, "not this fleet's base model"),
    "taken name, other weights": (register(name="good", sha256="f" * 64), C.ALREADY_EXISTS, "unregister it first"),
}

INVALID_CALLS = {
    "get unknown": ("GetAdapter", pb.GetAdapterRequest(name="nope"), C.NOT_FOUND, "register it first"),
    "get bad name": ("GetAdapter", pb.GetAdapterRequest(name="a b"), C.INVALID_ARGUMENT, "1-64 characters"),
    "pin unknown": ("PinAdapter", pb.PinAdapterRequest(name="nope", replicas=1), C.NOT_FOUND, "register it first"),
    "unpin unknown": ("UnpinAdapter", pb.UnpinAdapterRequest(name="nope"), C.NOT_FOUND, "register it first"),
    "unregister unknown": ("UnregisterAdapter", pb.UnregisterAdapterRequest(name="nope"), C.NOT_FOUND,
                           "register it first"),
    "route unknown": ("Route", pb.RouteRequest(adapter="nope"), C.NOT_FOUND, "register it first"),
    "pin stale version": ("PinAdapter", pb.PinAdapterRequest(name="good", replicas=2, expected_version=7),
                          C.ABORTED, "retry with the current version"),
    "unpin stale version": ("UnpinAdapter", pb.UnpinAdapterRequest(name="good", expected_version=7), C.ABORTED,
                            "read it again"),
    "unregister stale version": ("UnregisterAdapter", pb.UnregisterAdapterRequest(name="good", expected_version=9),
                                 C.ABORTED, "version 1, not 9"),
    "pin absurd replicas": ("PinAdapter", pb.PinAdapterRequest(name="good", replicas=10**6), C.INVALID_ARGUMENT,
                            "use 0 to pin on every pod"),
    "page too large": ("ListAdapters", pb.ListAdaptersRequest(page_size=1001), C.INVALID_ARGUMENT, "ask for fewer"),
    "forged page token": ("ListAdapters", pb.ListAdaptersRequest(page_token="%%%"), C.INVALID_ARGUMENT,
                          "next_page_token"),
}

def heartbeat(*rates: tuple[str, float]) -> mpb.HeartbeatRequest:
    """A well-formed heartbeat but for the adapter rates it reports."""
    demand = mpb.AdapterDemand(window_seconds=30, rates=[mpb.AdapterRate(adapter=a, requests_per_second=r)
                                                         for a, r in rates])
    return mpb.HeartbeatRequest(pod_id="p", endpoint="127.0.0.1:5", ready=True, demand=demand)


INVALID_MEMBERSHIP = {
    "bad pod id": ("Heartbeat", mpb.HeartbeatRequest(pod_id="pod 1", endpoint="127.0.0.1:5"), C.INVALID_ARGUMENT,
                   "set --pod-id"),
    "endpoint without port": ("Heartbeat", mpb.HeartbeatRequest(pod_id="p", endpoint="127.0.0.1"),
                              C.INVALID_ARGUMENT, "host:port"),
    "endpoint port 0": ("Heartbeat", mpb.HeartbeatRequest(pod_id="p", endpoint="h:0"), C.INVALID_ARGUMENT,
                        "port in 1-65535"),
    "pod of another model": ("Heartbeat", mpb.HeartbeatRequest(pod_id="p", endpoint="h:5", base_model="other"),
                             C.FAILED_PRECONDITION, "start the pod with the fleet's model"),
    "demand rate negative": ("Heartbeat", heartbeat(("a", -1.0)), C.INVALID_ARGUMENT, "finite number >= 0"),
    "demand rate NaN": ("Heartbeat", heartbeat(("a", float("nan"))), C.INVALID_ARGUMENT, "finite number >= 0"),
    "demand rate infinite": ("Heartbeat", heartbeat(("a", float("inf"))), C.INVALID_ARGUMENT, "finite number"),
    "demand for a bad name": ("Heartbeat", heartbeat(("a b", 1.0)), C.INVALID_ARGUMENT, "not a valid adapter name"),
    "demand too long": ("Heartbeat", heartbeat(*((f"a{i}", 1.0) for i in range(1001))), C.INVALID_ARGUMENT,
                        "lower the pod's --demand-report-top"),
    "resolve unknown": ("ResolveAdapter", mpb.ResolveAdapterRequest(name="nope"), C.NOT_FOUND, "register it first"),
}


async def snapshot(admin) -> tuple:
    listed = await admin.ListAdapters(pb.ListAdaptersRequest(), metadata=auth())
    pods = await admin.ListPods(pb.ListPodsRequest(), metadata=auth())
    return list(listed.adapters), list(pods.pods)


def refusals(config, cases: dict) -> dict[str, tuple]:
    """Sends every case to a control plane holding one adapter, 'good' (version 1); returns each
    case's (code, message) and asserts the registry is unchanged after each."""
    async def go():
        async with serving(config) as channel:
            stubs = {"admin": pb_grpc.AdapterAdminStub(channel), "pods": mpb_grpc.PodMembershipStub(channel)}
            await stubs["admin"].RegisterAdapter(register(name="good")[1], metadata=auth())
            before = await snapshot(stubs["admin"])
            out = {}
            for case, (method, request, *_) in cases.items():
                stub = stubs["pods"] if method in ("Heartbeat", "ResolveAdapter") else stubs["admin"]
                try:
                    await getattr(stub, method)(request, metadata=auth(), timeout=10)
                    out[case] = (C.OK, "")
                except grpc.aio.AioRpcError as e:
                    out[case] = (e.code(), e.details())
                assert await snapshot(stubs["admin"]) == before, f"{case} changed the registry"
            return out

    return asyncio.run(go())


def check(results: dict, expected: dict) -> None:
    for case, (code, message) in results.items():
        assert code == expected[case][0], f"{case}: {code} {message}"
        assert expected[case][1] in message, f"{case}: {message!r}"


def test_invalid_registrations_are_refused_with_a_message_saying_what_to_fix(config):
    cases = {case: (*req, code, hint) for case, (req, code, hint) in INVALID_REGISTRATIONS.items()}
    check(refusals(config, cases), {case: (code, hint) for case, (_, code, hint) in INVALID_REGISTRATIONS.items()})


def test_percent_escapes_in_http_sources_are_left_to_the_server():
    # Only a file:// path is unescaped into a file name; an http(s) URL goes out as registered.
    from control_plane.registry import _validate_source

    _validate_source("http://host/a%0Ab")
    _validate_source("https://host/a%00b")


def test_calls_on_unknown_or_changed_adapters_are_refused_and_change_nothing(config):
    check(refusals(config, INVALID_CALLS), {case: c[2:] for case, c in INVALID_CALLS.items()})


def test_invalid_heartbeats_and_unknown_names_are_refused_and_no_pod_joins(config):
    check(refusals(config, INVALID_MEMBERSHIP), {case: c[2:] for case, c in INVALID_MEMBERSHIP.items()})


def test_registering_without_a_base_model_takes_the_fleets(config):
    async def go():
        async with serving(config) as channel:
            return await pb_grpc.AdapterAdminStub(channel).RegisterAdapter(register(base_model="")[1],
                                                                            metadata=auth())

    assert asyncio.run(go()).base_model == "smollm2-135m"


def test_s3_and_hub_sources_are_registered_as_given():
    from control_plane.registry import _validate_source

    _validate_source("s3://adapters/team/pirate/")
    _validate_source("hf://acme/pirate-lora@v1")
    _validate_source("hf://acme/pirate-lora")

"""One fleet for every router test that needs real processes (a redis-server, a control plane, two CPU
pods on the demo model) and one router in front of it, serving gRPC and the OpenAI HTTP API."""

from __future__ import annotations

import pytest

from benchmarks.processes import Fleet, RouterProcess, copy_demo_adapters, wait_until

READY_WITHIN_S = 60
API_KEY = "sk-router-tests"


@pytest.fixture(scope="package")
def stack(demo_model_dir, tmp_path_factory):
    """(fleet, router, {adapter: the pod holding it pinned}) with pirate and shouty pinned once each,
    and signoff registered but resident nowhere. The router's HTTP API asks for ``API_KEY``."""
    workdir = tmp_path_factory.mktemp("router-fleet")
    # The tests compare the router's answers, from whichever pod it picks, with one pod's own answers to the
    # digit: both pods compute in float32 rather than in the precision each measures faster at start-up.
    # No queue-delay limit: these tests are not about overload, and on a loaded 2-core machine a pod's estimate
    # refused a request of three choices as late (first token in about 2.2 s against the default 1.5 s).
    fleet = Fleet(workdir, copy_demo_adapters(tmp_path_factory.mktemp("router-adapters")), "--dtype", "float32",
                  "--max-queue-delay", "0")
    router = None
    try:
        fleet.start()
        holders = {}
        for name in ("pirate", "shouty"):  # one at a time, so that placement puts them on different pods
            fleet.register(name)
            fleet.pin(name, 1)
            ready = wait_until(lambda n=name: fleet.placements(n), READY_WITHIN_S, f"{name} READY")
            holders[name] = fleet.pods[ready.pop()]
        assert holders["pirate"] is not holders["shouty"], "placement put both pins on one pod"
        fleet.register("signoff")
        key_file = workdir / "api-keys"
        key_file.write_text(f"# keys of the router tests\nsk-another-key\n{API_KEY}\n")
        router = RouterProcess(workdir, fleet.cp.target, fleet.token_file, "--refresh-interval", "0.3",
                               "--api-key-file", str(key_file), "--http-max-body-bytes", "65536").start()
        yield fleet, router, holders
    finally:
        if router is not None:
            router.stop()
        fleet.stop()

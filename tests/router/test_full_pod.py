"""A full pod's refusal, followed by a real router in front of real pods (a redis-server, a control plane,
two CPU pods on the demo model that seat one request and queue one): a request refused by the full pod
that holds its adapter is served by the other pod, and when both are full the client gets
RESOURCE_EXHAUSTED with the pods' retry hint over gRPC, and 429 with Retry-After over the OpenAI API."""

from __future__ import annotations

import grpc
import openai
import pytest

from benchmarks.processes import Fleet, PodProcess, RouterProcess, copy_demo_adapters, wait_until
from conventions.status import RETRY_PUSHBACK_KEY
from tests.grpc_helpers import request

pytestmark = pytest.mark.slow
READY_WITHIN_S = 60
QUEUE_FULL = "lorafleet_requests_refused_total"


@pytest.fixture(scope="module")
def full_stack(demo_model_dir, tmp_path_factory):
    """(fleet, router, the pod holding pirate pinned, the other pod)."""
    workdir = tmp_path_factory.mktemp("full-pod")
    # one seat and one queue place per pod and no queue-delay limit, so two long requests fill it and the
    # next is refused as queue_full; one precision, so the router may send a request one pod refused to the other
    fleet = Fleet(workdir, copy_demo_adapters(tmp_path_factory.mktemp("full-pod-adapters")),
                  "--max-num-seqs", "1", "--max-waiting", "1", "--max-queue-delay", "0", "--dtype", "float32")
    router = None
    try:
        fleet.start()
        fleet.register("pirate")
        fleet.pin("pirate", 1)
        (holder,) = wait_until(lambda: fleet.placements("pirate"), READY_WITHIN_S, "pirate READY on one pod")
        other = next(name for name in fleet.pods if name != holder)
        router = RouterProcess(workdir, fleet.cp.target, fleet.token_file, "--refresh-interval", "0.3").start()
        yield fleet, router, fleet.pods[holder], fleet.pods[other]
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


def fill(pod: PodProcess, adapter: str, calls: list) -> None:
    """Seats one long request on ``pod`` and queues another, sent to the pod directly (``calls`` keeps them,
    to cancel); returns once the pod's own state shows it full."""
    for i in range(2):
        calls.append(pod.generation().Generate(
            request(f"Count to a thousand, slowly ({i}).", adapter, max_tokens=900, ignore_eos=True), timeout=120))
    wait_until(lambda: (s := pod.state()).running_requests == 1 and s.waiting_requests == 1, 120,
               f"{pod.address} running one request and queueing one",
               failed=lambda: next((f"a call ended: {c.code()}: {c.details()}" for c in calls[-2:] if c.done()), None))


def test_a_full_pods_refusal_sends_the_request_to_the_other_pod_and_all_full_is_resource_exhausted(full_stack):
    fleet, router, holder, other = full_stack
    calls = []
    try:
        fill(holder, "pirate", calls)
        refused_before = holder.metric(QUEUE_FULL, reason="queue_full")
        # the router ranks the holder first (its device slot outweighs two requests) and follows its refusal
        text = "".join(m.text for m in router.generation().Generate(request("Where is the treasure?", "pirate",
                                                                            max_tokens=6), timeout=60))
        assert text
        assert holder.metric(QUEUE_FULL, reason="queue_full") == refused_before + 1
        assert router.metric("lorafleet_router_retries_total", code="RESOURCE_EXHAUSTED") == 1
        assert other.metric("lorafleet_requests_total", outcome="length") >= 1  # it served the request

        fill(other, "", calls)
        before = [pod.metric(QUEUE_FULL, reason="queue_full") for pod in (holder, other)]
        with pytest.raises(grpc.RpcError) as refused:
            list(router.generation().Generate(request("Where is the treasure?", "pirate", max_tokens=6), timeout=60))
        error = refused.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "every pod tried (2) refused the request, 2 as full" in error.details()
        hint_ms = int(dict(error.trailing_metadata())[RETRY_PUSHBACK_KEY])
        assert hint_ms > 0
        assert [pod.metric(QUEUE_FULL, reason="queue_full") for pod in (holder, other)] == [b + 1 for b in before]

        # the official OpenAI client, without its own retries, sees the same refusal as a 429
        client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model="pirate", prompt="Where is the treasure?", max_tokens=6)
        assert limited.value.status_code == 429
        retry_after = int(limited.value.response.headers["retry-after"])
        assert retry_after >= 1
        assert [pod.metric(QUEUE_FULL, reason="queue_full") for pod in (holder, other)] == [b + 2 for b in before]
    finally:
        for call in calls:
            call.cancel()

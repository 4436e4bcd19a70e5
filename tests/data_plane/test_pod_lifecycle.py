"""A one-sequence pod with a one-request queue: queue full, stale fencing tokens, and a SIGTERM drain."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lorafleet.v1 import data_plane_admin_pb2 as dpa

from benchmarks.processes import PodProcess, wait_until
from conventions.health import LIVENESS
from tests.grpc_helpers import collect, request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_pod(demo_model_dir, tmp_path_factory):
    # no queue-delay limit: on a loaded machine the pod's estimate would refuse the queued request as late
    # before the queue is full, and what these tests fill is the queue
    process = PodProcess(tmp_path_factory.mktemp("small-pod"), "--max-num-seqs", "1", "--max-waiting", "1",
                         "--max-queue-delay", "0", "--max-loras", "1", "--max-cpu-loras", "2", "--num-kv-blocks", "64",
                         name="small")
    try:
        yield process.start()
    finally:
        process.stop()


class Stream(threading.Thread):
    """Consumes one Generate stream in the background."""

    def __init__(self, pod, req) -> None:
        super().__init__(daemon=True)
        self.pod, self.req = pod, req
        self.result = self.error = None

    def run(self) -> None:
        try:
            self.result = collect(self.pod, self.req)
        except grpc.RpcError as e:
            self.error = e

    def ended(self) -> str | None:
        """Why the stream can no longer reach a state it is waited for: it ended (with what), or None."""
        if self.error is not None:
            return f"the stream failed: {self.error.code()}: {self.error.details()}"
        return "the stream already finished" if self.result is not None else None


def test_a_full_queue_answers_resource_exhausted(small_pod):
    running = Stream(small_pod, request("Tell me a story.", max_tokens=40, ignore_eos=True))
    running.start()
    wait_until(lambda: small_pod.state().running_requests == 1, what="first request running", failed=running.ended)
    waiting = Stream(small_pod, request("Tell me a story.", max_tokens=4, ignore_eos=True))
    waiting.start()
    wait_until(lambda: small_pod.state().waiting_requests == 1, what="second request waiting",
               failed=lambda: running.ended() or waiting.ended())
    with pytest.raises(grpc.RpcError) as e:
        collect(small_pod, request("One more?", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry" in e.value.details()
    running.join(60), waiting.join(60)
    assert running.result[2].usage.completion_tokens == 40
    assert waiting.result[2].usage.completion_tokens == 4


def test_a_command_from_a_deposed_leader_is_refused(small_pod):
    admin, auth = small_pod.admin(), small_pod.auth()
    before = small_pod.state()
    admin.UnloadAdapter(dpa.UnloadAdapterRequest(name="absent", fencing_token=7), metadata=auth)
    with pytest.raises(grpc.RpcError) as e:
        admin.UnloadAdapter(dpa.UnloadAdapterRequest(name="absent", fencing_token=6), metadata=auth)
    assert e.value.code() == grpc.StatusCode.ABORTED
    assert "fencing token 6" in e.value.details()
    assert small_pod.state() == before


def test_a_serving_pod_is_ready_and_live_on_every_health_service(small_pod):
    health = health_pb2_grpc.HealthStub(small_pod.channel)
    statuses = {name: health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                for name in ("", "lorafleet.v1.Generation", "lorafleet.v1.DataPlaneAdmin", LIVENESS)}
    assert statuses == dict.fromkeys(statuses, health_pb2.HealthCheckResponse.SERVING)


def test_sigterm_finishes_in_flight_requests_refuses_new_ones_and_exits(small_pod):
    running = Stream(small_pod, request("Tell me a story.", max_tokens=60, ignore_eos=True))
    running.start()
    wait_until(lambda: small_pod.state().running_requests == 1, what="request running", failed=running.ended)
    small_pod.signal()
    health = health_pb2_grpc.HealthStub(small_pod.channel)
    wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
               == health_pb2.HealthCheckResponse.NOT_SERVING, what="health NOT_SERVING while draining")
    with pytest.raises(grpc.RpcError) as e:
        collect(small_pod, request("Too late?", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    running.join(60)
    assert running.error is None
    assert running.result[2].usage.completion_tokens == 60
    assert small_pod.proc.wait(timeout=30) == 0
    assert '"msg": "stopped"' in small_pod.log_path.read_text()

"""Reconciliation passes against a real Redis, with the DataPlaneAdmin calls answered by a
scripted stand-in for the pod clients (pods themselves are integration-tested with the data plane)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import pytest
import redis

from control_plane.fleet import Fleet
from control_plane.leader import LeaderLease
from control_plane.metrics import ControlPlaneMetrics
from control_plane.plan import Action, Command
from control_plane.pod_client import CommandResult, Probe, read_answer
from control_plane.reconciler import Reconciler
from control_plane.records import AdapterRecord, PlacementRecord, PlacementState, PodRecord, Residency
from control_plane.registry import Registry
from control_plane.store import Store

SHA = "ab" * 32


class ScriptedPods:
    """Answers every command OK unless ``refuse`` names its (pod, command) or its (pod, adapter)
    with a (status code, details) answer; reads answers as PodClients does; records each call;
    awaits ``while_running`` (when set) before answering, as if it ran while the pod worked.
    A health probe of an endpoint finds what ``probes`` says (ANSWERED when absent) after awaiting
    ``while_probing`` (when set); the probed endpoints are recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Command, str, int]] = []
        self.refuse: dict[tuple[str, Command | str], tuple[grpc.StatusCode, str]] = {}
        self.while_running = None
        self.probes: dict[str, Probe] = {}
        self.probed: list[str] = []
        self.while_probing = None

    async def probe(self, endpoint: str) -> Probe:
        self.probed.append(endpoint)
        if self.while_probing is not None:
            await self.while_probing()
        return self.probes.get(endpoint, Probe.ANSWERED)

    async def execute(self, action: Action, token: int) -> CommandResult:
        self.calls.append((action.pod, action.command, action.adapter, token))
        if self.while_running is not None:
            await self.while_running()
        answer = self.refuse.get((action.pod, action.command),
                                 self.refuse.get((action.pod, action.adapter), (grpc.StatusCode.OK, "")))
        return read_answer(action.command, *answer)

    async def forget(self, keep: set[str]) -> None:
        pass


def endpoint(pod_id: str) -> str:
    return f"127.0.0.1:{7000 + int(pod_id[-1])}"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Harness:
    def __init__(self, config, redis_url: str) -> None:
        self.config = dataclasses.replace(config, retry_backoff_s=0.01, max_load_attempts=2)
        self.clock = Clock()
        self.store = Store(redis_url, "rec", clock=self.clock)
        self.fleet = Fleet(self.store, "", self.config.pod_lease_ttl, self.config.pod_grace)
        self.registry = Registry(self.store, self.fleet, "")
        self.lease = LeaderLease(self.store, "me", 30.0, ControlPlaneMetrics())
        self.pods = ScriptedPods()
        self.metrics = ControlPlaneMetrics()
        self.reconciler = Reconciler(self.config, self.store, self.fleet, self.lease, self.pods, self.metrics)

    async def pod(self, pod_id: str, *residents: Residency, slots: int = 3) -> None:
        await self.fleet.heartbeat(PodRecord(pod_id, endpoint(pod_id), reported_ready=True,
                                             slots_total=slots, cpu_cache_capacity=8, residents=residents))

    async def adapter(self, name: str, replicas: int | None = None) -> None:
        await self.store.create_adapter(AdapterRecord(name, f"file:///a/{name}", SHA, "m"))
        if replicas is not None:
            await self.registry.pin(name, replicas)

    async def sent(self) -> list[tuple[str, Command, str]]:
        """Runs one pass; returns the commands it sent (without tokens)."""
        self.pods.calls.clear()
        await self.reconciler.reconcile_once()
        return [c[:3] for c in self.pods.calls]


def run(config, redis_server, body):
    async def go():
        h = Harness(config, redis_server.url)
        try:
            return await body(h)
        finally:
            await h.store.close()

    return asyncio.run(go())


def test_a_replica_without_the_leader_lease_sends_no_commands(config, redis_server):
    async def body(h):
        await h.adapter("a", replicas=1)
        await h.pod("p0")
        await h.store.acquire_leadership("someone-else", 30)
        await h.lease.renew()
        return await h.sent()

    assert run(config, redis_server, body) == []


def test_a_pinned_adapter_is_loaded_and_pinned_with_the_leaders_fencing_token(config, redis_server):
    async def body(h):
        await h.adapter("a", replicas=1)
        await h.pod("p0")
        token = await h.lease.renew()
        await h.reconciler.reconcile_once()
        return token, h.pods.calls, await h.store.placements(["a"])

    token, calls, placements = run(config, redis_server, body)
    assert token > 0
    assert calls == [("p0", Command.LOAD_AND_PIN, "a", token)]
    assert [(p.pod, p.state) for p in placements["a"]] == [("p0", PlacementState.READY)]


def test_reconciling_pods_that_already_agree_sends_nothing(config, redis_server):
    async def body(h):
        await h.adapter("a", replicas=1)
        await h.adapter("b")
        await h.pod("p0", Residency("a", pinned=True, sha256=SHA), Residency("b", sha256=SHA))
        await h.lease.renew()
        return await h.sent(), await h.sent()

    assert run(config, redis_server, body) == ([], [])


def test_a_failed_load_is_recorded_with_its_reason_retried_then_placed_elsewhere(config, redis_server):
    refusal = (grpc.StatusCode.INVALID_ARGUMENT, "sha256 mismatch for a")

    async def body(h):
        await h.adapter("a", replicas=1)
        await h.pod("p0", slots=4)
        await h.pod("p1", slots=2)  # less free capacity: p0 is chosen first
        h.pods.refuse[("p0", Command.LOAD_AND_PIN)] = refusal
        await h.lease.renew()
        first = await h.sent()
        view = await h.registry.get("a")
        await asyncio.sleep(0.05)  # past the (tiny) retry backoff
        h.clock.t += 1
        second = await h.sent()
        return first, view, second, await h.sent(), (await h.registry.get("a")).pin_status

    first, view, second, third, status = run(config, redis_server, body)
    assert first == [("p0", Command.LOAD_AND_PIN, "a")]
    assert [(p.pod, p.state, p.error) for p in view.placements] == [
        ("p0", PlacementState.FAILED, "sha256 mismatch for a (attempt 1 of 2)")]
    assert second == [("p0", Command.LOAD_AND_PIN, "a")]  # second and last attempt on p0
    assert third == [("p1", Command.LOAD_AND_PIN, "a")]  # given up on p0: placed on p1
    assert status == ""


def test_a_load_the_pod_refuses_does_not_hold_up_its_other_loads(config, redis_server):
    async def body(h):
        await h.adapter("bad", replicas=1)
        await h.adapter("good", replicas=1)
        await h.pod("p0", slots=4)
        h.pods.refuse[("p0", "bad")] = (grpc.StatusCode.INVALID_ARGUMENT, "corrupt weights")
        await h.lease.renew()
        h.clock.t += 1  # the records written now are newer than the pod's heartbeat
        first = await h.sent()
        return first, {p.pod: p.state for p in (await h.registry.get("good")).placements}

    first, good = run(config, redis_server, body)
    assert first == [("p0", Command.LOAD_AND_PIN, "bad"), ("p0", Command.LOAD_AND_PIN, "good")]
    assert good == {"p0": PlacementState.READY}


def test_pins_of_unregistered_adapters_do_not_block_a_new_pin_in_the_same_pass(config, redis_server):
    async def body(h):
        await h.pod("p0", Residency("old", pinned=True, sha256=SHA), slots=2)  # room for one pin
        await h.adapter("new", replicas=1)
        await h.lease.renew()
        return await h.sent()

    assert run(config, redis_server, body) == [("p0", Command.UNPIN, "old"), ("p0", Command.UNLOAD, "old"),
                                               ("p0", Command.LOAD_AND_PIN, "new")]


def test_an_unpin_of_an_adapter_already_gone_does_not_hold_up_the_pods_loads(config, redis_server):
    async def body(h):
        await h.pod("p0", Residency("old", pinned=True, sha256=SHA), slots=4)  # the pod's report is behind
        await h.adapter("new", replicas=1)
        h.pods.refuse[("p0", Command.UNPIN)] = (grpc.StatusCode.NOT_FOUND, "'old' is not loaded")
        h.pods.refuse[("p0", Command.UNLOAD)] = (grpc.StatusCode.NOT_FOUND, "'old' is not loaded")
        await h.store.put_placement(PlacementRecord("old", "p0", PlacementState.READY, "", 0, 1.0),
                                    await h.lease.renew())
        return await h.sent(), await h.store.placements(["old"])

    sent, placements = run(config, redis_server, body)
    assert sent == [("p0", Command.UNPIN, "old"), ("p0", Command.UNLOAD, "old"), ("p0", Command.LOAD_AND_PIN, "new")]
    assert not placements.get("old")  # the unload is done: its record goes


def test_an_unplaceable_pin_is_reported_in_the_adapters_pin_status(config, redis_server):
    async def body(h):
        await h.adapter("a", replicas=3)
        await h.pod("p0")
        await h.lease.renew()
        await h.sent()
        return await h.registry.get("a")

    view = run(config, redis_server, body)
    assert view.pin_status == "asked for 3 pods, pinned on 1: only 1 ready pod"


def test_a_pod_that_has_seen_a_newer_fencing_token_makes_the_leader_step_down(config, redis_server):
    async def body(h):
        await h.adapter("a", replicas=0)
        await h.adapter("b", replicas=0)
        await h.pod("p0")
        h.pods.refuse[("p0", Command.LOAD_AND_PIN)] = (grpc.StatusCode.ABORTED, "stale")
        await h.lease.renew()
        sent = await h.sent()
        return sent, h.lease.token

    sent, token = run(config, redis_server, body)
    assert sent == [("p0", Command.LOAD_AND_PIN, "a")]  # nothing after the refusal
    assert token == 0


def test_a_pod_lost_past_its_lease_and_grace_is_removed_and_its_pins_move(config, redis_server):
    async def body(h):
        await h.adapter("a", replicas=1)
        await h.pod("p0", Residency("a", pinned=True, sha256=SHA))
        await h.pod("p1")
        await h.lease.renew()
        assert await h.sent() == []
        h.clock.t += h.config.pod_lease_ttl + h.config.pod_grace + 0.1
        await h.pod("p1")  # p1 keeps heartbeating, p0 has gone silent
        moved = await h.sent()
        return moved, [v.pod.id for v in await h.fleet.pods()]

    moved, pods = run(config, redis_server, body)
    assert moved == [("p1", Command.LOAD_AND_PIN, "a")]
    assert pods == ["p1"]


def silent_pods_probed(config, redis_server, p0_probe: Probe, beat_while_probing: bool = False, silent_s=4.0,
                       probe_takes_s=0.0, **change):
    """p0 pins "a" (one replica) and falls silent for ``silent_s``, past --pod-probe-after (3 s) but within its
    lease (10 s), while p1 keeps beating; one pass probes p0, which finds ``p0_probe``. Returns (the commands
    that pass sent, the pods then listed, the endpoints probed, the placement records' pods)."""
    config = dataclasses.replace(config, **{"pod_lease_ttl": 10.0, "pod_grace": 20.0, "pod_probe_after": 3.0,
                                            "pod_lost_after": 4.0, **change})

    async def body(h):
        await h.adapter("a", replicas=1)
        await h.pod("p0", Residency("a", pinned=True, sha256=SHA))
        await h.pod("p1")
        await h.lease.renew()
        assert await h.sent() == [] and h.pods.probed == []  # nobody silent yet
        await h.store.put_placement(PlacementRecord("a", "p0", PlacementState.READY, "", 0, h.clock.t),
                                    h.lease.token)
        h.clock.t += silent_s
        await h.pod("p1")
        h.pods.probes[endpoint("p0")] = p0_probe
        if beat_while_probing:
            async def beat():
                h.clock.t += 0.5
                await h.pod("p0", Residency("a", pinned=True, sha256=SHA))
            h.pods.while_probing = beat
        elif probe_takes_s:
            async def wait():
                h.clock.t += probe_takes_s
            h.pods.while_probing = wait
        sent = await h.sent()
        return (sent, [v.pod.id for v in await h.fleet.pods()], h.pods.probed,
                [r.pod for r in (await h.store.placements(["a"]))["a"]])

    return run(config, redis_server, body)


def test_a_silent_pod_whose_port_refuses_is_removed_at_once_and_its_pins_move(config, redis_server):
    sent, pods, probed, placed = silent_pods_probed(config, redis_server, Probe.REFUSED)
    assert probed == [endpoint("p0")]  # only the silent pod is probed
    assert pods == ["p1"]  # removed ~4 s after its last heartbeat: its lease had 6 s to run
    assert sent == [("p1", Command.LOAD_AND_PIN, "a")]  # in the same pass
    assert placed == ["p1"]  # p0's placement went with it


def test_a_pod_silent_past_lost_after_that_does_not_answer_a_probe_is_removed_and_its_pins_move(config, redis_server):
    sent, pods, probed, placed = silent_pods_probed(config, redis_server, Probe.SILENT)
    assert probed == [endpoint("p0")]
    assert pods == ["p1"]  # removed 4 s after its last heartbeat, with 6 s of its lease left
    assert sent == [("p1", Command.LOAD_AND_PIN, "a")]  # in the same pass
    assert placed == ["p1"]


def test_the_silence_of_a_pod_that_gives_no_answer_counts_to_the_end_of_its_probe(config, redis_server):
    # silent 3.5 s when the pass probes it, and 4.5 s when the probe gives up: lost in this pass, not the next
    sent, pods, _, placed = silent_pods_probed(config, redis_server, Probe.SILENT, silent_s=3.5, probe_takes_s=1.0)
    assert (sent, pods, placed) == ([("p1", Command.LOAD_AND_PIN, "a")], ["p1"], ["p1"])


@pytest.mark.parametrize(("outcome", "silent_s", "change"), [
    (Probe.ANSWERED, 4.0, {}),  # it runs; only its heartbeats do not arrive: its lease decides
    (Probe.ANSWERED, 9.5, {}),
    (Probe.SILENT, 3.5, {}),  # not silent for --pod-lost-after yet: probed again next pass
    (Probe.SILENT, 4.0, {"pod_lost_after": 0.0}),  # turned off: left to its lease and grace
])
def test_a_silent_pod_that_answers_or_is_not_yet_lost_keeps_its_lease_and_pins(config, redis_server, outcome,
                                                                                silent_s, change):
    sent, pods, probed, placed = silent_pods_probed(config, redis_server, outcome, silent_s=silent_s, **change)
    assert probed == [endpoint("p0")]
    assert (sent, pods, placed) == ([], ["p0", "p1"], ["p0"])


def test_a_lost_pod_that_beats_while_it_is_probed_is_not_removed(config, redis_server):
    sent, pods, _, placed = silent_pods_probed(config, redis_server, Probe.SILENT, beat_while_probing=True)
    assert (sent, pods, placed) == ([], ["p0", "p1"], ["p0"])


def test_a_pod_that_beats_while_it_is_probed_is_not_removed(config, redis_server):
    sent, pods, _, placed = silent_pods_probed(config, redis_server, Probe.REFUSED, beat_while_probing=True)
    assert (sent, pods, placed) == ([], ["p0", "p1"], ["p0"])


def test_probes_can_be_turned_off(config, redis_server):
    sent, pods, probed, _ = silent_pods_probed(config, redis_server, Probe.REFUSED, pod_probe_after=0.0)
    assert (sent, pods, probed) == ([], ["p0", "p1"], [])


def test_an_unregistered_adapter_is_unpinned_and_unloaded_from_pods(config, redis_server):
    async def body(h):
        await h.pod("p0", Residency("old", pinned=True, sha256=SHA))
        await h.lease.renew()
        return await h.sent()

    assert run(config, redis_server, body) == [("p0", Command.UNPIN, "old"), ("p0", Command.UNLOAD, "old")]


def test_a_pin_written_before_the_pinned_index_existed_is_placed(config, redis_server):
    async def body(h):
        await h.adapter("a")
        await h.pod("p0")
        # pinned as a version before the pinned index wrote it: in the record alone
        redis.Redis.from_url(redis_server.url).hset("rec:adapter:a", mapping={"pinned": "1", "pin_replicas": "1"})
        await h.lease.renew()
        return await h.sent()

    assert run(config, redis_server, body) == [("p0", Command.LOAD_AND_PIN, "a")]


def test_pins_a_pod_accepted_but_has_not_reported_yet_stay_where_they_are(config, redis_server):
    """A pass that runs before the pods' next heartbeats must not place their new pins again
    elsewhere (and have the pods unpin them once they report them)."""
    async def body(h):
        await h.pod("p0")
        await h.pod("p1")
        await h.lease.renew()
        h.clock.t += 0.5  # after the heartbeats, which therefore do not show what this pass does
        await h.adapter("b", replicas=1)
        first = await h.sent()
        await h.adapter("a", replicas=1)
        return first, await h.sent()

    first, second = run(config, redis_server, body)
    assert first == [("p0", Command.LOAD_AND_PIN, "b")]
    assert second == [("p1", Command.LOAD_AND_PIN, "a")]


def test_a_pin_wakes_the_loop_for_a_pass_at_once_and_a_registration_does_not(config, redis_server):
    async def body(h):
        await h.pod("p0")
        await h.lease.renew()
        stop = asyncio.Event()
        task = asyncio.create_task(h.reconciler.run(stop))
        passes = lambda: h.metrics.registry.get_sample_value("lorafleet_control_plane_reconcile_duration_seconds_count")
        try:
            await eventually(lambda: passes() == 1)
            await h.adapter("a")
            await asyncio.sleep(1.0)  # a quarter of the interval: only an event could have woken the loop
            after_registering = passes()
            await h.registry.pin("a", 1)
            await eventually(lambda: passes() == 2)
            return after_registering, [c[:3] for c in h.pods.calls]
        finally:
            stop.set()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    slow = dataclasses.replace(config, reconcile_interval=4.0)
    assert run(slow, redis_server, body) == (1, [("p0", Command.LOAD_AND_PIN, "a")])


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "not reached in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_an_unreachable_pod_does_not_use_up_load_attempts(config, redis_server, code):
    async def body(h):
        await h.adapter("a", replicas=1)
        await h.pod("p0")
        h.pods.refuse[("p0", Command.LOAD_AND_PIN)] = (code, "connection refused")
        await h.lease.renew()
        for _ in range(3):
            await h.sent()
            await asyncio.sleep(0.05)
        return await h.store.placements(["a"])

    [placement] = run(config, redis_server, body)["a"]
    assert (placement.state, placement.attempts) == (PlacementState.LOADING, 0)
    assert "pod unreachable, will retry" in placement.error


def test_a_replica_whose_lease_another_replica_took_writes_nothing_sends_nothing_and_steps_down(config, redis_server):
    async def body(h):
        await h.adapter("a", replicas=1)
        await h.pod("p0")
        token = await h.lease.renew()
        await h.store.release_leadership("me", token)  # the lease lapsed while this replica was paused
        await LeaderLease(h.store, "successor", 30.0, ControlPlaneMetrics()).renew()
        return await h.sent(), h.lease.token, await h.store.placements(["a"]), await h.store.pin_status(["a"])

    sent, token, placements, status = run(config, redis_server, body)
    assert (sent, token, placements, status) == ([], 0, {"a": []}, {})


def test_a_leader_deposed_during_a_pass_has_its_placement_write_refused_and_steps_down(config, redis_server):
    async def body(h):
        await h.adapter("a", replicas=0)
        await h.adapter("b", replicas=0)
        await h.pod("p0")
        token = await h.lease.renew()
        successor = LeaderLease(h.store, "successor", 30.0, ControlPlaneMetrics())

        async def deposed_meanwhile():
            h.pods.while_running = None
            await h.store.release_leadership("me", token)
            await successor.renew()
            await h.store.put_placement(PlacementRecord("a", "p0", PlacementState.READY, "", 0, 5.0), successor.token)

        h.pods.while_running = deposed_meanwhile
        sent = await h.sent()
        return token, successor.token, sent, h.lease.token, await h.store.placements(["a", "b"])

    token, successor_token, sent, token_after, placements = run(config, redis_server, body)
    assert successor_token > token
    assert sent == [("p0", Command.LOAD_AND_PIN, "a")]  # "b" is never sent: the pass ended at the refused write
    assert token_after == 0
    assert placements == {"a": [PlacementRecord("a", "p0", PlacementState.READY, "", 0, 5.0)], "b": []}

"""The reconciler's diff: which DataPlaneAdmin commands bring a pod in line with the registry."""

from __future__ import annotations

from control_plane.plan import Command, plan_actions, prefetch_actions, retry_due
from control_plane.records import REPORT_LAG_S, AdapterRecord, PlacementRecord, PlacementState, PodRecord, Residency

SHA, OTHER = "ab" * 32, "cd" * 32


def registered(*names: str) -> list[AdapterRecord]:
    return [AdapterRecord(n, f"file:///a/{n}", SHA, "m", 1, True, 1) for n in names]


def pod(*residents: Residency, pod_id: str = "p0") -> PodRecord:
    return PodRecord(pod_id, "127.0.0.1:1", residents=residents)


def plan(adapters, pods, assigned, placements=None, now=100.0, max_attempts=3, backoff_s=1.0):
    return [(a.pod, a.command, a.adapter) for a in
            plan_actions(adapters, pods, assigned, placements or {}, now, max_attempts, backoff_s)]


def test_pods_that_agree_with_the_registry_get_no_commands():
    assert plan(registered("a"), [pod(Residency("a", pinned=True, sha256=SHA))], {"a": ("p0",)}) == []


def test_an_assigned_adapter_the_pod_lacks_is_loaded_and_pinned():
    actions = plan_actions(registered("a"), [pod()], {"a": ("p0",)}, {}, 0.0, 3, 1.0)
    assert [(a.command, a.source, a.sha256) for a in actions] == [(Command.LOAD_AND_PIN, "file:///a/a", SHA)]


def test_a_resident_but_unpinned_assigned_adapter_is_only_pinned():
    assert plan(registered("a"), [pod(Residency("a"))], {"a": ("p0",)}) == [("p0", Command.PIN, "a")]


def test_a_pin_no_longer_assigned_is_released_but_the_adapter_stays_cached():
    assert plan(registered("a"), [pod(Residency("a", pinned=True))], {"a": ()}) == [("p0", Command.UNPIN, "a")]


def test_an_unregistered_adapter_is_unpinned_then_unloaded():
    assert plan([], [pod(Residency("gone", pinned=True))], {}) == [
        ("p0", Command.UNPIN, "gone"), ("p0", Command.UNLOAD, "gone")]


def test_an_adapter_resident_with_other_weights_is_replaced():
    assert plan(registered("a"), [pod(Residency("a", pinned=True, sha256=OTHER))], {"a": ("p0",)}) == [
        ("p0", Command.UNPIN, "a"), ("p0", Command.UNLOAD, "a"), ("p0", Command.LOAD_AND_PIN, "a")]


def test_unpins_come_before_pins_on_a_pod_so_capacity_is_never_exceeded_in_passing():
    actions = plan(registered("a", "b"), [pod(Residency("a", pinned=True), Residency("b"))], {"b": ("p0",)})
    assert actions == [("p0", Command.UNPIN, "a"), ("p0", Command.PIN, "b")]


def test_a_pin_the_pod_accepted_after_its_last_heartbeat_is_not_sent_again():
    loaded = {"a": [PlacementRecord("a", "p0", PlacementState.READY, "", 0, 50.0)]}
    reported_before = PodRecord("p0", "127.0.0.1:1", last_heartbeat=49.0)
    assert plan(registered("a"), [reported_before], {"a": ("p0",)}, loaded) == []
    # a heartbeat arriving just after the load, sent before it (late in flight or queued): not sent again
    sent_before = PodRecord("p0", "127.0.0.1:1", last_heartbeat=50.0 + REPORT_LAG_S - 0.5)
    assert plan(registered("a"), [sent_before], {"a": ("p0",)}, loaded) == []
    # a heartbeat well after the load that lacks the adapter (the pod restarted): it is loaded again
    reported_after = PodRecord("p0", "127.0.0.1:1", last_heartbeat=50.0 + REPORT_LAG_S + 0.5)
    assert plan(registered("a"), [reported_after], {"a": ("p0",)}, loaded) == [("p0", Command.LOAD_AND_PIN, "a")]


def test_a_failed_load_waits_for_its_backoff_which_doubles_with_each_failure():
    failed = lambda attempts: {"a": [PlacementRecord("a", "p0", PlacementState.FAILED, "x", attempts, 100.0)]}
    assert plan(registered("a"), [pod()], {"a": ("p0",)}, failed(1), now=100.5) == []
    assert plan(registered("a"), [pod()], {"a": ("p0",)}, failed(1), now=101.0) == [("p0", Command.LOAD_AND_PIN, "a")]
    assert plan(registered("a"), [pod()], {"a": ("p0",)}, failed(2), now=101.5) == []
    assert retry_due(failed(2)["a"][0], now=102.0, backoff_s=1.0)


def test_a_load_that_failed_max_attempts_times_is_not_retried():
    failed = {"a": [PlacementRecord("a", "p0", PlacementState.FAILED, "bad sha", 3, 0.0)]}
    assert plan(registered("a"), [pod()], {"a": ("p0",)}, failed, now=1e9) == []


def test_each_pod_gets_only_its_own_commands():
    pods = [pod(pod_id="p0"), pod(Residency("a", pinned=True), pod_id="p1")]
    assert plan(registered("a"), pods, {"a": ("p0",)}) == [
        ("p0", Command.LOAD_AND_PIN, "a"), ("p1", Command.UNPIN, "a")]


def _remote(name: str, replicas: int, source: str = "", pinned: bool = True) -> AdapterRecord:
    return AdapterRecord(name, source or f"s3://adapters/{name}", SHA, "m", 1, pinned, replicas)


def _prefetches(adapters, pods, assigned, skip=lambda a, p, s: False):
    return sorted((a.pod, a.adapter, a.source, a.sha256) for a in prefetch_actions(adapters, pods, assigned, skip)
                  if a.command is Command.PREFETCH)


def test_a_pin_with_replicas_from_storage_is_prefetched_on_as_many_other_pods():
    pods = [pod(pod_id=f"p{i}") for i in range(5)]
    got = _prefetches([_remote("a", 2), _remote("h", 1, "hf://acme/h")], pods, {"a": ("p0", "p1"), "h": ("p2",)})
    standbys_a = [p for p, name, _, _ in got if name == "a"]
    assert len(standbys_a) == 2 and not {"p0", "p1"} & set(standbys_a)  # never a holder
    assert [(p != "p2", src, sha) for p, name, src, sha in got if name == "h"] == [(True, "hf://acme/h", SHA)]
    assert got == _prefetches([_remote("a", 2), _remote("h", 1, "hf://acme/h")], pods,
                              {"a": ("p0", "p1"), "h": ("p2",)})  # the same picks every pass


def test_no_prefetch_for_every_pod_pins_local_sources_unpinned_adapters_residents_or_what_was_done():
    pods = [pod(pod_id="p0"), pod(Residency("r", sha256=SHA), pod_id="p1"), pod(pod_id="p2")]
    assert _prefetches([_remote("all", 0), _remote("f", 1, "file:///a/f"), _remote("u", 1, pinned=False)], pods,
                       {"all": ("p0", "p1", "p2"), "f": ("p0",)}) == []
    assert [p for p, *_ in _prefetches([_remote("r", 1)], pods, {"r": ("p0",)})] == ["p2"]  # p1 holds it already
    assert _prefetches([_remote("r", 1)], pods, {"r": ("p0",)}, skip=lambda a, p, s: (a, p, s) == ("r", "p2", SHA)) \
        == []

"""The reconciliation loop: while this replica leads, drive pods towards the registry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict

from control_plane.config import ControlPlaneConfig
from control_plane.errors import NotLeader, StoreUnavailable
from control_plane.fleet import Fleet, PodView
from control_plane.leader import LeaderLease
from control_plane.metrics import ControlPlaneMetrics
from control_plane.placement import Pin, PodSlots, pinned_capacity, place
from control_plane.plan import Action, Command, plan_actions, prefetch_actions
from control_plane.pod_client import PodClients, Probe
from control_plane.prefetch import demand_rates, popular_prefetches
from control_plane.records import AdapterRecord, PlacementRecord, PlacementState, PodRecord
from control_plane.replicator import Replicator
from control_plane.store import Store

log = logging.getLogger(__name__)
_MAX_POD_BACKOFF_S = 60.0
_NO_PASS_NEEDED = frozenset({"registered"})  # change events that cannot alter placement
_LOADS = (Command.LOAD_AND_PIN, Command.LOAD)
_REPLICA_CHANGE = {Command.LOAD: "added", Command.RELEASE: "released"}
_PREFETCH_RETRY_S = 60.0  # a prefetch that failed (storage down, a pod without the RPC) is asked again after this


class Reconciler:
    """Each pass: remove lost pods (silent past lease and grace; silent with a port that refuses a
    health check; or silent past --pod-lost-after and silent to a health check too), place pins,
    record unsatisfiable ones, send the commands that make the pods agree. Passes run every
    ``reconcile_interval`` and at once after a registry change; they do nothing unless this
    replica holds the leader lease. Every write a pass makes to Redis carries the lease's fencing
    token, and a write Redis refuses (NotLeader: another replica leads now) ends the pass and steps
    this replica down."""

    def __init__(self, config: ControlPlaneConfig, store: Store, fleet: Fleet, lease: LeaderLease,
                 pods: PodClients, metrics: ControlPlaneMetrics) -> None:
        self._config = config
        self._store = store
        self._fleet = fleet
        self._lease = lease
        self._pods = pods
        self._metrics = metrics
        # pod id -> (consecutive failed passes, monotonic time before which it is left alone)
        self._pod_retry: dict[str, tuple[int, float]] = {}
        # (adapter, pod) -> (sha256, monotonic time before which it is not asked again): prefetches this
        # leader sent. A new leader asks once more; the pod answers from its disk.
        self._prefetched: dict[tuple[str, str], tuple[str, float]] = {}
        self._unsatisfied_logged: dict[str, str] = {}
        self._probe_logged: dict[str, Probe] = {}
        self._indexed_token = 0  # the lease under which the pinned index was last rebuilt
        policy = config.replica_policy()
        self._replicator = Replicator(policy, config.reserved_unpinned_slots) if policy else None
        self._prefetch = config.prefetch_policy()

    async def run(self, stop: asyncio.Event) -> None:
        """Reconciles until ``stop`` is set (within one interval)."""
        cursor = "$"
        while not stop.is_set():
            try:
                if cursor == "$":
                    cursor = await self._store.last_event_id()
                if self._lease.token:
                    await self.reconcile_once()
                cursor = await self._wait_for_change(cursor)
            except StoreUnavailable as e:
                log.warning("reconciliation paused: Redis unavailable", extra={"error": str(e)})
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._config.reconcile_interval)

    async def _wait_for_change(self, cursor: str) -> str:
        """Sleeps until the next pass is due, or a change event that may alter placement arrives,
        whichever is first; returns the cursor past the events read. A registration alone does not
        wake it: a new adapter is unpinned, and registering thousands would otherwise run a pass each."""
        deadline = time.monotonic() + self._config.reconcile_interval
        while (left := deadline - time.monotonic()) > 0:
            events = await self._store.events(cursor, count=100, block_ms=max(1, int(left * 1000)))
            if not events:
                break
            cursor = events[-1].id
            if any(e.kind not in _NO_PASS_NEEDED for e in events):
                break
        return cursor

    async def reconcile_once(self) -> list[Action]:
        """One pass as leader; returns the actions it planned (none while this replica does not
        lead). Steps down, ending the pass, when Redis refuses one of its writes as stale."""
        token = self._lease.token
        if not token:
            return []
        try:
            return await self._reconcile(token)
        except NotLeader as e:
            self._lease.step_down(str(e))
            return []

    async def _reconcile(self, token: int) -> list[Action]:
        started = time.perf_counter()
        cfg = self._config
        removed = await self._fleet.remove_lost(token)
        if removed:
            self._metrics.pods_removed.labels("lease").inc(len(removed))
            log.warning("pods removed after lease and grace", extra={"pods": removed})
        views = await self._fleet.pods()
        gone = await self._remove_lost(views, token)
        views = [v for v in views if v.pod.id not in gone]
        if token != self._indexed_token:  # once per lease: the index may predate this version's writers
            await self._store.index_pins()
            self._indexed_token = token
        # Only the adapters that are pinned, that pods hold or that pods report demand for are read
        # (with their placements, replicas' included): a pass costs what the fleet holds, not what
        # the registry holds.
        pinned = await self._store.pinned_adapters()
        seen = {r.name for v in views for r in v.pod.residents} | {n for v in views for n, _ in v.pod.demand}
        adapters = pinned + await self._store.adapters(sorted(seen - {a.name for a in pinned}))
        placements = await self._store.placements([a.name for a in adapters])
        failed = frozenset((r.adapter, r.pod) for recs in placements.values() for r in recs
                           if r.state is PlacementState.FAILED and r.attempts >= cfg.max_load_attempts)
        accepted = _accepted_since_heartbeat(views, placements)
        slots = [PodSlots(v.pod.id, pinned_capacity(v.pod.slots_total, v.pod.cpu_cache_capacity,
                                                     cfg.reserved_unpinned_slots),
                          frozenset(r.name for r in v.pod.residents if r.pinned) | accepted[v.pod.id], v.ready)
                 for v in views]
        pins = [Pin(a.name, a.pin_replicas) for a in pinned]
        assignment = place(pins, slots, failed)
        await self._store.set_pin_status(assignment.unsatisfied, token)
        for name, why in assignment.unsatisfied.items():
            if self._unsatisfied_logged.get(name) != why:  # once per change, not once per pass
                log.warning("pin not satisfied", extra={"adapter": name, "reason": why})
        self._unsatisfied_logged = dict(assignment.unsatisfied)

        ready = [v.pod for v in views if v.ready]
        actions = plan_actions(adapters, ready, assignment.pods, placements, self._store.now(),
                               cfg.max_load_attempts, cfg.retry_backoff_s)
        actions += self._replica_actions(adapters, ready, assignment.pods, placements)
        actions += prefetch_actions(pinned, ready, assignment.pods, self._prefetch_done)  # last on each pod
        planned = {(a.adapter, a.pod) for a in actions if a.command is Command.PREFETCH}
        actions += popular_prefetches(adapters, ready, demand_rates(adapters, ready), self._prefetch,
                                      lambda a, p, sha: (a, p) in planned or self._prefetch_done(a, p, sha))
        by_pod: dict[str, list[Action]] = defaultdict(list)
        for a in actions:
            if time.monotonic() >= self._pod_retry.get(a.pod, (0, 0.0))[1]:
                by_pod[a.pod].append(a)
        self._pod_retry = {p: r for p, r in self._pod_retry.items() if p in {v.pod.id for v in views}}
        self._prefetched = {k: r for k, r in self._prefetched.items() if k[1] in {v.pod.id for v in views}}
        attempts = {(r.adapter, r.pod): r.attempts for recs in placements.values() for r in recs}
        await asyncio.gather(*(self._drive(pod_actions, attempts) for pod_actions in by_pod.values()))
        await self._pods.forget({v.pod.endpoint for v in views})

        self._metrics.adapters.set(await self._store.count_adapters())
        self._metrics.adapters_pinned.set(len(pins))
        self._metrics.pins_unsatisfied.set(len(assignment.unsatisfied))
        self._metrics.pods.labels("true").set(sum(v.ready for v in views))
        self._metrics.pods.labels("false").set(sum(not v.ready for v in views))
        self._metrics.reconcile_seconds.observe(time.perf_counter() - started)
        return actions

    def _replica_actions(self, adapters: list[AdapterRecord], ready: list[PodRecord], pins: dict[str, tuple[str, ...]],
                         placements: dict[str, list[PlacementRecord]]) -> list[Action]:
        """Loads and releases of extra replicas of hot adapters, after the pins' commands on each pod
        (none while replication is off)."""
        if self._replicator is None:
            return []
        cfg = self._config
        actions = self._replicator.actions(adapters, ready, pins, placements, self._store.now(),
                                           cfg.max_load_attempts, cfg.retry_backoff_s)
        self._metrics.adapters_replicated.set(len(self._replicator.last.targets))
        return actions

    def _prefetch_done(self, adapter: str, pod: str, sha256: str) -> bool:
        sent = self._prefetched.get((adapter, pod))
        return sent is not None and sent[0] == sha256 and time.monotonic() < sent[1]

    async def _remove_lost(self, views: list[PodView], token: int) -> set[str]:
        """Probes every pod silent for more than ``pod_probe_after`` and removes, with its placements,
        each that is gone or lost: its port refuses the connection (its process exited), or it has been
        silent for ``pod_lost_after`` and does not answer either (stopped, partitioned, its node lost).
        Its pins are placed elsewhere in this pass instead of after its lease and grace. A pod that
        answers keeps its lease: it runs, and only its heartbeats do not arrive. Returns the removed
        pods' ids."""
        after, lost_after = self._config.pod_probe_after, self._config.pod_lost_after
        now = self._store.now()
        silent = [v.pod for v in views if after and now - v.pod.last_heartbeat > after]
        if not silent:
            self._probe_logged.clear()
            return set()
        outcomes = await asyncio.gather(*(self._pods.probe(p.endpoint) for p in silent))
        now = self._store.now()  # a pod that gave no answer was silent while it was probed too
        gone = set()
        for pod, outcome in zip(silent, outcomes, strict=True):
            self._metrics.pod_probes.labels(outcome.value).inc()
            silent_s = now - pod.last_heartbeat
            if self._probe_logged.get(pod.id) is not outcome:  # once per change, not once per pass
                log.warning("silent pod probed", extra={"pod": pod.id, "endpoint": pod.endpoint,
                                                        "outcome": outcome.value, "silent_s": round(silent_s, 1)})
            lost = outcome is Probe.SILENT and lost_after and silent_s >= lost_after
            if outcome is not Probe.REFUSED and not lost:
                continue
            # fenced, and refused by Redis if a heartbeat arrived since the one this pass saw
            if await self._fleet.remove(pod.id, pod.last_heartbeat, token):
                gone.add(pod.id)
                self._metrics.pods_removed.labels(outcome.value).inc()
                log.warning("pod removed", extra={"pod": pod.id, "silent_s": round(silent_s, 1), "why": (
                    "its port refuses connections" if outcome is Probe.REFUSED else "it does not answer a probe")})
        self._probe_logged = {p.id: o for p, o in zip(silent, outcomes, strict=True) if p.id not in gone}
        return gone

    async def _drive(self, actions: list[Action], attempts: dict[tuple[str, str], int]) -> None:
        """Sends one pod's actions in order, recording each load's outcome. A load the pod refuses
        fails only that adapter; an unreachable pod or a refused unpin/unload stops the pod's
        list (a later pass retries, after a per-pod backoff that doubles with each failed pass).
        Steps down on a stale fencing token, whether a pod or Redis refused it."""
        try:
            await self._send(actions, attempts)
        except NotLeader as e:
            self._lease.step_down(str(e))

    async def _send(self, actions: list[Action], attempts: dict[tuple[str, str], int]) -> None:
        for action in actions:
            token = self._lease.token
            if not token:
                return
            key = (action.adapter, action.pod)
            if action.command in _LOADS:
                await self._record(action, token, PlacementState.LOADING, "", attempts.get(key, 0))
            result = await self._pods.execute(action, token)
            outcome = "ok" if result.ok else result.code.name.lower()
            self._metrics.pod_commands.labels(action.command.value, outcome).inc()
            log.info("pod command", extra={"pod": action.pod, "command": action.command.value,
                                           "adapter": action.adapter, "fencing_token": token, "outcome": outcome,
                                           "error": result.error})
            if result.stale:
                self._lease.step_down(f"pod {action.pod} has seen a newer fencing token than {token}")
                return
            if action.command is Command.PREFETCH:  # no placement: a copy on disk serves nothing yet
                retry_at = math.inf if result.ok else time.monotonic() + _PREFETCH_RETRY_S
                self._prefetched[(action.adapter, action.pod)] = (action.sha256, retry_at)
                continue
            if result.ok and action.command in _REPLICA_CHANGE:
                self._metrics.replica_changes.labels(_REPLICA_CHANGE[action.command]).inc()
            if action.command in (*_LOADS, Command.PIN):
                if result.ok:
                    await self._record(action, token, PlacementState.READY, "", 0)
                elif result.transient:
                    await self._record(action, token, PlacementState.LOADING,
                                       f"pod unreachable, will retry: {result.error}", attempts.get(key, 0))
                else:
                    failures = attempts.get(key, 0) + 1
                    await self._record(action, token, PlacementState.FAILED,
                                       f"{result.error} (attempt {failures} of {self._config.max_load_attempts})",
                                       failures)
            elif action.command in (Command.UNLOAD, Command.RELEASE) and result.ok:
                await self._store.delete_placement(action.adapter, action.pod, token)
            if not result.ok and not result.transient and action.command in (*_LOADS, Command.PIN, Command.RELEASE):
                continue  # the adapter's own fault (or a replica still in use): the pod's other commands still go out
            if not result.ok:
                failed_passes = self._pod_retry.get(action.pod, (0, 0.0))[0] + 1
                delay = min(_MAX_POD_BACKOFF_S, self._config.retry_backoff_s * 2 ** (failed_passes - 1))
                self._pod_retry[action.pod] = (failed_passes, time.monotonic() + delay)
                return
        if actions:
            self._pod_retry.pop(actions[0].pod, None)

    async def _record(self, action: Action, token: int, state: PlacementState, error: str, attempts: int) -> None:
        await self._store.put_placement(PlacementRecord(action.adapter, action.pod, state, error, attempts,
                                                        self._store.now(), action.command is not Command.LOAD), token)


def _accepted_since_heartbeat(views: list[PodView], placements: dict[str, list[PlacementRecord]],
                              ) -> defaultdict[str, set[str]]:
    """Pod id -> adapters it loaded and pinned for this leader after its last heartbeat. Placement
    counts them as held: otherwise a pass that runs before the pod reports them places them anew,
    possibly elsewhere, and the pod's next report has them unpinned again (churn that grows with
    the fleet)."""
    pods = {v.pod.id: v.pod for v in views}
    accepted: defaultdict[str, set[str]] = defaultdict(set)
    for recs in placements.values():
        for r in recs:
            if r.pinned and r.pod in pods and r.ready_since(pods[r.pod]):
                accepted[r.pod].add(r.adapter)
    return accepted

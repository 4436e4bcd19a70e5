"""The registry in Redis: the only module that talks to Redis.

Key layout, all under ``{prefix}:``
    adapter:{name}     hash   name, source, sha256, base_model, version, pinned, pin_replicas
    adapters           zset   every adapter name at score 0 (name order, for paging by ZRANGEBYLEX)
    pinned             set    names of the pinned adapters: all a reconciliation pass reads of the registry
    placement:{name}   hash   pod id -> JSON PlacementRecord (what the reconciler asked of that pod)
    pin_status         hash   adapter name -> why its pin is not fully placed
    pods               zset   pod id -> unix time of its last heartbeat (each heartbeat a newer one)
    pod:{id}           string JSON PodRecord as of its last heartbeat: unchanged while that time is
    events             stream change feed: kind, name, version (capped, approximately)
    leader             string "{replica}|{fencing token}" with a TTL: the reconciler lease
    fencing            int    last fencing token issued (INCR; never decreases)

The reconciler's writes (placements, pin status, removing lost pods) are fenced: each is a Lua
script that first checks that the lease key still holds the writer's fencing token, so Redis
itself refuses the write of a deposed leader (NotLeader), however late it arrives.

Adapter writes are compare-and-set on the record's version: WATCH the hash, read, check, then
MULTI/EXEC the new record, its index and its change event together; a concurrent writer aborts
the EXEC and the change is retried on the fresh record, so no acknowledged write is lost.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import redis.asyncio as redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError, WatchError

from control_plane.errors import (
    AdapterExists,
    AdapterNotFound,
    InvalidArgument,
    NotLeader,
    StoreUnavailable,
    VersionConflict,
)
from control_plane.records import AdapterRecord, Event, PlacementRecord, PodRecord

_CAS_ATTEMPTS = 32
_MAX_CONNECTIONS = 64
_CONNECTION_WAIT_S = 5.0  # then StoreUnavailable, as for a Redis that does not answer
_Writes = Callable[[Pipeline], None]  # queues one transaction's commands

# KEYS: leader, fencing. ARGV: replica, ttl ms. Returns the holder's fencing token, or 0 when
# another replica holds the lease. A lapsed lease is taken with a new, larger token.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local sep = string.find(cur, '|', 1, true)
  if string.sub(cur, 1, sep - 1) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(string.sub(cur, sep + 1))
  end
  return 0
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return token
"""

# KEYS: leader. ARGV: "{replica}|{token}". Deletes the lease only if this holder still has it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# The preamble of every fenced script. KEYS[1]: leader. ARGV[1]: the writer's fencing token.
# Returns -1 (and writes nothing) unless the lease is held, unexpired, with that token; the
# script after it returns a count >= 0.
_FENCE = """
local lease = redis.call('GET', KEYS[1])
if not lease or string.sub(lease, string.find(lease, '|', 1, true) + 1) ~= ARGV[1] then return -1 end
"""

# KEYS: leader, placement:{adapter}. ARGV: token, pod, JSON PlacementRecord.
_PUT_PLACEMENT = _FENCE + "return redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])"

# KEYS: leader, placement:{adapter}. ARGV: token, pod.
_DELETE_PLACEMENT = _FENCE + "return redis.call('HDEL', KEYS[2], ARGV[2])"

# KEYS: leader, pin_status. ARGV: token, then adapter name, status, name, status, ...
_SET_PIN_STATUS = _FENCE + """
redis.call('DEL', KEYS[2])
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
return 0
"""

# KEYS: adapters, pinned. ARGV: the prefix of adapter:{name} keys. Rebuilds the pinned index from
# the records themselves, in one step, so that no pin written meanwhile is lost from it.
_INDEX_PINS = """
redis.call('DEL', KEYS[2])
for _, name in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('HGET', ARGV[1] .. name, 'pinned') == '1' then redis.call('SADD', KEYS[2], name) end
end
return redis.call('SCARD', KEYS[2])
"""

# KEYS: leader, pods, pod:{id}, events, then placement:{name} of every adapter. ARGV: token, id,
# cutoff, maxlen. Removes the pod and its placements only if no heartbeat arrived since the
# caller decided it was dead.
_REMOVE_POD = _FENCE + """
local score = redis.call('ZSCORE', KEYS[2], ARGV[2])
if not score or tonumber(score) > tonumber(ARGV[3]) then return 0 end
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('DEL', KEYS[3])
for i = 5, #KEYS do redis.call('HDEL', KEYS[i], ARGV[2]) end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'kind', 'pod_removed', 'name', ARGV[2], 'version', '0')
return 1
"""

# KEYS: hashes. Each one's fields and values as one flat array (empty for a missing key): many records
# come back as one reply, which hiredis parses at once, where a pipeline costs Python work per reply
# (most of a pass's time with thousands of adapters held in the fleet).
_HGETALL_MANY = "local out = {} for i, k in ipairs(KEYS) do out[i] = redis.call('HGETALL', k) end return out"
# Hashes read per script call: each call holds Redis and this event loop for a bounded time.
_READ_CHUNK = 500


class Store:
    """Async access to the registry; every method is one atomic step in Redis."""

    def __init__(self, redis_url: str, prefix: str, event_maxlen: int = 10_000,
                 clock: Callable[[], float] = time.time) -> None:
        # A bounded pool that makes a call wait for a free connection: redis-py's default pool fails
        # the call instead ("Too many connections") once 100 are in use, which a hundred pods'
        # heartbeats arriving together with admin calls and a reconciliation pass reach.
        self._r = redis.Redis.from_pool(redis.BlockingConnectionPool.from_url(
            redis_url, max_connections=_MAX_CONNECTIONS, timeout=_CONNECTION_WAIT_S, decode_responses=True,
            socket_timeout=5.0, socket_connect_timeout=2.0))
        self._p = prefix
        self._maxlen = event_maxlen
        self._clock = clock
        self._acquire = self._r.register_script(_ACQUIRE)
        self._release = self._r.register_script(_RELEASE)
        self._remove_pod = self._r.register_script(_REMOVE_POD)
        self._put_placement = self._r.register_script(_PUT_PLACEMENT)
        self._delete_placement = self._r.register_script(_DELETE_PLACEMENT)
        self._set_pin_status = self._r.register_script(_SET_PIN_STATUS)
        self._index_pins = self._r.register_script(_INDEX_PINS)
        self._hgetall_many = self._r.register_script(_HGETALL_MANY)

    def _k(self, *parts: str) -> str:
        return ":".join((self._p, *parts))

    async def close(self) -> None:
        await self._r.aclose()

    async def ping(self) -> None:
        """Returns when Redis answers; raises StoreUnavailable otherwise."""
        async with _available():
            await self._r.ping()

    # ---- adapters -------------------------------------------------------------------------

    async def create_adapter(self, rec: AdapterRecord) -> AdapterRecord:
        """Stores a new adapter at version 1. Registering the same adapter again returns the
        stored record; the same weights (sha256) from another source move the adapter there (the next
        version; pins and placements stay: the pods hold the same content); different weights or
        another base model under a taken name raise AdapterExists."""
        def decide(old: AdapterRecord | None) -> tuple[AdapterRecord, _Writes | None]:
            if old is not None:
                if (old.sha256, old.base_model) != (rec.sha256, rec.base_model):
                    raise AdapterExists(
                        f"adapter {rec.name!r} is already registered with other weights (sha256 {old.sha256}, "
                        f"source {old.source}); unregister it first or choose another name")
                if old.source == rec.source:
                    return old, None
                moved = dataclasses.replace(old, source=rec.source, version=old.version + 1)

                def move(pipe: Pipeline) -> None:
                    pipe.hset(self._k("adapter", rec.name), mapping=moved.to_fields())
                    self._event(pipe, "source-changed", rec.name, moved.version)
                return moved, move
            new = dataclasses.replace(rec, version=1)

            def write(pipe: Pipeline) -> None:
                pipe.hset(self._k("adapter", rec.name), mapping=new.to_fields())
                pipe.zadd(self._k("adapters"), {rec.name: 0})
                self._index_pin(pipe, new)
                self._event(pipe, "registered", rec.name, 1)
            return new, write

        return await self._compare_and_set(rec.name, "registering", decide)

    async def get_adapter(self, name: str) -> AdapterRecord:
        async with _available():
            rec = _adapter(await self._r.hgetall(self._k("adapter", name)))
        if rec is None:
            raise _not_found(name)
        return rec

    async def update_adapter(self, name: str, change: Callable[[AdapterRecord], AdapterRecord], event: str,
                             expected_version: int = 0, clear_placements: bool = False) -> AdapterRecord:
        """Applies ``change`` to the current record and stores it at the next version, retrying
        on concurrent writes. With ``expected_version`` the write happens only if the record is
        still at that version (VersionConflict otherwise). A change that alters nothing is not
        written and keeps the version. ``clear_placements`` also forgets the reconciler's
        placement records (and so its failed-load counts) for the adapter."""
        def decide(old: AdapterRecord | None) -> tuple[AdapterRecord, _Writes | None]:
            _check_version(name, old, expected_version)
            new = dataclasses.replace(change(old), name=name, version=old.version)
            if new == old and not clear_placements:
                return old, None
            new = dataclasses.replace(new, version=old.version + (new != old))

            def write(pipe: Pipeline) -> None:
                pipe.hset(self._k("adapter", name), mapping=new.to_fields())
                self._index_pin(pipe, new)
                if clear_placements:
                    pipe.delete(self._k("placement", name))
                self._event(pipe, event, name, new.version)
            return new, write

        return await self._compare_and_set(name, "updating", decide)

    async def delete_adapter(self, name: str, expected_version: int = 0) -> AdapterRecord:
        """Removes the adapter, its placements and its pin status; returns the removed record."""
        def decide(old: AdapterRecord | None) -> tuple[AdapterRecord, _Writes | None]:
            _check_version(name, old, expected_version)

            def write(pipe: Pipeline) -> None:
                pipe.delete(self._k("adapter", name), self._k("placement", name))
                pipe.zrem(self._k("adapters"), name)
                pipe.srem(self._k("pinned"), name)
                pipe.hdel(self._k("pin_status"), name)
                self._event(pipe, "unregistered", name, old.version + 1)
            return old, write

        return await self._compare_and_set(name, "unregistering", decide)

    async def _compare_and_set(self, name: str, doing: str,
                               decide: Callable[[AdapterRecord | None], tuple[AdapterRecord, _Writes | None]],
                               ) -> AdapterRecord:
        """WATCHes adapter ``name``'s hash, passes its record (None when absent) to ``decide``,
        and runs the writes ``decide`` returns in one MULTI/EXEC. A concurrent write to the hash
        aborts the EXEC, and ``decide`` runs again on the fresh record. Returns the record
        ``decide`` returns (with no writes, nothing is written); raises what ``decide`` raises,
        or StoreUnavailable after _CAS_ATTEMPTS conflicts in a row."""
        key = self._k("adapter", name)
        async with _available(), self._r.pipeline() as pipe:
            for _ in range(_CAS_ATTEMPTS):
                try:
                    await pipe.watch(key)
                    result, write = decide(_adapter(await pipe.hgetall(key)))
                    if write is None:
                        await pipe.reset()
                        return result
                    pipe.multi()
                    write(pipe)
                    await pipe.execute()
                    return result
                except WatchError:
                    continue
        raise StoreUnavailable(f"{doing} {name!r} kept conflicting with other writers; retry")

    async def list_adapters(self, page_size: int, page_token: str = "") -> tuple[list[AdapterRecord], str]:
        """One page of adapters in name order and the token of the next page ("" on the last)."""
        start = "-"
        if page_token:
            try:
                start = "(" + base64.b64decode(page_token.encode(), altchars=b"-_", validate=True).decode()
                if start == "(":
                    raise ValueError("empty page token")
            except (ValueError, UnicodeDecodeError) as e:
                raise InvalidArgument(f"page_token {page_token!r} is not one this server issued; "
                                      "pass next_page_token from the previous page or empty") from e
        async with _available():
            names = await self._r.zrangebylex(self._k("adapters"), start, "+", start=0, num=page_size + 1)
            records = await self._adapters(names[:page_size])
        token = ""
        if len(names) > page_size:
            token = base64.urlsafe_b64encode(names[page_size - 1].encode()).decode()
        return records, token

    async def all_adapters(self) -> list[AdapterRecord]:
        async with _available():
            return await self._adapters(await self._r.zrange(self._k("adapters"), 0, -1))

    async def adapters(self, names: list[str]) -> list[AdapterRecord]:
        """The records of those of ``names`` that are registered, in the order given."""
        async with _available():
            return await self._adapters(names)

    async def pinned_adapters(self) -> list[AdapterRecord]:
        """Every pinned adapter's record, in name order: read through the pinned index, so the cost
        grows with the pins, not with the registry."""
        async with _available():
            names = sorted(await self._r.smembers(self._k("pinned")))
            return [rec for rec in await self._adapters(names) if rec.pinned]

    async def count_adapters(self) -> int:
        async with _available():
            return await self._r.zcard(self._k("adapters"))

    async def index_pins(self) -> int:
        """Rebuilds the pinned index from the adapter records (one atomic step, a scan of the whole
        registry in Redis), for a registry written before the index existed; returns the pin count."""
        async with _available():
            return int(await self._index_pins(keys=[self._k("adapters"), self._k("pinned")],
                                              args=[self._k("adapter", "")]))

    def _index_pin(self, pipe: Pipeline, rec: AdapterRecord) -> None:
        if rec.pinned:
            pipe.sadd(self._k("pinned"), rec.name)
        else:
            pipe.srem(self._k("pinned"), rec.name)

    async def _adapters(self, names: list[str]) -> list[AdapterRecord]:
        rows = await self._hashes([self._k("adapter", n) for n in names])
        # A name removed between the two reads is skipped rather than reported half-gone.
        return [rec for rec in map(_adapter, rows) if rec is not None]

    async def _hashes(self, keys: list[str]) -> list[dict[str, str]]:
        """HGETALL of each key, in order ({} for a missing one), ``_READ_CHUNK`` keys per round trip."""
        rows: list[dict[str, str]] = []
        for i in range(0, len(keys), _READ_CHUNK):
            rows += (dict(zip(flat[::2], flat[1::2], strict=True))
                     for flat in await self._hgetall_many(keys=keys[i : i + _READ_CHUNK]))
        return rows

    # ---- pods -----------------------------------------------------------------------------

    async def put_pod(self, pod: PodRecord) -> int:
        """Records a heartbeat: the pod's state, and its lease renewed from pod.last_heartbeat.
        Returns the newest fencing token, read in the same round trip (see fencing_token). Each call
        must carry a newer last_heartbeat than the pod's previous one: list_pods reuses a record it read
        before while that time is unchanged."""
        async with _available(), self._r.pipeline(transaction=True) as pipe:
            pipe.set(self._k("pod", pod.id), pod.to_json())
            pipe.zadd(self._k("pods"), {pod.id: pod.last_heartbeat})
            pipe.get(self._k("fencing"))
            _, added, token = await pipe.execute()
            if added:
                await self._r.xadd(self._k("events"), {"kind": "pod_joined", "name": pod.id, "version": "0"},
                                   maxlen=self._maxlen, approximate=True)
        return int(token or 0)

    async def list_pods(self, heard_since: float = 0.0, known: Mapping[str, PodRecord] | None = None,
                        ) -> list[PodRecord]:
        """Pods whose last heartbeat is at or after ``heard_since``, in id order. A record in ``known`` (read
        before) whose heartbeat time is still the pod's is returned as it is, neither read nor decoded again:
        a record changes only with a heartbeat, which changes that time."""
        known = known or {}
        async with _available():
            beats = await self._r.zrangebyscore(self._k("pods"), heard_since, "+inf", withscores=True)
            kept = [known[i] for i, t in beats if i in known and known[i].last_heartbeat == t]
            stale = [i for i, t in beats if i not in known or known[i].last_heartbeat != t]
            rows = await self._r.mget([self._k("pod", i) for i in stale]) if stale else []
        return sorted([*kept, *(PodRecord.from_json(row) for row in rows if row)], key=lambda p: p.id)

    async def remove_pods_silent_since(self, cutoff: float, token: int) -> list[str]:
        """Removes every pod with no heartbeat after ``cutoff``, with its placements; returns their
        ids. Fenced by the leader's ``token`` (NotLeader once it is not the current one)."""
        async with _available():
            ids = await self._r.zrangebyscore(self._k("pods"), "-inf", cutoff)
            names = await self._r.zrange(self._k("adapters"), 0, -1) if ids else []
        return [pod_id for pod_id in ids if await self._remove_pod_if_silent(pod_id, cutoff, names, token)]

    async def remove_pod(self, pod_id: str, heard_until: float, token: int) -> bool:
        """Removes one pod with its placements, unless a heartbeat newer than ``heard_until`` (the
        last one the caller saw) has arrived meanwhile; returns whether it did. Fenced like
        remove_pods_silent_since."""
        async with _available():
            names = await self._r.zrange(self._k("adapters"), 0, -1)
        return await self._remove_pod_if_silent(pod_id, heard_until, names, token)

    async def _remove_pod_if_silent(self, pod_id: str, cutoff: float, names: list[str], token: int) -> bool:
        keys = [self._k("pods"), self._k("pod", pod_id), self._k("events"), *(self._k("placement", n) for n in names)]
        return bool(await self._fenced(self._remove_pod, token, keys, [pod_id, cutoff, self._maxlen]))

    # ---- placements and pin status --------------------------------------------------------

    async def put_placement(self, rec: PlacementRecord, token: int) -> None:
        """Records what the leader holding ``token`` asked of a pod (NotLeader when it no longer leads)."""
        await self._fenced(self._put_placement, token, [self._k("placement", rec.adapter)], [rec.pod, rec.to_json()])

    async def delete_placement(self, adapter: str, pod: str, token: int) -> None:
        """Forgets a placement, fenced like put_placement."""
        await self._fenced(self._delete_placement, token, [self._k("placement", adapter)], [pod])

    async def placements(self, names: list[str]) -> dict[str, list[PlacementRecord]]:
        """The placement records of each named adapter, by pod id."""
        async with _available():
            rows = await self._hashes([self._k("placement", n) for n in names])
        return {n: sorted(map(PlacementRecord.from_json, row.values()), key=lambda p: p.pod)
                for n, row in zip(names, rows, strict=True)}

    async def set_pin_status(self, statuses: dict[str, str], token: int) -> None:
        """Replaces every adapter's pin status at once (adapters absent here are fully placed),
        fenced like put_placement."""
        await self._fenced(self._set_pin_status, token, [self._k("pin_status")],
                           [x for item in statuses.items() for x in item])

    async def _fenced(self, script, token: int, keys: list[str], args: list) -> int:
        """Runs a fenced script (one that starts with _FENCE); returns its count, or raises
        NotLeader when Redis refused the write because ``token`` is not the lease's."""
        async with _available():
            result = int(await script(keys=[self._k("leader"), *keys], args=[token, *args]))
        if result < 0:
            raise NotLeader(f"fencing token {token} is no longer the reconciler lease's (it lapsed or another "
                            "replica took it): Redis refused the write; this replica stops reconciling until "
                            "it holds the lease again")
        return result

    async def pin_status(self, names: list[str]) -> dict[str, str]:
        if not names:
            return {}
        async with _available():
            values = await self._r.hmget(self._k("pin_status"), names)
        return {n: v for n, v in zip(names, values, strict=True) if v}

    # ---- change feed ----------------------------------------------------------------------

    def _event(self, pipe, kind: str, name: str, version: int) -> None:
        pipe.xadd(self._k("events"), {"kind": kind, "name": name, "version": str(version)},
                  maxlen=self._maxlen, approximate=True)

    async def events(self, after: str = "0-0", count: int = 100, block_ms: int | None = None) -> list[Event]:
        """Change events after stream id ``after``, oldest first; waits up to ``block_ms`` for one."""
        async with _available():
            reply = await self._r.xread({self._k("events"): after}, count=count, block=block_ms)
        if not reply:
            return []
        entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        return [Event(id=i, kind=f["kind"], name=f["name"], version=int(f.get("version", 0)), fields=f)
                for i, f in entries]

    async def last_event_id(self) -> str:
        async with _available():
            last = await self._r.xrevrange(self._k("events"), count=1)
        return last[0][0] if last else "0-0"

    # ---- leader lease ---------------------------------------------------------------------

    async def acquire_leadership(self, replica: str, ttl_s: float) -> int:
        """Takes or renews the reconciler lease for ``ttl_s``; returns this replica's fencing
        token, or 0 while another replica holds the lease."""
        async with _available():
            return int(await self._acquire(keys=[self._k("leader"), self._k("fencing")],
                                           args=[replica, max(1, int(ttl_s * 1000))]))

    async def release_leadership(self, replica: str, token: int) -> bool:
        """Gives the lease up if this replica still holds it with ``token``."""
        async with _available():
            return bool(await self._release(keys=[self._k("leader")], args=[f"{replica}|{token}"]))

    async def leader(self) -> tuple[str, int] | None:
        """(replica, fencing token) of the current lease holder, or None."""
        async with _available():
            cur = await self._r.get(self._k("leader"))
        if not cur:
            return None
        replica, _, token = cur.rpartition("|")
        return replica, int(token)

    async def fencing_token(self) -> int:
        """The newest fencing token ever issued (0 before any)."""
        async with _available():
            return int(await self._r.get(self._k("fencing")) or 0)

    def now(self) -> float:
        return self._clock()


@asynccontextmanager
async def _available() -> AsyncIterator[None]:
    try:
        yield
    except RedisError as e:
        raise StoreUnavailable(f"Redis is unavailable ({e}); check --redis-url and that Redis is running") from e


def _check_version(name: str, old: AdapterRecord | None, expected: int) -> None:
    if old is None:
        raise _not_found(name)
    if expected and old.version != expected:
        raise VersionConflict(f"adapter {name!r} is at version {old.version}, not {expected}; "
                              "read it again (GetAdapter) and retry with the current version")


def _adapter(h: dict[str, str]) -> AdapterRecord | None:
    return AdapterRecord.from_fields(h) if h else None


def _not_found(name: str) -> AdapterNotFound:
    return AdapterNotFound(f"adapter {name!r} is not registered; register it first (RegisterAdapter)")

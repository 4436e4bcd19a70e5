"""The adapter registry's operations: validate, store, and join with what pods report."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from control_plane.errors import InvalidArgument
from control_plane.fleet import Fleet, PodView
from control_plane.records import AdapterRecord, PlacementRecord, PlacementState, Residency
from control_plane.store import Store
from conventions.names import NAME_RULE, is_valid_name

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100


@dataclass(frozen=True)
class PlacementView:
    """An adapter on one pod: what the pod reports, else what the reconciler last asked of it."""

    pod: str
    endpoint: str
    state: PlacementState
    pinned: bool = False
    error: str = ""
    load: int = 0  # running + waiting requests on the pod, for tie-breaking routes


@dataclass(frozen=True)
class AdapterView:
    record: AdapterRecord
    placements: tuple[PlacementView, ...] = ()
    rank: int = 0
    pin_status: str = ""


class Registry:
    """Adapter registration, pins and routing over the store and the fleet."""

    def __init__(self, store: Store, fleet: Fleet, base_model: str) -> None:
        self._store = store
        self._fleet = fleet
        self._base_model = base_model

    async def register(self, name: str, source: str, sha256: str, base_model: str) -> AdapterView:
        """Registers a new adapter (idempotent for identical fields)."""
        validate_name(name)
        _validate_source(source)
        sha256 = sha256.lower()
        if not _SHA256_RE.match(sha256):
            raise InvalidArgument(f"sha256 {sha256!r} must be 64 hex characters: the SHA-256 of "
                                  "adapter_model.safetensors (sha256sum prints it)")
        base_model = base_model or self._base_model
        if not base_model:
            raise InvalidArgument("base_model is required: the id of the model the adapter was trained on")
        if self._base_model and base_model != self._base_model:
            raise InvalidArgument(f"base_model {base_model!r} is not this fleet's base model {self._base_model!r}; "
                                  "adapters only apply to the model they were trained on")
        rec = await self._store.create_adapter(AdapterRecord(name, source, sha256, base_model))
        return await self._view(rec)

    async def unregister(self, name: str, expected_version: int = 0) -> None:
        validate_name(name)
        await self._store.delete_adapter(name, expected_version)

    async def pin(self, name: str, replicas: int, expected_version: int = 0) -> AdapterView:
        validate_name(name)
        if replicas > 10_000:
            raise InvalidArgument(f"replicas {replicas} is too large; use 0 to pin on every pod")
        change = lambda r: dataclasses.replace(r, pinned=True, pin_replicas=replicas)
        # Pinning again is how an operator retries loads that failed for good.
        rec = await self._store.update_adapter(name, change, "pinned", expected_version, clear_placements=True)
        return await self._view(rec)

    async def unpin(self, name: str, expected_version: int = 0) -> AdapterView:
        validate_name(name)
        change = lambda r: dataclasses.replace(r, pinned=False, pin_replicas=0)
        return await self._view(await self._store.update_adapter(name, change, "unpinned", expected_version))

    async def get(self, name: str) -> AdapterView:
        validate_name(name)
        return await self._view(await self._store.get_adapter(name))

    async def resolve(self, name: str) -> AdapterRecord:
        """Where a registered adapter's weights live (AdapterNotFound when unregistered)."""
        validate_name(name)
        return await self._store.get_adapter(name)

    async def list_adapters(self, page_size: int, page_token: str) -> tuple[list[AdapterView], str]:
        if page_size > MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size {page_size} is above {MAX_PAGE_SIZE}; ask for fewer and page on")
        records, token = await self._store.list_adapters(page_size or DEFAULT_PAGE_SIZE, page_token)
        return await self._views(records), token

    async def pods(self) -> list[PodView]:
        return await self._fleet.pods()

    async def route(self, adapter: str) -> list[PlacementView]:
        """Ready pods holding ``adapter`` (every ready pod for the base model): READY before
        LOADING, pinned before unpinned, then the least loaded."""
        if not adapter:
            return [PlacementView(v.pod.id, v.pod.endpoint, PlacementState.READY, load=_load(v))
                    for v in sorted(await self._fleet.pods(), key=lambda v: (_load(v), v.pod.id)) if v.ready]
        view = await self.get(adapter)
        ready = {v.pod.id for v in await self._fleet.pods() if v.ready}
        usable = [p for p in view.placements if p.pod in ready and p.state is not PlacementState.FAILED]
        return sorted(usable, key=lambda p: (p.state is not PlacementState.READY, not p.pinned, p.load, p.pod))

    async def _view(self, rec: AdapterRecord) -> AdapterView:
        return (await self._views([rec]))[0]

    async def _views(self, records: list[AdapterRecord]) -> list[AdapterView]:
        names = [r.name for r in records]
        pods = await self._fleet.pods()
        placements = await self._store.placements(names)
        statuses = await self._store.pin_status(names)
        by_id = {v.pod.id: v for v in pods}
        held = _holders(pods, set(names))
        return [_join(r, by_id, held.get(r.name, {}), placements.get(r.name, []), statuses.get(r.name, ""))
                for r in records]


def validate_name(name: str) -> None:
    if not is_valid_name(name):
        raise InvalidArgument(f"adapter name {name!r} is invalid: use {NAME_RULE}")


def _validate_source(source: str) -> None:
    url = urlparse(source)
    # A file:// path is unquoted into a file name, an http(s) URL is sent as it is.
    text = source + (unquote(url.path) if url.scheme == "file" else "")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise InvalidArgument(f"source {source!r} contains a control character (NUL, newline, ...), which no "
                              "path or URL the pods can load holds")
    if url.scheme == "file" and url.path not in ("", "/") and not url.netloc:
        return
    if url.scheme in ("http", "https", "s3", "hf") and url.netloc:
        if "@" in url.netloc:  # hf://org/repo@rev keeps its @ in the path; one in the host part is user:password@
            raise InvalidArgument(f"source {url.scheme}://…@{url.netloc.rpartition('@')[2]}{url.path} carries "
                                  "credentials, which would be stored and shown; give the pods credentials "
                                  "through their environment or service account instead")
        return
    raise InvalidArgument(f"source {source!r} must be a file:///absolute/path under the pods' adapter roots, "
                          "an http(s)://host/path, s3://BUCKET/PREFIX or hf://ORG/REPO[@REVISION] URL")


def _load(v: PodView) -> int:
    return v.pod.running_requests + v.pod.waiting_requests


def _holders(pods: list[PodView], names: set[str]) -> dict[str, dict[str, Residency]]:
    """Adapter -> pod id -> its residency there, for the adapters in ``names``: one walk over the
    pods' reports for a whole page, rather than one per adapter and pod."""
    out: dict[str, dict[str, Residency]] = {}
    for v in pods:
        for r in v.pod.residents:
            if r.name in names:
                out.setdefault(r.name, {})[v.pod.id] = r
    return out


def _join(rec: AdapterRecord, pods: dict[str, PodView], held: dict[str, Residency], records: list[PlacementRecord],
          pin_status: str) -> AdapterView:
    """What each pod reports wins over what the reconciler asked: a resident adapter with the
    registered weights is READY; otherwise the reconciler's LOADING or FAILED record shows.
    ``held``: pod id -> the adapter's residency there; placements list in pod id order."""
    asked = {p.pod: p for p in records}
    out, rank = [], 0
    for v in (pods[i] for i in sorted(held.keys() | asked.keys()) if i in pods):
        res = held.get(v.pod.id)
        if res is not None and res.sha256 in ("", rec.sha256):
            rank = max(rank, res.rank)
            out.append(PlacementView(v.pod.id, v.pod.endpoint, PlacementState.READY, res.pinned, load=_load(v)))
        elif (p := asked.get(v.pod.id)) is not None and (p.state is not PlacementState.READY
                                                        or p.ready_since(v.pod)):
            # A READY record the pod has not reported yet shows until its next heartbeat.
            out.append(PlacementView(v.pod.id, v.pod.endpoint, p.state, p.state is PlacementState.READY and
                                     rec.pinned and p.pinned, p.error, load=_load(v)))
    return AdapterView(rec, tuple(out), rank, pin_status if rec.pinned else "")

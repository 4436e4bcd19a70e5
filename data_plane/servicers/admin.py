"""``DataPlaneAdmin``: the control plane's commands to this pod's adapter caches."""

from __future__ import annotations

from lorafleet.v1 import data_plane_admin_pb2 as pb
from lorafleet.v1 import data_plane_admin_pb2_grpc

from conventions.disk_key import disk_key
from data_plane.engine.engine import Engine
from data_plane.lora.adapter_cache import Residency, Tier, TierUsage
from data_plane.membership import FencingGuard
from data_plane.servicers import EngineHandle

_TIER = {Tier.CPU: pb.CPU, Tier.GPU: pb.GPU}
# Disk-tier copies GetState lists at most (8 bytes each): a pod's --adapter-disk-cache-bytes of 10 GiB holds
# about 300 copies of a Llama-3-8B rank-16 adapter.
DISK_REPORT = 4096


class DataPlaneAdminServicer(data_plane_admin_pb2_grpc.DataPlaneAdminServicer):
    def __init__(self, handle: EngineHandle, guard: FencingGuard, pod_id: str, base_model: str) -> None:
        self._handle = handle
        self._guard = guard
        self._pod_id = pod_id
        self._base_model = base_model

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.AdapterResidency:
        engine = self._handle.get()
        self._guard.check(request.fencing_token)
        return residency_pb(await engine.adapters.load(request.name, request.source, request.sha256))

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.UnloadAdapterResponse:
        engine = self._handle.get()
        self._guard.check(request.fencing_token)
        return pb.UnloadAdapterResponse(was_resident=await engine.adapters.unload(request.name))

    async def PinAdapter(self, request: pb.PodPinAdapterRequest, context) -> pb.AdapterResidency:
        engine = self._handle.get()
        self._guard.check(request.fencing_token)
        return residency_pb(await engine.adapters.pin(request.name))

    async def UnpinAdapter(self, request: pb.PodUnpinAdapterRequest, context) -> pb.AdapterResidency:
        engine = self._handle.get()
        self._guard.check(request.fencing_token)
        return residency_pb(await engine.adapters.unpin(request.name))

    async def PrefetchAdapter(self, request: pb.PrefetchAdapterRequest, context) -> pb.PrefetchAdapterResponse:
        engine = self._handle.get()
        self._guard.check(request.fencing_token)
        downloaded = await engine.adapters.prefetch(request.name, request.source, request.sha256)
        return pb.PrefetchAdapterResponse(downloaded=downloaded)

    async def GetState(self, request: pb.GetStateRequest, context) -> pb.PodState:
        return pod_state(self._handle.get(), self._pod_id, self._base_model, with_prefixes=True)


def residency_pb(r: Residency) -> pb.AdapterResidency:
    return pb.AdapterResidency(name=r.name, tier=_TIER[r.tier], pinned=r.pinned, rank=r.rank, sha256=r.sha256,
                               slot=r.slot)


def _tier_usage_pb(u: TierUsage) -> pb.TierUsage:
    return pb.TierUsage(capacity=u.capacity, used=u.used, pinned=u.pinned, busy=u.busy)


def pod_state(engine: Engine, pod_id: str, base_model: str, with_prefixes: bool = False) -> pb.PodState:
    """The pod's state as GetState answers it (``with_prefixes``: the routing prefixes and the disk tier's copies
    it holds, for routers) and heartbeats report it."""
    s = engine.snapshot()
    downloads = engine.lora.downloads
    times = engine.lora.load_times.now()
    return pb.PodState(
        slots=_tier_usage_pb(s.slots), cpu_cache=_tier_usage_pb(s.cpu), adapters=[residency_pb(r) for r in s.adapters],
        running_requests=s.running, waiting_requests=s.waiting, kv_cache_usage=s.kv_usage,
        pod_id=pod_id, base_model=base_model, precision=engine.precision, max_num_seqs=engine.limits.max_num_seqs,
        prefix_hashes=engine.routing_prefixes() if with_prefixes else (),
        row_rule=engine.model.row_rule.describe() if engine.model.row_rule is not None else "",
        disk=None if s.disk is None else pb.DiskTierUsage(capacity_bytes=s.disk.capacity_bytes,
                                                           used_bytes=s.disk.used_bytes, entries=s.disk.entries),
        disk_digests=[disk_key(d) for d in downloads.tier.digests(DISK_REPORT)]
        if with_prefixes and downloads is not None else (),
        load_times=pb.LoadTimes(host_to_slot_seconds=times.host_to_slot_s, disk_to_host_seconds=times.disk_to_host_s,
                                remote_to_disk_seconds=times.remote_to_disk_s,
                                remote_megabytes_per_second=times.remote_mb_per_s),
    )

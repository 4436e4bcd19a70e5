"""PodMembership servicer: pods heartbeat and resolve adapter names here."""

from __future__ import annotations

from lorafleet.v1 import data_plane_admin_pb2 as dpa
from lorafleet.v1 import membership_pb2 as pb
from lorafleet.v1 import membership_pb2_grpc as pb_grpc

from control_plane.fleet import Fleet
from control_plane.records import PodRecord, Residency
from control_plane.registry import Registry


class PodMembershipService(pb_grpc.PodMembershipServicer):
    def __init__(self, fleet: Fleet, registry: Registry) -> None:
        self._fleet = fleet
        self._registry = registry

    async def Heartbeat(self, request, context):
        token = await self._fleet.heartbeat(pod_record(request))
        return pb.HeartbeatResponse(lease_ttl_seconds=self._fleet.lease_ttl_s, fencing_token=token)

    async def ResolveAdapter(self, request, context):
        rec = await self._registry.resolve(request.name)
        return pb.ResolveAdapterResponse(name=rec.name, source=rec.source, sha256=rec.sha256)


def pod_record(request: pb.HeartbeatRequest) -> PodRecord:
    """The pod as its heartbeat describes it (last_heartbeat is stamped by the fleet)."""
    s = request.state
    residents = tuple(Residency(name=a.name, pinned=a.pinned, rank=a.rank, sha256=a.sha256,
                                on_device=a.tier == dpa.GPU) for a in s.adapters)
    return PodRecord(id=request.pod_id, endpoint=request.endpoint, base_model=request.base_model or s.base_model,
                     reported_ready=request.ready, slots_total=s.slots.capacity, slots_used=s.slots.used,
                     slots_pinned=s.slots.pinned, cpu_cache_capacity=s.cpu_cache.capacity,
                     cpu_cache_used=s.cpu_cache.used, cpu_cache_pinned=s.cpu_cache.pinned,
                     running_requests=s.running_requests, waiting_requests=s.waiting_requests, residents=residents,
                     kv_usage=s.kv_cache_usage, precision=s.precision,
                     demand=tuple((r.adapter, r.requests_per_second) for r in request.demand.rates),
                     disk_capacity_bytes=s.disk.capacity_bytes, disk_used_bytes=s.disk.used_bytes,
                     disk_entries=s.disk.entries)

"""AdapterAdmin servicer: proto in, one registry call, proto out."""

from __future__ import annotations

from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc

from control_plane.fleet import PodView
from control_plane.registry import AdapterView, PlacementView, Registry


class AdapterAdminService(pb_grpc.AdapterAdminServicer):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def RegisterAdapter(self, request, context):
        return adapter_pb(await self._registry.register(request.name, request.source, request.sha256,
                                                        request.base_model))

    async def UnregisterAdapter(self, request, context):
        await self._registry.unregister(request.name, request.expected_version)
        return pb.UnregisterAdapterResponse()

    async def PinAdapter(self, request, context):
        return adapter_pb(await self._registry.pin(request.name, request.replicas, request.expected_version))

    async def UnpinAdapter(self, request, context):
        return adapter_pb(await self._registry.unpin(request.name, request.expected_version))

    async def GetAdapter(self, request, context):
        return adapter_pb(await self._registry.get(request.name))

    async def ListAdapters(self, request, context):
        views, token = await self._registry.list_adapters(request.page_size, request.page_token)
        return pb.ListAdaptersResponse(adapters=[adapter_pb(v) for v in views], next_page_token=token)

    async def ListPods(self, request, context):
        return pb.ListPodsResponse(pods=[pod_pb(v) for v in await self._registry.pods()])

    async def Route(self, request, context):
        return pb.RouteResponse(placements=[placement_pb(p) for p in await self._registry.route(request.adapter)])


def placement_pb(p: PlacementView) -> pb.Placement:
    return pb.Placement(pod=p.pod, state=p.state.value, error=p.error, pinned=p.pinned, endpoint=p.endpoint)


def adapter_pb(v: AdapterView) -> pb.Adapter:
    r = v.record
    return pb.Adapter(name=r.name, source=r.source, sha256=r.sha256, base_model=r.base_model, rank=v.rank,
                      pinned=r.pinned, pin_replicas=r.pin_replicas, version=r.version,
                      placements=[placement_pb(p) for p in v.placements], pin_status=v.pin_status)


def pod_pb(v: PodView) -> pb.Pod:
    p = v.pod
    return pb.Pod(id=p.id, endpoint=p.endpoint, ready=v.ready, slots_total=p.slots_total, slots_used=p.slots_used,
                  slots_pinned=p.slots_pinned, cpu_cache_capacity=p.cpu_cache_capacity,
                  cpu_cache_used=p.cpu_cache_used, adapters=[r.name for r in p.residents],
                  pinned_adapters=[r.name for r in p.residents if r.pinned], last_heartbeat=p.last_heartbeat,
                  base_model=p.base_model, running_requests=p.running_requests,
                  waiting_requests=p.waiting_requests, precision=p.precision)

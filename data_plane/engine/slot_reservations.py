"""Slot reservations: whether a flow's next request can start as far as its adapter goes, and the bound
on waiting for an adapter slot.

A flow whose adapter is still loading, or cannot get a slot (every slot pinned or serving), is passed
over for the step: requests of the base model and of adapters in slots go ahead of it. A flow that
cannot get a slot reserves the unpinned adapter in a slot with the fewest running requests; that adapter
admits nothing new until the waiting flow holds a slot, so its running requests finish (bounded by their
max_tokens), its slot becomes evictable, and the waiting flow takes it. A request that can never get a
slot, because every slot holds another pinned adapter, is refused (``refusal``) instead of waiting for
ever.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping

from data_plane.engine.fair_share import Flow
from data_plane.engine.sequence import Sequence
from data_plane.errors import CapacityExceeded
from data_plane.lora.adapter_cache import AdapterCache


class SlotReservations:
    def __init__(self, cache: AdapterCache | None, adapter_ready: Callable[[str], bool]) -> None:
        """``adapter_ready``: False while the adapter is still being loaded."""
        self.cache = cache
        self._ready = adapter_ready
        self._reserved: dict[str, str] = {}  # adapter waiting for a slot -> adapter it waits to take it from

    def refusal(self, flow: Flow) -> CapacityExceeded | None:
        """The error a request of ``flow`` ends with because it can never run here (every slot holds another
        pinned adapter), else None."""
        if flow is None or self.cache is None or not self.cache.pinned_out(flow):
            return None
        return CapacityExceeded(
            f"adapter {flow!r} cannot run on this pod: all {self.cache.max_loras} adapter slots hold pinned "
            "adapters; unpin one or raise --max-loras, or send the request to a pod that serves it"
        )

    def refused(self, queues: Mapping[Flow, Iterable[Sequence]]) -> list[tuple[Sequence, CapacityExceeded]]:
        """The requests of ``queues`` (each flow's waiting ones) that can never run, with their errors."""
        return [(seq, error) for flow, queue in queues.items() if (error := self.refusal(flow)) is not None
                for seq in queue]

    def ready(self, flow: Flow) -> bool:
        """Whether ``flow``'s adapter is loaded (the base model always is)."""
        return flow is None or self._ready(flow)

    def can_run_now(self, flow: Flow) -> bool:
        """Whether ``flow``'s next request could start this step as far as its adapter goes (no side effects)."""
        return flow is None or (self._ready(flow) and flow not in self._reserved.values()
                                and self.cache.can_acquire(flow))

    def can_run(self, flow: Flow, running: Iterable[Flow]) -> bool:
        """``can_run_now``; a flow that is only short of a slot reserves one from the unpinned adapter in a
        slot with the fewest running requests (``running``: the flow of each)."""
        if flow is None:
            return True
        if not self._ready(flow) or flow in self._reserved.values():
            return False
        if self.cache.can_acquire(flow):
            return True
        if flow not in self._reserved:
            taken = set(self._reserved.values())
            candidates = [name for name in self.cache.unpinned_in_slots() if name not in taken]
            if candidates:
                counts = Counter(running)
                self._reserved[flow] = min(candidates, key=lambda name: counts[name])
        return False

    def acquire(self, flow: str) -> int:
        """``flow``'s adapter slot for one more running request; its reservation, if any, is fulfilled."""
        slot = self.cache.acquire(flow)
        self._reserved.pop(flow, None)
        return slot

    def forget_stale(self, waiting: Collection[Flow]) -> None:
        """Drops reservations whose flow no longer waits (``waiting``), holds a slot, or whose victim left
        its slot or was pinned."""
        for flow, victim in list(self._reserved.items()):
            if (flow not in waiting or self.cache.slot_of(flow) is not None
                    or self.cache.slot_of(victim) is None or self.cache.is_pinned(victim)):
                del self._reserved[flow]

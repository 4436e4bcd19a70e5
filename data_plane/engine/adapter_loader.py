"""``AdapterLoader``: brings adapters into this pod's caches and takes them out again.

A load resolves the adapter's name to its source (unless the caller gives one), reads and
validates the files in a worker thread, and inserts the adapter into the CPU tier under the model
lock, so neither the event loop nor the step loop waits for the files: a request whose adapter is
loading waits while the batch keeps running. At most one load per name is in flight; every caller
of that name shares it. Unload, pin and unpin take the model lock like every other cache change:
unload clears a slot and pin may fill one, and a forward pass reads the slots.

Each load's outcome is recorded here and only here, once: its latency by outcome, and a failure
in ``failed_loads`` (a failed load never reaches the cache, whose own counters tally what enters
and leaves its tiers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from data_plane.errors import LorafleetError
from data_plane.lora.adapter_cache import Residency
from data_plane.lora.runtime import LoraRuntime
from data_plane.lora.sources import check_adapter_name
from data_plane.metrics import PodMetrics

log = logging.getLogger("lorafleet.engine")

# name -> (source, sha256); raises AdapterNotFound for an unknown name.
Resolver = Callable[[str], Awaitable[tuple[str, str]]]
# Told when a load of a name ends: with the domain error it failed with (the requests waiting for that
# adapter end with it), else None.
LoadEnded = Callable[[str, LorafleetError | None], None]


class AdapterLoader:
    def __init__(self, lora: LoraRuntime, resolver: Resolver, metrics: PodMetrics, model_lock: asyncio.Lock,
                 on_end: LoadEnded) -> None:
        self._lora = lora
        self._resolve = resolver
        self._metrics = metrics
        self._model_lock = model_lock
        self._on_end = on_end
        self._loading: dict[str, asyncio.Task[Residency]] = {}
        self._reloading: set[str] = set()
        self.failed_loads = 0

    def is_resident(self, name: str) -> bool:
        """True once ``name`` is in the CPU tier (a request for it can then be scheduled)."""
        return name in self._lora.cache

    # ---- loads -----------------------------------------------------------------------------
    async def ensure(self, name: str) -> None:
        """Makes ``name`` resident or loading, without waiting for the load. Its source is resolved
        first, so an unknown name raises here (AdapterNotFound) before the caller queues anything;
        a load that fails later is reported to ``on_end``. On a pod without LoRA raises LoraDisabled."""
        self._lora.require(name)
        check_adapter_name(name)  # a name no request could use must not reach a resolver or take a cache entry
        if self._resident_or_loading(name):
            return
        source, sha256 = await self._resolve(name)
        if not self._resident_or_loading(name):  # another request may have started it while this one resolved
            self._start(name, source, sha256)

    async def load(self, name: str, source: str, sha256: str = "") -> Residency:
        """Reads, validates and caches an adapter (admin Load); idempotent for the same weights.
        A load of ``name`` already in flight is joined instead of started again."""
        self._lora.require(name)
        task = self._loading.get(name)
        if task is None:
            check_adapter_name(name)
            task = self._start(name, source, sha256)
        return await asyncio.shield(task)

    async def prefetch(self, name: str, source: str, sha256: str) -> bool:
        """Downloads ``name``'s remote source into the disk tier, in a worker thread, without loading
        it (the control plane asks this ahead of demand); whether it downloaded."""
        self._lora.require(name)
        check_adapter_name(name)
        return await asyncio.to_thread(self._lora.prefetch, name, source, sha256)

    def reload_missing(self, names: Iterable[str]) -> None:
        """Loads again, in the background, each of ``names`` that is neither resident nor loading:
        adapters that requests still wait for but that the full CPU tier evicted meanwhile."""
        for name in dict.fromkeys(names):
            if name not in self._reloading and not self._resident_or_loading(name):
                self._reloading.add(name)  # one background resolve per name, however often the loop asks
                asyncio.get_running_loop().create_task(self._reload(name))

    async def _reload(self, name: str) -> None:
        try:
            await self.ensure(name)
        except LorafleetError as e:
            self._on_end(name, e)
        finally:
            self._reloading.discard(name)

    def _resident_or_loading(self, name: str) -> bool:
        return name in self._lora.cache or name in self._loading

    def _start(self, name: str, source: str, sha256: str) -> asyncio.Task[Residency]:
        task = asyncio.get_running_loop().create_task(self._load(name, source, sha256))
        # A load that a request started has no awaiter: _load records, logs and reports its failure,
        # so retrieving the exception here keeps asyncio from logging it again as never retrieved.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._loading[name] = task
        return task

    async def _load(self, name: str, source: str, sha256: str) -> Residency:
        start = time.monotonic()
        error: LorafleetError | None = None
        try:
            adapter = await asyncio.to_thread(self._lora.read, name, source, sha256)
            # under the model lock: a full CPU tier evicts, and evicting clears the victim's slot
            async with self._model_lock:
                residency = self._lora.cache.insert(adapter)
        except Exception as e:
            self._metrics.load_latency.labels("error").observe(time.monotonic() - start)
            self.failed_loads += 1
            if isinstance(e, LorafleetError):
                error = e
                log.warning("adapter load failed", extra={"adapter": name, "error": str(e)})
            else:
                # Still an outcome the waiting requests get (INTERNAL), so that nothing retries it unasked.
                error = LorafleetError(f"loading adapter {name!r} failed unexpectedly ({type(e).__name__}); "
                                       "see the pod's logs")
                log.exception("adapter load failed", extra={"adapter": name})
            raise
        finally:
            self._loading.pop(name, None)
            self._on_end(name, error)
        seconds = time.monotonic() - start
        self._metrics.load_latency.labels("ok").observe(seconds)
        log.info("adapter loaded", extra={"adapter": name, "rank": adapter.rank, "seconds": seconds})
        return residency

    # ---- admin operations on resident adapters ----------------------------------------------
    async def unload(self, name: str) -> bool:
        """Removes ``name`` from both tiers, dropping its pin; False if it was not resident."""
        async with self._model_lock:
            return self._lora.cache.unload(name)

    async def pin(self, name: str) -> Residency:
        """Holds ``name`` in a slot and in the CPU tier until it is unpinned."""
        async with self._model_lock:
            return self._lora.cache.pin(name)

    async def unpin(self, name: str) -> Residency:
        """Lets ``name`` be evicted again like any other adapter."""
        async with self._model_lock:
            return self._lora.cache.unpin(name)

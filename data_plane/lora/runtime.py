"""The LoRA side of a pod: wrapped layers, the adapter reader, the caches and the per-step metadata."""

from __future__ import annotations

import time
from pathlib import Path

from data_plane.errors import InvalidAdapter, LoraDisabled
from data_plane.lora.adapter_cache import AdapterCache
from data_plane.lora.fetcher import AdapterFetcher, is_remote
from data_plane.lora.layer import projection_shapes, wrap_with_lora
from data_plane.lora.load_times import LoadTimes
from data_plane.lora.peft_adapter import AdapterLimits, LoraAdapter, load_peft_adapter
from data_plane.model.llama import LlamaForCausalLM
from kernels.lora_meta import LoraMeta, LoraMetaBuilder, partial_rows


class LoraRuntime:
    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_cpu_loras: int, max_rank: int,
                 max_tokens: int, adapter_roots: tuple[Path, ...], limits: AdapterLimits | None = None,
                 fetcher: AdapterFetcher | None = None, enabled: bool = True) -> None:
        """``enabled`` False (--no-enable-lora): the model keeps its plain projections, no slot is allocated,
        and every adapter is refused (``require``): a pod of the base model only."""
        self.enabled = enabled
        if not enabled:
            max_loras = max_cpu_loras = 0
        device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.roots = tuple(adapter_roots)
        self.limits = limits or AdapterLimits(max_rank=max_rank)
        if self.limits.max_rank != max_rank:
            raise ValueError("AdapterLimits.max_rank must equal max_rank")
        # Remote sources are downloaded through its disk tier; without one the pod refuses them.
        self.downloads = fetcher
        # What each move between tiers takes here, as measured (the downloads' part kept by the fetcher).
        self.load_times = fetcher.times if fetcher is not None else LoadTimes()
        self.layers = wrap_with_lora(model, max_loras, max_rank) if enabled else {}
        self._shapes = projection_shapes(self.layers)
        self._pin = device.type == "cuda"  # adapters are read into page-locked memory for asynchronous slot copies
        self.cache = AdapterCache(self.layers, max_loras, max_cpu_loras, pin_host_memory=self._pin,
                                  load_times=self.load_times)
        # Built on first use: the engine's steps take their LoRA metadata from the step builder
        # (data_plane.engine.step_inputs); this one serves steps built by hand (tests, benchmarks).
        self._meta: LoraMetaBuilder | None = None
        self._meta_shape = (max_tokens, max_loras, device, max_rank)
        # The split shrink's scratch (kernels.lora_shrink), on a GPU only: the CPU path never splits.
        self.partial_rows = partial_rows([(len(slices), in_features) for slices in self._shapes.values()
                                          for in_features, _ in list(slices.values())[:1]]) if self._pin else 0

    def require(self, name: str) -> None:
        """Raises LoraDisabled, saying what to do instead, on a pod started without LoRA."""
        if not self.enabled:
            raise LoraDisabled(f"adapter {name!r}: this pod was started with --no-enable-lora and serves the base "
                               "model only; send the request without an adapter, or to a pod started with LoRA "
                               "(--enable-lora, the default)")

    def read(self, name: str, source: str, sha256: str = "") -> LoraAdapter:
        """Reads and validates an adapter from a directory under the adapter roots, or from a remote
        source (http(s)://, s3://, hf://) through the disk tier. Touches no adapter cache, so it may run
        on any thread."""
        if not is_remote(source):
            if self.downloads is not None:
                self.downloads.policy.check(name, source, source)
            return self._read_local(name, source, self.roots, sha256)
        if self.downloads is None:
            raise InvalidAdapter(f"adapter {name!r}: this pod has no download cache (--adapter-cache-dir), "
                                 "so it cannot load remote (http, s3, hf) sources")
        with self.downloads.fetched(name, source, sha256) as adapter_dir:
            # The cached copy is its own root: the same checks as any local directory.
            return self._read_local(name, str(adapter_dir), (adapter_dir,), sha256)

    def _read_local(self, name: str, source: str, roots: tuple[Path, ...], sha256: str) -> LoraAdapter:
        start = time.perf_counter()
        adapter = load_peft_adapter(name, source, roots, sha256, self._shapes, self.limits, self.dtype, self._pin)
        self.load_times.disk_to_host(time.perf_counter() - start)
        return adapter

    def prefetch(self, name: str, source: str, sha256: str) -> bool:
        """Downloads a remote source into the disk tier without loading it; False for a local source
        (nothing to fetch) or a copy already on disk. Touches no adapter cache."""
        if not is_remote(source):
            return False
        if self.downloads is None:
            raise InvalidAdapter(f"adapter {name!r}: this pod has no download cache (--adapter-cache-dir), "
                                 "so it cannot prefetch remote sources")
        return self.downloads.prefetch(name, source, sha256)

    def step_metadata(self, token_slots: list[int]) -> LoraMeta:
        """LoRA metadata for a step built by hand; the engine's steps get theirs from its step builder."""
        if self._meta is None:
            max_tokens, max_loras, device, max_rank = self._meta_shape
            self._meta = LoraMetaBuilder(max_tokens, max_loras, device, max_rank=max_rank,
                                         partial_rows=self.partial_rows)
        return self._meta.build(token_slots)

    def load(self, name: str, source: str, sha256: str = ""):
        """Reads then inserts into the CPU tier on the calling thread, with no lock and no metrics: for
        tests and benchmarks. A pod loads through its engine's AdapterLoader."""
        return self.cache.insert(self.read(name, source, sha256))

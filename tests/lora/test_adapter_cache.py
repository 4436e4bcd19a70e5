"""LRU order in both tiers, pinning, capacity errors."""

from __future__ import annotations

import shutil

import pytest

from data_plane.errors import AdapterBusy, AdapterNotFound, CapacityExceeded
from data_plane.lora.adapter_cache import Tier, TierUsage
from data_plane.lora.runtime import LoraRuntime
from data_plane.model import load_model


@pytest.fixture(scope="module")
def adapter_root(tiny_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    for name in "abcdef":
        shutil.copytree(tiny_adapters / "r8", root / name)
    return root


@pytest.fixture
def rt(tiny_base, adapter_root):
    """2 device slots, 3 CPU entries."""
    return LoraRuntime(load_model(tiny_base[0], "float32"), max_loras=2, max_cpu_loras=3, max_rank=8,
                       max_tokens=32, adapter_roots=(adapter_root,))


def _names(rt, tier=None):
    return [r.name for r in rt.cache.list() if tier is None or r.tier == tier]


def _use(rt, name):
    rt.cache.acquire(name)
    rt.cache.release(name)


def test_cpu_tier_evicts_least_recently_used(rt):
    for n in "abc":
        rt.load(n, n)
    _use(rt, "a")  # a becomes most recent
    rt.load("d", "d")
    assert set(_names(rt)) == {"a", "c", "d"}
    assert rt.cache.stats.evictions[Tier.CPU] == 1


def test_slots_evict_least_recently_used(rt):
    for n in "abc":
        rt.load(n, n)
    _use(rt, "a")
    _use(rt, "b")
    _use(rt, "a")
    _use(rt, "c")  # b was least recently used in a slot
    assert set(_names(rt, Tier.GPU)) == {"a", "c"}
    assert rt.cache.residency("b").tier == Tier.CPU
    assert rt.cache.stats.evictions[Tier.GPU] == 1


def test_list_is_most_recently_used_first(rt):
    for n in "abc":
        rt.load(n, n)
    _use(rt, "a")
    assert _names(rt) == ["a", "c", "b"]


def test_pinned_adapter_is_never_evicted(rt):
    for n in "ab":
        rt.load(n, n)
    rt.cache.pin("a")
    for n in "cdef":
        rt.load(n, n)
        _use(rt, n)
    assert rt.cache.residency("a").tier == Tier.GPU and rt.cache.residency("a").pinned
    assert "b" not in rt.cache


def test_pinning_beyond_capacity_is_an_error_not_an_eviction(rt):
    for n in "abc":
        rt.load(n, n)
    rt.cache.pin("a")
    rt.cache.pin("b")
    with pytest.raises(CapacityExceeded, match="cannot pin 'c': 2 adapters are already pinned"):
        rt.cache.pin("c")
    assert rt.cache.residency("a").pinned and rt.cache.residency("b").pinned
    assert not rt.cache.residency("c").pinned


def test_full_cpu_tier_of_pinned_adapters_refuses_new_loads(tiny_base, adapter_root):
    rt = LoraRuntime(load_model(tiny_base[0], "float32"), max_loras=2, max_cpu_loras=2, max_rank=8,
                     max_tokens=32, adapter_roots=(adapter_root,))
    for n in "ab":
        rt.load(n, n)
        rt.cache.pin(n)
    with pytest.raises(CapacityExceeded, match="all 2 CPU cache entries are pinned or in use"):
        rt.load("c", "c")
    assert _names(rt) == ["b", "a"]


def test_unpin_makes_an_adapter_evictable_again(rt):
    for n in "ab":
        rt.load(n, n)
    rt.cache.pin("a")
    rt.cache.unpin("a")
    _use(rt, "b")
    for n in "cd":
        rt.load(n, n)
    assert "a" not in rt.cache


def test_in_use_adapter_keeps_its_slot(rt):
    for n in "abc":
        rt.load(n, n)
    rt.cache.acquire("a")
    b_slot = rt.cache.acquire("b")
    assert not rt.cache.can_acquire("c")
    with pytest.raises(CapacityExceeded, match="no adapter slot for 'c'"):
        rt.cache.acquire("c")
    rt.cache.release("b")
    assert rt.cache.acquire("c") == b_slot  # the idle one's slot, not the one in use
    assert set(_names(rt, Tier.GPU)) == {"a", "c"}


def test_unload_of_a_busy_adapter_is_refused(rt):
    rt.load("a", "a")
    rt.cache.acquire("a")
    with pytest.raises(AdapterBusy, match="serving 1 requests"):
        rt.cache.unload("a")
    rt.cache.release("a")
    assert rt.cache.unload("a") is True
    assert rt.cache.unload("a") is False


def test_unload_frees_the_slot_and_empties_it(rt):
    rt.load("a", "a")
    slot = rt.cache.acquire("a")
    rt.cache.release("a")
    assert all(layer.ranks[:, slot].all() for layer in rt.layers.values())
    rt.cache.unload("a")
    for layer in rt.layers.values():  # rank 0: the kernels read none of the slot's bytes
        assert not layer.ranks[:, slot].any() and all(ranks[slot] == 0 for ranks in layer.host_ranks)
    assert rt.cache.slot_usage().used == 0


def test_pin_of_an_unknown_adapter(rt):
    with pytest.raises(AdapterNotFound, match="'zzz' is not loaded on this pod"):
        rt.cache.pin("zzz")


def test_usage_counts(rt):
    for n in "abc":
        rt.load(n, n)
    rt.cache.pin("a")
    _use(rt, "b")
    assert rt.cache.slot_usage() == TierUsage(capacity=2, used=2, pinned=1, busy=1)  # a pinned; b idle
    rt.cache.acquire("b")  # serving: its slot cannot be given to another adapter now
    assert rt.cache.slot_usage().busy == 2
    rt.cache.release("b")
    assert rt.cache.cpu_usage() == TierUsage(capacity=3, used=3, pinned=1)

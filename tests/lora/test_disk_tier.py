"""The disk tier: content-addressed copies under a byte bound, least recently used evicted first but
never one being read, kept across a restart in their recency order, unfinished downloads removed."""

from __future__ import annotations

import os
import time

import pytest

from data_plane.lora.disk_tier import CONFIG_FILE, WEIGHTS_FILE, DiskTier


def _add(tier: DiskTier, digest: str, size: int) -> None:
    staging = tier.new_staging()
    (staging / CONFIG_FILE).write_text("{}")
    (staging / WEIGHTS_FILE).write_bytes(b"\0" * size)
    tier.install(staging, digest, {"source": f"s3://b/{digest[:4]}", "resolved": ""})
    tier.release(digest)


def _digest(c: str) -> str:
    return c * 64


def _size(tier: DiskTier, digest: str) -> int:
    return sum(f.stat().st_size for f in (tier.root / digest).iterdir())


def test_the_least_recently_used_copy_goes_first_when_the_bound_is_reached(tmp_path):
    probe = DiskTier(tmp_path / "probe", 1 << 20)
    _add(probe, _digest("f"), 1000)
    entry = _size(probe, _digest("f"))  # weights, config and source.json
    tier = DiskTier(tmp_path / "disk", 2 * entry)
    _add(tier, _digest("a"), 1000)
    _add(tier, _digest("b"), 1000)
    assert tier.lookup(_digest("a")) is not None  # a is now the more recently used
    tier.release(_digest("a"))
    _add(tier, _digest("c"), 1000)
    assert sorted(os.listdir(tier.root)) == [_digest("a"), _digest("c")]
    usage = tier.usage()
    assert (usage.entries, usage.used_bytes, usage.hits, usage.evictions) == (2, 2 * entry, 1, 1)
    assert tier.lookup(_digest("b")) is None


def test_a_copy_being_read_is_not_evicted_until_released(tmp_path):
    tier = DiskTier(tmp_path, 1)  # smaller than any copy
    staging = tier.new_staging()
    (staging / CONFIG_FILE).write_text("{}")
    (staging / WEIGHTS_FILE).write_bytes(b"x" * 100)
    path = tier.install(staging, _digest("a"), {"source": "hf://o/r", "resolved": "commit 1"})
    assert (path / WEIGHTS_FILE).read_bytes() == b"x" * 100  # held: still there while it is read
    tier.release(_digest("a"))
    assert not path.exists() and tier.usage().entries == 0


def test_a_restarted_tier_finds_its_copies_in_recency_order_and_drops_unfinished_downloads(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    for c in "abc":
        _add(tier, _digest(c), 10)
    now = time.time()
    for age, c in ((30, "a"), (10, "b"), (20, "c")):  # b most recent, then c, then a
        os.utime(tmp_path / _digest(c), (now - age, now - age))
    tier.new_staging()  # a download the crash interrupted
    (tmp_path / ("d" * 32)).mkdir()  # an earlier version's per-URL directory
    (tmp_path / "operator-notes").mkdir()  # not ours: left alone
    entry = _size(tier, _digest("a"))
    restarted = DiskTier(tmp_path, 2 * entry)  # room for two: the least recent, a, goes
    assert sorted(os.listdir(tmp_path)) == [_digest("b"), _digest("c"), "operator-notes"]
    assert restarted.usage().entries == 2 and restarted.lookup(_digest("b")) is not None


def test_an_incomplete_copy_is_not_served(tmp_path):
    (tmp_path / _digest("a")).mkdir()
    (tmp_path / _digest("a") / WEIGHTS_FILE).write_bytes(b"x")  # no config: a copy cut short by hand
    assert DiskTier(tmp_path, 1 << 20).lookup(_digest("a")) is None


def test_a_negative_bound_is_refused(tmp_path):
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        DiskTier(tmp_path, -1)

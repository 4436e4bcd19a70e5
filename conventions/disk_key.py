"""How a pod names an adapter copy on its disk tier to routers (PodState.disk_digests), so that the router can
match it against the registered adapters: the first 8 bytes of the sha256 of its weights, big-endian. At fleet
sizes (thousands of adapters) two adapters sharing 8 bytes of a sha256 is a chance of about 10^-12."""

from __future__ import annotations

import re

_HEX = re.compile(r"[0-9a-fA-F]{16}")


def disk_key(sha256: str) -> int:
    """The key of the weights whose sha256 (hex) is ``sha256``; ValueError for one that is not hex."""
    if not _HEX.fullmatch(sha256[:16]):
        raise ValueError(f"a sha256 has 64 hex digits, got {sha256!r}")
    return int(sha256[:16], 16)

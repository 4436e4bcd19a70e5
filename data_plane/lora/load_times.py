"""How long this pod takes to bring an adapter up from each storage tier, as it measured its own loads.

Three moves make up a load, from the slowest tier: a remote source into the disk tier (download and digest
check), a local copy into host memory (read, validate, convert: the disk tier's copy or a directory under
the adapter roots), host memory into a device slot (the slot copy). Each is a decayed average of the pod's
own loads, so that it follows the pod's disk, network and device as they are; a move not measured yet is
0. Pods report them (PodState.load_times) and the router turns them into the cost of sending a request to
a pod that does not hold its adapter in a slot (router/scoring.py). Safe to record from several threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# The weight of a new measurement: about the last ten loads of each kind count.
DECAY = 0.2


@dataclass(frozen=True)
class LoadTimesNow:
    """Seconds per load from each tier (0: not measured yet) and the download rate."""

    host_to_slot_s: float = 0.0
    disk_to_host_s: float = 0.0
    remote_to_disk_s: float = 0.0
    remote_mb_per_s: float = 0.0  # downloads' megabytes (10^6 bytes) per second


class LoadTimes:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._now = LoadTimesNow()

    def host_to_slot(self, seconds: float) -> None:
        self._record("host_to_slot_s", seconds)

    def disk_to_host(self, seconds: float) -> None:
        self._record("disk_to_host_s", seconds)

    def remote_to_disk(self, seconds: float, size_bytes: int) -> None:
        self._record("remote_to_disk_s", seconds)
        if seconds > 0 and size_bytes > 0:
            self._record("remote_mb_per_s", size_bytes / 1e6 / seconds)

    def now(self) -> LoadTimesNow:
        with self._guard:
            return self._now

    def _record(self, name: str, value: float) -> None:
        if not value >= 0:  # NaN or a clock that went back: nothing measured
            return
        with self._guard:
            old = getattr(self._now, name)
            new = value if old == 0 else (1 - DECAY) * old + DECAY * value
            self._now = LoadTimesNow(**{**vars(self._now), name: new})

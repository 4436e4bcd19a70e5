"""The gRPC health services a lorafleet server reports, and what each promises.

Readiness is the overall status (service ``""``) and the status of each served service: SERVING
while the process can do its work now. Liveness is the service ``LIVENESS``: SERVING while the
process is not wedged, whatever it depends on, so that a probe on it restarts only a process that
a restart can help (a Redis outage, a model still loading or a drain is no reason to restart).
"""

from __future__ import annotations

LIVENESS = "lorafleet.liveness"

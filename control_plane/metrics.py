"""Every Prometheus metric of the control-plane process, in one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class ControlPlaneMetrics:
    """Metrics recorded at RPC and reconciliation boundaries. Each server owns its registry,
    so that several servers (tests, replicas in one process) never collide."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rpcs = Counter("lorafleet_control_plane_rpcs", "RPCs served, by method and status code",
                            ["method", "code"], registry=r)
        self.rpc_seconds = Histogram("lorafleet_control_plane_rpc_duration_seconds", "RPC handling time",
                                     ["method"], registry=r)
        self.redis_up = Gauge("lorafleet_control_plane_redis_up", "1 while Redis answers pings", registry=r)
        self.leader = Gauge("lorafleet_control_plane_leader", "1 while this replica holds the reconciler lease",
                            registry=r)
        self.fencing_token = Gauge("lorafleet_control_plane_fencing_token",
                                   "fencing token of this replica's current lease (0 when not leader)", registry=r)
        self.adapters = Gauge("lorafleet_control_plane_adapters_registered", "registered adapters", registry=r)
        self.adapters_pinned = Gauge("lorafleet_control_plane_adapters_pinned", "pinned adapters", registry=r)
        self.pins_unsatisfied = Gauge("lorafleet_control_plane_pins_unsatisfied",
                                      "pinned adapters placed on fewer pods than requested", registry=r)
        self.pods = Gauge("lorafleet_control_plane_pods", "pods within lease plus grace, by readiness",
                          ["ready"], registry=r)
        self.pods_removed = Counter("lorafleet_control_plane_pods_removed",
                                    "pods removed from the fleet, by why: lease (silent past lease and grace), "
                                    "refused (silent, and its port refused a health check) or silent (silent past "
                                    "--pod-lost-after, and no answer to a health check)", ["reason"], registry=r)
        for reason in ("lease", "refused", "silent"):
            self.pods_removed.labels(reason)
        self.pod_probes = Counter("lorafleet_control_plane_pod_probes",
                                  "health checks of pods silent past --pod-probe-after, by outcome "
                                  "(answered, silent, refused)", ["outcome"], registry=r)
        self.pod_commands = Counter("lorafleet_control_plane_pod_commands",
                                    "DataPlaneAdmin commands sent, by command and outcome",
                                    ["command", "outcome"], registry=r)
        self.replica_changes = Counter("lorafleet_control_plane_replica_changes",
                                       "extra replicas of hot adapters, by change: added (pre-loaded on a pod) "
                                       "or released (unloaded once cold)", ["change"], registry=r)
        for change in ("added", "released"):
            self.replica_changes.labels(change)
        self.adapters_replicated = Gauge("lorafleet_control_plane_adapters_replicated",
                                         "adapters whose demand keeps them on more pods than their pin",
                                         registry=r)
        self.reconcile_seconds = Histogram("lorafleet_control_plane_reconcile_duration_seconds",
                                           "time of one reconciliation pass", registry=r)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        """Counts one finished RPC (the error interceptor calls this for every call)."""
        self.rpcs.labels(method, code).inc()
        self.rpc_seconds.labels(method).observe(seconds)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serves /metrics over HTTP on ``port`` in a background thread."""
        start_http_server(port, addr=host, registry=self.registry)

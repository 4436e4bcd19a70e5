"""The control plane's one configuration object, and the command line that builds it."""

from __future__ import annotations

import argparse
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from control_plane.errors import ConfigError
from control_plane.replication import Policy
from conventions import defaults
from conventions.auth import Role, read_token
from conventions.flag_help import DefaultsShown
from conventions.tls import TlsFiles

_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # safe inside Redis keys and the lease value


@dataclass(frozen=True)
class ControlPlaneConfig:
    """Everything one control-plane replica needs; validated on construction."""

    redis_url: str
    admin_token_file: Path  # the registry's writers (lorafleet adapters ...); they may read too
    reader_token_file: Path | None = None  # readers (routers, dashboards): Get/List/Route only; None = none
    pod_token_file: Path | None = None  # between the control plane and its pods, both ways; None = the admin token
    host: str = defaults.HOST
    port: int = defaults.CONTROL_PLANE_PORT
    metrics_port: int = defaults.CONTROL_PLANE_METRICS_PORT  # 0 disables the /metrics endpoint
    health_port: int = 0  # a plaintext port with only grpc.health.v1, for probes that cannot do TLS; 0 = none
    key_prefix: str = "lorafleet"
    base_model: str = ""  # empty accepts any base model named at registration
    tls_cert_file: Path | None = None  # served with, and shown to pods when dialing them over TLS
    tls_key_file: Path | None = None
    tls_ca_file: Path | None = None  # CA of the fleet's certificates: clients must show one; pods are dialed over TLS
    replica_id: str = ""  # empty: hostname-pid
    pod_lease_ttl_s: float = 10.0
    pod_grace_s: float = 20.0
    # A pod silent this long is probed (a gRPC health check): a refused connection removes it at
    # once; no answer within pod_probe_timeout_s removes it once it has been silent pod_lost_after_s;
    # any answer leaves it to its lease and grace. 0 disables probes. A pod's heartbeats and health
    # service run on its event loop, which its engine's steps never block (they run on the model
    # thread), so a pod that is only slow keeps beating every second and answers at once: only one
    # that does not run (stopped, its node lost) or cannot be reached is silent to both.
    pod_probe_after_s: float = 3.0
    pod_probe_timeout_s: float = 1.0
    pod_lost_after_s: float = 4.0  # 0: a silent pod that does not answer is left to its lease and grace
    leader_lease_ttl_s: float = 10.0
    reconcile_interval_s: float = 2.0
    command_timeout_s: float = 30.0
    max_load_attempts: int = 3
    retry_backoff_s: float = 1.0
    # Slots each pod keeps free of pins, so that unpinned (on-demand) adapters still run.
    reserved_unpinned_slots: int = 1
    event_stream_maxlen: int = 10_000
    # Replicas that follow popularity (control_plane/replication.py), in requests/s per replica; a high
    # rate of 0 turns replication off.
    replica_high_rate: float = 5.0
    replica_low_rate: float = 1.0
    replica_hold_s: float = 120.0
    max_replicas: int = 0  # 0 = up to every ready pod

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"--redis-url {self.redis_url!r} must start with redis://, rediss:// or unix://")
        for name in ("port", "metrics_port", "health_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"{name} {value} is not a TCP port; use 0-65535")
        if not _ID_RE.match(self.key_prefix):
            raise ConfigError(f"--key-prefix {self.key_prefix!r} must be 1-64 characters of [A-Za-z0-9._-]")
        if self.replica_id and not _ID_RE.match(self.replica_id):
            raise ConfigError(f"--replica-id {self.replica_id!r} must be 1-64 characters of [A-Za-z0-9._-]")
        for path in (self.admin_token_file, self.reader_token_file, self.pod_token_file):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{path} is not a readable file; check the path given on the command line")
        if self.tls_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError("--tls-ca needs --tls-cert and --tls-key: a control plane that asks its clients for "
                              "certificates serves TLS itself, and shows its certificate to the pods it dials")
        self.tls_files()  # refuses a missing, unreadable or mismatched file now
        for name in ("pod_lease_ttl_s", "leader_lease_ttl_s", "reconcile_interval_s", "command_timeout_s",
                     "retry_backoff_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.pod_grace_s < 0:
            raise ConfigError(f"pod_grace_s must not be negative, got {self.pod_grace_s}")
        if not self.pod_probe_after_s >= 0:
            raise ConfigError(f"pod_probe_after_s must be 0 (no probes) or positive, got {self.pod_probe_after_s}")
        if not self.pod_probe_timeout_s > 0:
            raise ConfigError(f"pod_probe_timeout_s must be positive, got {self.pod_probe_timeout_s}")
        if not self.pod_lost_after_s >= 0:
            raise ConfigError(f"--pod-lost-after must be 0 (silent pods wait for lease and grace) or positive, "
                              f"got {self.pod_lost_after_s}")
        if self.pod_lost_after_s and self.pod_probe_after_s and self.pod_lost_after_s < self.pod_probe_after_s:
            raise ConfigError(f"--pod-lost-after ({self.pod_lost_after_s}) must be at least --pod-probe-after "
                              f"({self.pod_probe_after_s}): a pod is judged lost only by a probe")
        if self.max_load_attempts < 1:
            raise ConfigError(f"max_load_attempts must be at least 1, got {self.max_load_attempts}")
        if self.reserved_unpinned_slots < 0:
            raise ConfigError(f"reserved_unpinned_slots must not be negative, got {self.reserved_unpinned_slots}")
        if self.event_stream_maxlen < 1:
            raise ConfigError(f"event_stream_maxlen must be at least 1, got {self.event_stream_maxlen}")
        if self.replica_high_rate < 0:
            raise ConfigError(f"--replica-high-rate must be >= 0 (0 turns replication off), "
                              f"got {self.replica_high_rate}")
        self.replica_policy()  # refuses a policy without a working hysteresis band now

    def replica_policy(self) -> Policy | None:
        """The replica decision's thresholds, or None when replication is off (--replica-high-rate 0)."""
        if self.replica_high_rate == 0:
            return None
        return Policy(self.replica_high_rate, self.replica_low_rate, self.replica_hold_s, self.max_replicas)

    def role_tokens(self) -> dict[Role, str]:
        """Each role's token, read from its file now."""
        admin = read_token(self.admin_token_file)
        tokens = {Role.ADMIN: admin, Role.POD: read_token(self.pod_token_file) if self.pod_token_file else admin}
        if self.reader_token_file is not None:
            tokens[Role.READER] = read_token(self.reader_token_file)
        return tokens

    @property
    def replica(self) -> str:
        """This replica's identity in the leader lease: replica_id, or hostname-pid."""
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"

    def tls_files(self) -> TlsFiles:
        """--tls-cert, --tls-key and --tls-ca, each read and checked."""
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)


def build_parser() -> argparse.ArgumentParser:
    d = ControlPlaneConfig
    p = argparse.ArgumentParser(prog="lorafleet control-plane", formatter_class=DefaultsShown,
                                description="Adapter registry, placement and reconciliation for a lorafleet fleet.")
    p.add_argument("--redis-url", required=True, help="Redis holding the registry, e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--host", default=d.host, help=f"address to serve gRPC on (default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"gRPC port (default {d.port})")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help=f"Prometheus /metrics port; 0 disables it (default {d.metrics_port})")
    p.add_argument("--health-port", type=int, default=d.health_port,
                   help="a plaintext gRPC port serving only the health service, for probes that cannot speak TLS "
                        f"(Kubernetes' gRPC probes) beside --tls-cert; 0 = none (default {d.health_port})")
    p.add_argument("--admin-token-file", type=Path, required=True,
                   help="file holding the bearer token of admin tools: register, pin, unpin, unregister and reads")
    p.add_argument("--reader-token-file", type=Path,
                   help="file holding the readers' token (routers, dashboards): GetAdapter, ListAdapters, ListPods,"
                        " Route only (default: no reader token)")
    p.add_argument("--pod-token-file", type=Path,
                   help="file holding the token between the control plane and its pods: sent to pods' DataPlaneAdmin"
                        " and the only one PodMembership accepts (default: the admin token)")
    p.add_argument("--key-prefix", default=d.key_prefix, help=f"prefix of every Redis key (default {d.key_prefix})")
    p.add_argument("--base-model", default=d.base_model,
                   help="the fleet's base model id; registrations and pods must match it (default: not enforced)")
    p.add_argument("--tls-cert", type=Path,
                   help="PEM certificate chain to serve gRPC over TLS with (with --tls-key); also shown to the pods "
                        "when dialing them with --tls-ca; re-read when it changes (default: plaintext)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert (default: none)")
    p.add_argument("--tls-ca", type=Path,
                   help="PEM CA of the fleet's component certificates, for mutual TLS: every client (routers, pods, "
                        "admin tools) must show a certificate it signed, and pods are dialed over TLS and verified "
                        "against it; needs --tls-cert (default: clients show no certificate, pods are dialed in "
                        "plaintext)")
    p.add_argument("--replica-id", default="", help="this replica's name in the leader lease (default hostname-pid)")
    p.add_argument("--pod-lease-ttl", type=float, default=d.pod_lease_ttl_s,
                   help=f"seconds a pod heartbeat keeps it READY (default {d.pod_lease_ttl_s})")
    p.add_argument("--pod-grace", type=float, default=d.pod_grace_s,
                   help=f"seconds past its lease before a silent pod is removed (default {d.pod_grace_s})")
    p.add_argument("--pod-probe-after", type=float, default=d.pod_probe_after_s,
                   help="seconds of heartbeat silence after which the leader health-checks a pod; a pod whose "
                        "port refuses the connection is removed at once, one that does not answer once it has "
                        "been silent --pod-lost-after, and one that answers keeps its lease; 0 disables "
                        f"(default {d.pod_probe_after_s})")
    p.add_argument("--pod-probe-timeout", type=float, default=d.pod_probe_timeout_s,
                   help=f"seconds a probe waits for an answer (default {d.pod_probe_timeout_s})")
    p.add_argument("--pod-lost-after", type=float, default=d.pod_lost_after_s,
                   help="seconds of heartbeat silence after which a pod that does not answer a probe is lost "
                        "(stopped, partitioned, its node gone): removed with its placements, its pins placed "
                        "elsewhere in the same pass; at least --pod-probe-after; 0 leaves such pods to their "
                        f"lease and grace (default {d.pod_lost_after_s})")
    p.add_argument("--leader-lease-ttl", type=float, default=d.leader_lease_ttl_s,
                   help=f"seconds the reconciler leader lease lasts without renewal (default {d.leader_lease_ttl_s})")
    p.add_argument("--reconcile-interval", type=float, default=d.reconcile_interval_s,
                   help=f"seconds between reconciliation passes (default {d.reconcile_interval_s})")
    p.add_argument("--max-load-attempts", type=int, default=d.max_load_attempts,
                   help=f"loads of one adapter on one pod before giving up (default {d.max_load_attempts})")
    p.add_argument("--reserved-unpinned-slots", type=int, default=d.reserved_unpinned_slots,
                   help=f"slots per pod kept free of pins (default {d.reserved_unpinned_slots})")
    p.add_argument("--replica-high-rate", type=float, default=d.replica_high_rate,
                   help="requests/s per replica above which an adapter is pre-loaded on more pods, as the pods "
                        f"report them; 0 turns replication off (default {d.replica_high_rate})")
    p.add_argument("--replica-low-rate", type=float, default=d.replica_low_rate,
                   help="requests/s per replica below which, for --replica-hold seconds, an adapter's extra "
                        f"replica is unloaded; below the high rate (default {d.replica_low_rate})")
    p.add_argument("--replica-hold", type=float, default=d.replica_hold_s,
                   help=f"seconds below the low rate before each replica goes (default {d.replica_hold_s})")
    p.add_argument("--max-replicas", type=int, default=d.max_replicas,
                   help=f"most pods one adapter is replicated to; 0 = every ready pod (default {d.max_replicas})")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace) -> ControlPlaneConfig:
    return ControlPlaneConfig(
        redis_url=args.redis_url, admin_token_file=args.admin_token_file, reader_token_file=args.reader_token_file,
        pod_token_file=args.pod_token_file, host=args.host, port=args.port, metrics_port=args.metrics_port,
        health_port=args.health_port, key_prefix=args.key_prefix, base_model=args.base_model,
        tls_cert_file=args.tls_cert, tls_key_file=args.tls_key, tls_ca_file=args.tls_ca, replica_id=args.replica_id,
        pod_lease_ttl_s=args.pod_lease_ttl, pod_grace_s=args.pod_grace,
        pod_probe_after_s=args.pod_probe_after, pod_probe_timeout_s=args.pod_probe_timeout,
        pod_lost_after_s=args.pod_lost_after,
        leader_lease_ttl_s=args.leader_lease_ttl, reconcile_interval_s=args.reconcile_interval,
        max_load_attempts=args.max_load_attempts, reserved_unpinned_slots=args.reserved_unpinned_slots,
        replica_high_rate=args.replica_high_rate, replica_low_rate=args.replica_low_rate,
        replica_hold_s=args.replica_hold, max_replicas=args.max_replicas,
    )

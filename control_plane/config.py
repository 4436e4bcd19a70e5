"""The control plane's one configuration object, and the command line that builds it."""

from __future__ import annotations

import argparse
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from control_plane.errors import ConfigError
from control_plane.prefetch import Prefetch
from control_plane.replication import Policy
from conventions import defaults
from conventions.auth import Role, read_token
from conventions.flag_help import DefaultsShown
from conventions.flags import add_options, flag_name, from_args, option
from conventions.logs import add_log_level
from conventions.tls import TlsFiles

TLS, TOKENS, PODS, REPLICAS, PREFETCH = ("TLS between components", "tokens", "pods' leases and probes",
                                         "replicas that follow popularity", "prefetch by popularity")
_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # safe inside Redis keys and the lease value


@dataclass(frozen=True)
class ControlPlaneConfig:
    """Everything one control-plane replica needs; validated on construction. Each field with ``option`` is the
    flag of its name (conventions/flags.py)."""

    redis_url: str = option("Redis holding the registry, e.g. redis://127.0.0.1:6379/0")
    # the registry's writers (lorafleet adapters ...); they may read too
    admin_token_file: Path = option(
        "file holding the bearer token of admin tools: register, pin, unpin, unregister and reads", group=TOKENS)
    reader_token_file: Path | None = option(
        "file holding the readers' token (routers, dashboards): GetAdapter, ListAdapters, ListPods, Route only"
        " (default: no reader token)", None, group=TOKENS)
    pod_token_file: Path | None = option(
        "file holding the token between the control plane and its pods: sent to pods' DataPlaneAdmin and the only"
        " one PodMembership accepts (default: the admin token)", None, group=TOKENS)
    host: str = option("address to serve gRPC on", defaults.HOST)
    port: int = option("gRPC port", defaults.CONTROL_PLANE_PORT)
    metrics_port: int = option("Prometheus /metrics port; 0 disables it", defaults.CONTROL_PLANE_METRICS_PORT)
    health_port: int = option(
        "a plaintext gRPC port serving only the health service, for probes that cannot speak TLS (Kubernetes' gRPC"
        " probes) beside --tls-cert; 0 = none", 0)
    key_prefix: str = option("prefix of every Redis key", "lorafleet")
    base_model: str = option(
        "the fleet's base model id; registrations and pods must match it (default: not enforced)", "")
    tls_cert: Path | None = option(
        "PEM certificate chain to serve gRPC over TLS with (with --tls-key); also shown to the pods when dialing"
        " them with --tls-ca; re-read when it changes (default: plaintext)", None, group=TLS)
    tls_key: Path | None = option("PEM private key of --tls-cert (default: none)", None, group=TLS)
    tls_ca: Path | None = option(
        "PEM CA of the fleet's component certificates, for mutual TLS: every client (routers, pods, admin tools)"
        " must show a certificate it signed, and pods are dialed over TLS and verified against it; needs"
        " --tls-cert (default: clients show no certificate, pods are dialed in plaintext)", None, group=TLS)
    replica_id: str = option("this replica's name in the leader lease (default: hostname-pid)", "")
    pod_lease_ttl: float = option("seconds a pod heartbeat keeps it READY", 10.0, group=PODS)
    pod_grace: float = option("seconds past its lease before a silent pod is removed", 20.0, group=PODS)
    # A pod silent this long is probed (a gRPC health check): a refused connection removes it at
    # once; no answer within pod_probe_timeout removes it once it has been silent pod_lost_after;
    # any answer leaves it to its lease and grace. 0 disables probes. A pod's heartbeats and health
    # service run on its event loop, which its engine's steps never block (they run on the model
    # thread), so a pod that is only slow keeps beating every second and answers at once: only one
    # that does not run (stopped, its node lost) or cannot be reached is silent to both.
    pod_probe_after: float = option(
        "seconds of heartbeat silence after which the leader health-checks a pod; a pod whose port refuses the"
        " connection is removed at once, one that does not answer once it has been silent --pod-lost-after, and"
        " one that answers keeps its lease; 0 disables probes", 3.0, group=PODS)
    pod_probe_timeout: float = option("seconds a probe waits for an answer", 1.0, group=PODS)
    pod_lost_after: float = option(
        "seconds of heartbeat silence after which a pod that does not answer a probe is lost (stopped,"
        " partitioned, its node gone): removed with its placements, its pins placed elsewhere in the same pass;"
        " at least --pod-probe-after; 0 leaves such pods to their lease and grace", 4.0, group=PODS)
    leader_lease_ttl: float = option("seconds the reconciler leader lease lasts without renewal", 10.0)
    reconcile_interval: float = option("seconds between reconciliation passes", 2.0)
    command_timeout_s: float = 30.0
    max_load_attempts: int = option("loads of one adapter on one pod before giving up", 3)
    retry_backoff_s: float = 1.0
    # Slots each pod keeps free of pins, so that unpinned (on-demand) adapters still run.
    reserved_unpinned_slots: int = option("slots per pod kept free of pins", 1)
    event_stream_maxlen: int = 10_000
    # Replicas that follow popularity (control_plane/replication.py), in requests/s per replica; a high
    # rate of 0 turns replication off.
    replica_high_rate: float = option(
        "requests/s per replica above which an adapter is pre-loaded on more pods, as the pods report them; 0"
        " turns replication off", 5.0, group=REPLICAS)
    replica_low_rate: float = option(
        "requests/s per replica below which, for --replica-hold seconds, an adapter's extra replica is unloaded;"
        " below the high rate", 1.0, group=REPLICAS)
    replica_hold: float = option("seconds below the low rate before each replica goes", 120.0, group=REPLICAS)
    max_replicas: int = option("most pods one adapter is replicated to; 0 = every ready pod", 0, group=REPLICAS)
    # Prefetch by popularity (control_plane/prefetch.py): disk copies of remote adapters whose demand rises.
    prefetch_rate: float = option(
        "fleet-wide requests/s per disk copy: a remote (http, s3, hf) adapter at this rate or more is prefetched to"
        " the disk tiers of ceil(rate / this) pods before its requests reach them; 0 turns it off", 1.0,
        group=PREFETCH)
    prefetch_per_pass: int = option("most prefetches by popularity one reconciliation pass asks of the fleet", 4,
                                    group=PREFETCH)

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"--redis-url {self.redis_url!r} must start with redis://, rediss:// or unix://")
        for name in ("port", "metrics_port", "health_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"{flag_name(name)} {value} is not a TCP port; use 0-65535")
        if not _ID_RE.match(self.key_prefix):
            raise ConfigError(f"--key-prefix {self.key_prefix!r} must be 1-64 characters of [A-Za-z0-9._-]")
        if self.replica_id and not _ID_RE.match(self.replica_id):
            raise ConfigError(f"--replica-id {self.replica_id!r} must be 1-64 characters of [A-Za-z0-9._-]")
        for path in (self.admin_token_file, self.reader_token_file, self.pod_token_file):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{path} is not a readable file; check the path given on the command line")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-ca needs --tls-cert and --tls-key: a control plane that asks its clients for "
                              "certificates serves TLS itself, and shows its certificate to the pods it dials")
        self.tls_files()  # refuses a missing, unreadable or mismatched file now
        for name in ("pod_lease_ttl", "leader_lease_ttl", "reconcile_interval", "command_timeout_s",
                     "retry_backoff_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag_name(name)} must be positive, got {getattr(self, name)}")
        if self.pod_grace < 0:
            raise ConfigError(f"--pod-grace must not be negative, got {self.pod_grace}")
        if not self.pod_probe_after >= 0:
            raise ConfigError(f"--pod-probe-after must be 0 (no probes) or positive, got {self.pod_probe_after}")
        if not self.pod_probe_timeout > 0:
            raise ConfigError(f"--pod-probe-timeout must be positive, got {self.pod_probe_timeout}")
        if not self.pod_lost_after >= 0:
            raise ConfigError(f"--pod-lost-after must be 0 (silent pods wait for lease and grace) or positive, "
                              f"got {self.pod_lost_after}")
        if self.pod_lost_after and self.pod_probe_after and self.pod_lost_after < self.pod_probe_after:
            raise ConfigError(f"--pod-lost-after ({self.pod_lost_after}) must be at least --pod-probe-after "
                              f"({self.pod_probe_after}): a pod is judged lost only by a probe")
        if self.max_load_attempts < 1:
            raise ConfigError(f"--max-load-attempts must be at least 1, got {self.max_load_attempts}")
        if self.reserved_unpinned_slots < 0:
            raise ConfigError(f"--reserved-unpinned-slots must not be negative, got {self.reserved_unpinned_slots}")
        if self.event_stream_maxlen < 1:
            raise ConfigError(f"event_stream_maxlen must be at least 1, got {self.event_stream_maxlen}")
        if self.replica_high_rate < 0:
            raise ConfigError(f"--replica-high-rate must be >= 0 (0 turns replication off), "
                              f"got {self.replica_high_rate}")
        self.replica_policy()  # refuses a policy without a working hysteresis band now
        self.prefetch_policy()

    def replica_policy(self) -> Policy | None:
        """The replica decision's thresholds, or None when replication is off (--replica-high-rate 0)."""
        if self.replica_high_rate == 0:
            return None
        return Policy(self.replica_high_rate, self.replica_low_rate, self.replica_hold, self.max_replicas)

    def prefetch_policy(self) -> Prefetch:
        """When remote adapters are prefetched to pods' disks by their demand (--prefetch-rate 0: never)."""
        return Prefetch(self.prefetch_rate, self.prefetch_per_pass)

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
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafleet control-plane", formatter_class=DefaultsShown,
                                description="Adapter registry, placement and reconciliation for a lorafleet fleet.")
    add_options(p, ControlPlaneConfig)
    add_log_level(p)
    return p


def config_from_args(args: argparse.Namespace) -> ControlPlaneConfig:
    return from_args(ControlPlaneConfig, args)

"""The router's one configuration object, and the command line that builds it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from conventions import defaults
from conventions.errors import ConfigError
from conventions.flag_help import DefaultsShown
from conventions.flags import add_options, from_args, option
from conventions.logs import add_log_level
from conventions.pod_cost import Weights
from conventions.tls import Dialer, TlsFiles, read_certificates
from router.scoring import LOAD_BOUND, SHARE_BOUND

TLS, TOKENS, TENANTS, DOORS = "TLS between components", "tokens", "tenants and keys", "the clients' doors"


def parse_endpoint(value: str, flag: str) -> tuple[str, int]:
    """(host, port) of a ``host:port`` string; ConfigError naming ``flag`` otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{flag} {value!r} must be host:port with a port in 1-65535, e.g. 127.0.0.1:50051")
    return host, int(port)


def parse_api_keys(text: str, source: str) -> frozenset[str]:
    """The keys of an --api-key-file's text: one a line; blank lines and ``#`` comments skipped."""
    keys = frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not keys or any(any(c.isspace() for c in key) for key in keys):
        raise ConfigError(f"--api-key-file {source} must hold one key a line, each without spaces")
    return keys


@dataclass(frozen=True)
class RouterConfig:
    """Everything one router process needs; validated on construction. Each field with ``option`` is the flag
    of its name (conventions/flags.py)."""

    # The token the router reads the registry and pods' state with: the readers' (least privilege), or the
    # admin token of a fleet with one token for everything. Exactly one of the two.
    admin_token_file: Path | None = option(
        "file holding the control plane's one token, on a fleet that has no reader token (instead of"
        " --reader-token-file)", None, group=TOKENS)
    reader_token_file: Path | None = option(
        "file holding the readers' token, to read the registry and pods' state with (it cannot load, pin or unload"
        " anything)", None, group=TOKENS)
    control_plane: str = option("control plane host:port to read the registry and pods from",
                                defaults.CONTROL_PLANE_ENDPOINT)
    control_plane_ca: Path | None = option(
        "PEM CA to dial the control plane over TLS (default: --tls-ca when given, else plaintext)", None, group=TLS)
    # The router's certificate and key, shown to the control plane and the pods it dials over TLS. Its own doors
    # (gRPC and HTTP, the clients') are not served with them.
    tls_cert: Path | None = option(
        "this router's PEM certificate chain (with --tls-key), shown to the control plane and the pods it dials"
        " over TLS; the clients' doors serve --door-tls-cert instead (default: none shown)", None, group=TLS)
    tls_key: Path | None = option("PEM private key of --tls-cert (default: none)", None, group=TLS)
    tls_ca: Path | None = option(
        "PEM CA of the fleet's component certificates: dial the pods (and the control plane, unless"
        " --control-plane-ca) over TLS and verify them against it (default: plaintext)", None, group=TLS)
    # The clients' doors (gRPC Generate and the HTTP API) over TLS: a certificate the clients trust (a public CA's,
    # or the organisation's), apart from the fleet's component certificates above. Renewed files are picked up
    # for new connections.
    door_tls_cert: Path | None = option(
        "PEM certificate chain the clients' doors (gRPC and HTTP) serve TLS with, with --door-tls-key; re-read when"
        " it changes (default: the doors are plaintext: put a TLS-terminating ingress in front)", None, group=DOORS)
    door_tls_key: Path | None = option("PEM private key of --door-tls-cert (default: none)", None, group=DOORS)
    host: str = option("address to serve gRPC, HTTP and metrics on", defaults.HOST)
    port: int = option("gRPC port", defaults.ROUTER_PORT)
    metrics_port: int = option("Prometheus /metrics port; 0 disables it", defaults.ROUTER_METRICS_PORT)
    http_port: int = option("OpenAI-compatible HTTP API port; 0 disables it", defaults.ROUTER_HTTP_PORT)
    health_port: int = option(
        "a plaintext gRPC port serving only the health service, for probes that cannot speak TLS (Kubernetes' gRPC"
        " probes) beside --door-tls-cert; 0 = none", 0, group=DOORS)
    api_key_file: Path | None = option(
        "file of bearer keys the HTTP API accepts, one a line, each for every adapter; the gRPC door stays open"
        " (default: no key asked; --tenants-file guards both doors)", None, group=TENANTS)
    tenants_file: Path | None = option(
        "JSON file of tenants: hashed keys, adapters each may use, limits; guards both the gRPC and the HTTP door,"
        " re-read when it changes (default: no tenants, both doors open)", None, group=TENANTS)
    limits_redis_url: str | None = option(
        "Redis URL where tenants' limits are counted, shared by every router replica (default: none; then tenants"
        " may have no limits)", None, group=TENANTS)
    # seconds: a revoked key's longest life
    keys_reload_interval: float = option("seconds between re-reads of --tenants-file / --api-key-file", 1.0,
                                         group=TENANTS)
    http_timeout: float = option(
        "deadline in seconds of an HTTP request without an X-Request-Timeout header or timeout field", 600.0)
    # Largest HTTP request body: far above any prompt a pod's context holds, small enough to refuse a flood.
    http_max_body_bytes: int = option("largest HTTP request body; larger ones get 413", 4 * 1024 * 1024)
    # Seconds between re-reads of the registry and every pod's state: the staleness bound of routing.
    refresh_interval: float = option("seconds between re-reads of the registry and pod states", 0.5)
    state_timeout: float = option("seconds each state call may take (ListAdapters, ListPods, GetState)", 1.0)
    retries: int = option("other pods tried when one refuses a request before its first message", 2)
    # What a pod holding none of a request's prompt costs more than one holding all of it, in running
    # requests (conventions/pod_cost.py); 0 routes blind to the pods' prefix caches.
    prefix_weight: float = option(
        "what a pod that holds none of a request's prompt in its prefix cache costs more than one that holds all"
        " of it, in running requests; 0 routes blind to prefixes", Weights.prefix)
    # The bounds on load over the cost's ranking (router/scoring.py, ``bounded``), measured in the fleet
    # simulator against the imbalance target and the peers' queue p99 (benchmarks/RESULTS.md, "Fleet simulation:
    # a bound on the share of requests" and "the outstanding bound where a request would wait for a seat").
    load_bound: float = option(
        "how far above the mean of the pods' outstanding requests (a fraction: 0.2 is a fifth more) a pod may go"
        " before a request that would wait there for an adapter slot or a seat goes to the next-best pod instead;"
        " 0: no bound",
        LOAD_BOUND)
    share_bound: float = option(
        "how far above the mean of the requests this router sent the pods lately (decayed over 30 s; a fraction:"
        " 0.1 is a tenth more) a pod may go before requests for an adapter that asks for a fifth of a pod's share"
        " or more go to the next-best pod instead, even one that must load it; 0: no bound", SHARE_BOUND)

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("--host must not be empty; use 127.0.0.1, or 0.0.0.0 to listen on every interface")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port} is not a TCP port; use 1-65535")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port {self.metrics_port} is not a TCP port; use 1-65535, or 0 for none")
        if not 0 <= self.health_port <= 65535:
            raise ConfigError(f"--health-port {self.health_port} is not a TCP port; use 1-65535, or 0 for none")
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"--http-port {self.http_port} is not a TCP port; use 1-65535, or 0 for none")
        if not 1024 <= self.http_max_body_bytes <= 1024 ** 3:
            raise ConfigError(f"--http-max-body-bytes must be within 1 KiB-1 GiB, got {self.http_max_body_bytes}")
        parse_endpoint(self.control_plane, "--control-plane")
        if (self.admin_token_file is None) == (self.reader_token_file is None):
            raise ConfigError("give --reader-token-file (the readers' token; or --admin-token-file on a fleet with one"
                              " token), exactly one")
        for flag, path in (("--admin-token-file", self.admin_token_file),
                           ("--reader-token-file", self.reader_token_file),
                           ("--api-key-file", self.api_key_file), ("--tenants-file", self.tenants_file)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{flag} {path} is not a readable file; check the path")
        if self.tls_cert is not None and self.tls_ca is None and self.control_plane_ca is None:
            raise ConfigError("--tls-cert is shown only to peers dialed over TLS: give --tls-ca (the CA of the "
                              "control plane's and the pods' certificates)")
        self.pod_dialer()  # refuses a missing, unreadable or mismatched TLS file now
        self.doors_tls()
        self.control_plane_dialer()
        if self.api_key_file is not None and self.tenants_file is not None:
            raise ConfigError("give --tenants-file or --api-key-file, not both: a tenants file holds every key")
        if self.limits_redis_url is not None and not self.limits_redis_url.startswith(("redis://", "rediss://",
                                                                                        "unix://")):
            raise ConfigError(f"--limits-redis-url {self.limits_redis_url!r} must be a redis://, rediss:// or"
                              " unix:// URL")
        if not 0.1 <= self.keys_reload_interval <= 300:
            raise ConfigError(f"--keys-reload-interval must be within [0.1, 300] seconds, got"
                              f" {self.keys_reload_interval}")
        if not 0 < self.http_timeout <= 24 * 3600:
            raise ConfigError(f"--http-timeout must be within (0, 86400] seconds, got {self.http_timeout}")
        if not 0 < self.refresh_interval <= 60:
            raise ConfigError(f"--refresh-interval must be within (0, 60] seconds, got {self.refresh_interval}")
        if not 0 < self.state_timeout <= 60:
            raise ConfigError(f"--state-timeout must be within (0, 60] seconds, got {self.state_timeout}")
        if not 0 <= self.retries <= 10:
            raise ConfigError(f"--retries must be within 0-10, got {self.retries}")
        if not 0 <= self.prefix_weight <= 1000:  # NaN too
            raise ConfigError(f"--prefix-weight must be within [0, 1000] running requests, got {self.prefix_weight}")
        if not 0 <= self.load_bound <= 100:  # NaN too
            raise ConfigError(f"--load-bound must be within [0, 100] (0: no bound), got {self.load_bound}")
        if not 0 <= self.share_bound <= 100:  # NaN too
            raise ConfigError(f"--share-bound must be within [0, 100] (0: no bound), got {self.share_bound}")

    def api_keys(self) -> frozenset[str]:
        """The keys of --api-key-file (one a line; blank lines and ``#`` comments skipped), or an empty set
        when no file is given: then the HTTP API asks for none."""
        if self.api_key_file is None:
            return frozenset()
        try:
            text = Path(self.api_key_file).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read --api-key-file {self.api_key_file}: {e.strerror}") from e
        return parse_api_keys(text, str(self.api_key_file))

    @property
    def token_file(self) -> Path:
        """The file of the token the router reads with."""
        return self.reader_token_file or self.admin_token_file

    def doors_tls(self) -> TlsFiles:
        """--door-tls-cert and --door-tls-key, each read and checked: what the clients' doors serve with."""
        return TlsFiles(self.door_tls_cert, self.door_tls_key, flags=("--door-tls-cert", "--door-tls-key", ""))

    def tls_files(self) -> TlsFiles:
        """--tls-cert, --tls-key and --tls-ca, each read and checked."""
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    def control_plane_dialer(self) -> Dialer:
        """How the router dials the control plane: over TLS verified against --control-plane-ca, else
        --tls-ca, showing --tls-cert; in plaintext without either CA."""
        root = None
        if self.control_plane_ca is not None:
            root = read_certificates(self.control_plane_ca, "--control-plane-ca",
                                     "give the PEM CA that signed the control plane's --tls-cert")
        return self.tls_files().dialer(root)

    def pod_dialer(self) -> Dialer:
        """How the router dials the pods: over TLS verified against --tls-ca, showing --tls-cert; in
        plaintext without --tls-ca."""
        return self.tls_files().dialer()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafleet router", formatter_class=DefaultsShown,
                                description="Route Generate requests to the pods where their adapters live.")
    add_options(p, RouterConfig)
    add_log_level(p)
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return from_args(RouterConfig, args)

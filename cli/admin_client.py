"""A blocking client of the control plane's AdapterAdmin service, for the command line and ``lorafleet up``.

Where it connects, how (TLS files) and which token it sends come from flags first, then the environment
(``LORAFLEET_CONTROL_PLANE``, ``LORAFLEET_TLS_CA``, ``LORAFLEET_TLS_CERT``, ``LORAFLEET_TLS_KEY``,
``LORAFLEET_TOKEN``, ``LORAFLEET_TOKEN_FILE``), then the token file that ``lorafleet up`` writes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc

from conventions import defaults
from conventions.auth import bearer_metadata, read_token
from conventions.errors import ConfigError
from conventions.home import default_token_file
from conventions.tls import PLAINTEXT, Dialer, TlsFiles

WEIGHTS_FILE = "adapter_model.safetensors"


class AdminClientError(Exception):
    """The client cannot be set up (no token, unreadable adapter directory); the message says what to do."""


def control_plane_target(flag: str | None) -> str:
    return flag or os.environ.get("LORAFLEET_CONTROL_PLANE") or defaults.CONTROL_PLANE_ENDPOINT


def control_plane_dialer(ca: str | None = None, cert: str | None = None, key: str | None = None) -> Dialer:
    """How to dial the control plane: ``--tls-ca`` (or $LORAFLEET_TLS_CA) dials it over TLS, verified against
    that CA, showing ``--tls-cert``/``--tls-key`` (or $LORAFLEET_TLS_CERT/$LORAFLEET_TLS_KEY) to a control plane
    that asks for a certificate (mutual TLS); without a CA, plaintext."""
    ca, cert, key = (value or os.environ.get(f"LORAFLEET_TLS_{name}") or None
                     for value, name in ((ca, "CA"), (cert, "CERT"), (key, "KEY")))
    files = TlsFiles(*(Path(p) if p else None for p in (cert, key, ca)))
    if files.cert is not None and files.ca is None:
        raise ConfigError("--tls-cert is shown only over TLS: give --tls-ca too (the CA of the control plane's "
                          "certificate)")
    return files.dialer()


def resolve_token(token: str | None = None, token_file: str | None = None) -> str:
    """The admin token: ``--token``, ``--token-file``, $LORAFLEET_TOKEN, $LORAFLEET_TOKEN_FILE, then the
    file ``lorafleet up`` writes, in that order."""
    token = token or (None if token_file else os.environ.get("LORAFLEET_TOKEN"))
    if token:
        return token.strip()
    path = Path(token_file or os.environ.get("LORAFLEET_TOKEN_FILE") or default_token_file())
    try:
        return read_token(path)
    except ConfigError as e:
        raise AdminClientError(
            f"no admin token: {e}; pass --token or --token-file, set LORAFLEET_TOKEN or LORAFLEET_TOKEN_FILE, "
            "or start the stack with `lorafleet up`") from e


def sha256_of(adapter_dir: Path) -> str:
    """SHA-256 (hex) of the adapter's weights file, the digest pods check before loading it."""
    weights = adapter_dir / WEIGHTS_FILE
    digest = hashlib.sha256()
    try:
        with open(weights, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as e:
        raise AdminClientError(f"cannot read {weights} ({e.strerror}): an adapter directory must hold "
                               f"adapter_config.json and {WEIGHTS_FILE}") from e
    return digest.hexdigest()


def registration_source(source: str, sha256: str | None) -> tuple[str, str]:
    """The ``(source, sha256)`` to register. A local directory (a path or ``file://`` URL) becomes an
    absolute ``file://`` URL, and its digest is computed unless given. A ``file://`` path that exists only
    on the pods, or an http(s)://, s3:// or hf:// URL, is sent as is and needs ``sha256``."""
    url = urlparse(source)
    local = None
    if url.scheme in ("", "file"):
        path = Path(unquote(url.path)) if url.scheme == "file" else Path(source).expanduser()
        local = path.resolve() if path.is_dir() else None
    if local is not None:
        return f"file://{local}", sha256 or sha256_of(local)
    if url.scheme in ("file", "http", "https", "s3", "hf") and sha256:
        return source, sha256
    raise AdminClientError(f"{source} is not a local adapter directory; for a file:// path on the pods or an "
                           "http(s)://, s3:// or hf:// URL, give --sha256 (the SHA-256 of its "
                           "adapter_model.safetensors)")


class AdminClient:
    """AdapterAdmin calls with the bearer token; every call has a deadline. gRPC errors propagate
    as ``grpc.RpcError``."""

    def __init__(self, target: str, token: str, timeout_s: float = 10.0, dialer: Dialer = PLAINTEXT) -> None:
        self.target = target
        self._metadata = bearer_metadata(token)
        self._timeout_s = timeout_s
        self._channel = dialer.channel(target)
        self._stub = adapter_admin_pb2_grpc.AdapterAdminStub(self._channel)

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request):
        return getattr(self._stub, method)(request, metadata=self._metadata, timeout=self._timeout_s)

    def register(self, name: str, source: str, sha256: str, base_model: str) -> pb.Adapter:
        return self._call("RegisterAdapter", pb.RegisterAdapterRequest(name=name, source=source, sha256=sha256,
                                                                       base_model=base_model))

    def unregister(self, name: str) -> None:
        self._call("UnregisterAdapter", pb.UnregisterAdapterRequest(name=name))

    def pin(self, name: str, replicas: int = 0) -> pb.Adapter:
        return self._call("PinAdapter", pb.PinAdapterRequest(name=name, replicas=replicas))

    def unpin(self, name: str) -> pb.Adapter:
        return self._call("UnpinAdapter", pb.UnpinAdapterRequest(name=name))

    def get(self, name: str) -> pb.Adapter:
        return self._call("GetAdapter", pb.GetAdapterRequest(name=name))

    def adapters(self) -> list[pb.Adapter]:
        """Every registered adapter, in name order (all pages)."""
        out, token = [], ""
        while True:
            page = self._call("ListAdapters", pb.ListAdaptersRequest(page_size=500, page_token=token))
            out.extend(page.adapters)
            token = page.next_page_token
            if not token:
                return out

    def pods(self) -> list[pb.Pod]:
        return list(self._call("ListPods", pb.ListPodsRequest()).pods)

    def fleet_base_model(self) -> str:
        """The base model every live pod serves; AdminClientError when there is none or they differ."""
        models = {p.base_model for p in self.pods() if p.base_model}
        if len(models) != 1:
            found = ", ".join(sorted(models)) or "no pod has registered yet"
            raise AdminClientError(f"cannot tell the base model from the pods ({found}); pass --base-model")
        return models.pop()

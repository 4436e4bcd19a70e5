"""TLS between components: one component's certificate, key and CA as its flags name them (``--tls-cert``,
``--tls-key``, ``--tls-ca``), checked when its config is built; the server credentials it serves with, which
pick up renewed files without a restart; the channels it dials its peers with; and the mode each link
runs in, as start-up logs name it (docs/SECURITY.md, Transport)."""

from __future__ import annotations

import enum
import logging
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from conventions.errors import ConfigError

log = logging.getLogger("lorafleet.tls")

_CERT_MARK = b"-----BEGIN CERTIFICATE-----"
_CA_HINT = "give the PEM certificate of the CA that signs the fleet's component certificates"


class Mode(enum.Enum):
    """How one link runs, in the words the start-up logs use."""

    PLAINTEXT = "plaintext"
    TLS = "tls"  # the server shows a certificate the client verifies; the client shows none
    MUTUAL = "mtls"  # both ends show a certificate, each verified against the CA the other holds


def read_certificates(path: Path, flag: str, hint: str = _CA_HINT) -> bytes:
    """The PEM certificates in ``path``, given as ``flag``. Raises ConfigError naming the flag and saying
    what to give instead (``hint``) for a file that cannot be read or holds no PEM certificate."""
    try:
        pem = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror}); {hint}") from e
    if _CERT_MARK not in pem:
        raise ConfigError(f"{flag} {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----); {hint}")
    try:
        ssl.create_default_context(cadata=pem.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as e:
        raise ConfigError(f"{flag} {path}: its PEM certificates do not parse ({e}); {hint}") from e
    return pem


def _encrypted_key() -> bytes:
    raise ConfigError("--tls-key is encrypted with a passphrase; give the key unencrypted, in a file (or Kubernetes "
                      "Secret) only this process can read")


@dataclass(frozen=True)
class Dialer:
    """How a component dials one kind of peer: plaintext without ``root``; over TLS verifying the peer
    against ``root`` (PEM CA certificates) otherwise, showing its own ``key_pair`` (private key, certificate
    chain) when it has one."""

    root: bytes | None = None
    key_pair: tuple[bytes, bytes] | None = None

    @property
    def mode(self) -> Mode:
        if self.root is None:
            return Mode.PLAINTEXT
        return Mode.TLS if self.key_pair is None else Mode.MUTUAL

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The channel credentials, or None for plaintext."""
        if self.root is None:
            return None
        key, chain = self.key_pair or (None, None)
        return grpc.ssl_channel_credentials(root_certificates=self.root, private_key=key, certificate_chain=chain)

    def aio_channel(self, target: str, options=None) -> grpc.aio.Channel:
        credentials = self.credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, credentials, options=options)

    def channel(self, target: str, options=None) -> grpc.Channel:
        """A blocking channel (the command line's)."""
        credentials = self.credentials()
        if credentials is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, credentials, options=options)


PLAINTEXT = Dialer()  # dials without TLS


@dataclass(frozen=True)
class TlsFiles:
    """One component's TLS files. ``cert`` and ``key`` (--tls-cert, --tls-key): its certificate chain and
    private key, which its gRPC server serves with and which it shows to the peers it dials over TLS.
    ``ca`` (--tls-ca): the CA of the fleet's components; a server given one requires every client to show
    a certificate that CA signed, and the component dials its peers over TLS, verifying them against it.
    Every file is read and checked on construction, so that a bad one stops the process at start-up."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    flags: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-ca")  # what messages call cert, key and ca

    def __post_init__(self) -> None:
        cert_flag, key_flag, _ = self.flags
        if (self.cert is None) != (self.key is None):
            given, missing = (cert_flag, key_flag) if self.cert is not None else (key_flag, cert_flag)
            raise ConfigError(f"{given} needs {missing}: give the certificate and its private key together")
        if self.ca is not None:
            self.root()
        if self.cert is not None:
            self.key_pair()

    @property
    def serving(self) -> Mode:
        """The mode this component's gRPC server runs in."""
        if self.cert is None:
            return Mode.PLAINTEXT
        return Mode.TLS if self.ca is None else Mode.MUTUAL

    def root(self) -> bytes | None:
        """The PEM certificates of --tls-ca, or None without it."""
        return None if self.ca is None else read_certificates(self.ca, self.flags[2])

    def key_pair(self) -> tuple[bytes, bytes] | None:
        """(private key, certificate chain) PEM of --tls-key and --tls-cert, checked to belong together;
        None without them."""
        if self.cert is None:
            return None
        cert_flag, key_flag, _ = self.flags
        chain = read_certificates(self.cert, cert_flag, "give this component's PEM certificate (chain)")
        try:
            key = Path(self.key).read_bytes()
        except OSError as e:
            raise ConfigError(f"{key_flag} {self.key}: cannot read it ({e.strerror}); give the PEM private key of "
                              f"{cert_flag}") from e
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(self.cert, self.key, password=_encrypted_key)
        except ssl.SSLError as e:
            raise ConfigError(f"{key_flag} {self.key} is not the PEM private key of {cert_flag} {self.cert} "
                              f"({e.reason or e}); give the key the certificate was issued for") from e
        return key, chain

    def dialer(self, root: bytes | None = None) -> Dialer:
        """How this component dials its peers: over TLS when ``root`` (a peer-specific CA such as
        --control-plane-ca) or --tls-ca is given, verifying the peer against it and showing --tls-cert
        when given; in plaintext otherwise."""
        root = root if root is not None else self.root()
        return Dialer(root, self.key_pair() if root is not None else None)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Credentials to serve with, None for plaintext. With --tls-ca a client must show a certificate
        the CA signed, or its handshake fails. The files are looked at before each new connection: once
        they change (a renewed certificate, a Secret update), new connections use them; connections
        already open keep theirs."""
        if self.cert is None:
            return None
        return grpc.dynamic_ssl_server_credentials(self._certificate_configuration(),
                                                   _Reloader(self, self._certificate_configuration),
                                                   require_client_authentication=self.ca is not None)

    def ssl_context(self) -> ssl.SSLContext | None:
        """A context to serve HTTPS with (TLS 1.2 or newer), None for plaintext; with --tls-ca a client must show
        a certificate the CA signed. Like ``server_credentials`` it picks up changed files for new connections:
        every handshake asks its SNI callback, which hands the connection a context made from the files as
        they are now when they changed (files that cannot be used are logged and the last good ones kept)."""
        if self.cert is None:
            return None
        return _ContextReloader(self).base

    def _context(self) -> ssl.SSLContext:
        self.key_pair()  # refuses files that cannot serve, naming the flag
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key, password=_encrypted_key)
        if self.ca is not None:
            context.load_verify_locations(cafile=self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([self.key_pair()], root_certificates=self.root())

    def _stamp(self) -> tuple:
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in
                     (Path(p).stat() for p in (self.cert, self.key, self.ca) if p is not None))


class _Reloader:
    """Called before each new connection's handshake: what ``build`` makes of the files when one changed since
    the last look, None (keep the one in use) otherwise, or when the new files cannot be used (half-written, a
    key that does not match): that is logged, and the files are tried again at their next change. gRPC calls
    one with the server's certificate configuration (``server_credentials``); an HTTPS server's context calls
    one from its SNI callback (``_ContextReloader``)."""

    def __init__(self, files: TlsFiles, build: Callable[[], object]) -> None:
        self._files, self._build = files, build
        self._lock = threading.Lock()
        self._stamp = files._stamp()

    def __call__(self):
        with self._lock:
            try:
                stamp = self._files._stamp()
            except OSError:  # a Secret's files swapped under us: look again at the next connection
                return None
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            try:
                built = self._build()
            except (ConfigError, ssl.SSLError, OSError) as e:
                log.warning("TLS files changed but cannot be used; new connections keep the previous ones",
                            extra={"error": str(e)})
                return None
            log.info("TLS files changed; new connections use them", extra={"cert": str(self._files.cert)})
            return built


class _ContextReloader:
    """The SNI callback of an HTTPS server's context (``TlsFiles.ssl_context``): on each handshake, the files'
    newest usable context for that connection."""

    def __init__(self, files: TlsFiles) -> None:
        self._fresh = _Reloader(files, files._context)
        self.base = self._current = files._context()
        self.base.sni_callback = self._handshake

    def _handshake(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        self._current = self._fresh() or self._current
        if self._current is not context:
            connection.context = self._current


def add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None,
             flag: str = "--port") -> int:
    """Binds ``address`` on ``server``, over TLS with ``credentials``, in plaintext without; returns the port
    bound. Raises ConfigError naming ``flag`` (the flag that gave the port) when it cannot listen there."""
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpc raises on a failed bind, or (older versions) returns 0
        bound = 0
    if bound == 0:
        port = address.rsplit(":", 1)[-1]
        raise ConfigError(f"{flag} {port}: cannot listen on {address} (is the port taken, or given to another of "
                          "this process's ports?); give a free port")
    return bound

"""Certificates for TLS tests, made with the ``cryptography`` package: a CA, and certificates it issues
for 127.0.0.1 and localhost that serve as both server and client certificates (as each lorafleet
component's does: it serves with it and shows it to the peers it dials)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    """One certificate's PEM files: ``cert`` and its private ``key``."""

    cert: Path
    key: Path

    def flags(self, ca: Path) -> tuple[str, ...]:
        """The --tls-cert/--tls-key/--tls-ca flags of a component holding this certificate and trusting ``ca``."""
        return "--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(ca)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


class Authority:
    """A CA whose certificate is written to ``directory/<name>-ca.pem``; ``issue`` writes certificates it signs."""

    def __init__(self, directory: Path, name: str = "fleet") -> None:
        self.directory, self.name = directory, name
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (x509.CertificateBuilder().subject_name(_name(f"{name} CA")).issuer_name(_name(f"{name} CA"))
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5))
                      .not_valid_after(now + datetime.timedelta(days=1))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                                   key_encipherment=False, data_encipherment=False,
                                                   key_agreement=False, key_cert_sign=True, crl_sign=True,
                                                   encipher_only=False, decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.cert = directory / f"{name}-ca.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, cert: Path | None = None, key: Path | None = None) -> Issued:
        """A certificate for ``common_name`` on 127.0.0.1 and localhost, written to ``cert`` and ``key``
        (default ``directory/<common_name>.pem`` and ``.key``; existing files are replaced)."""
        private = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        issued = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(self._cert.subject)
                  .public_key(private.public_key()).serial_number(x509.random_serial_number())
                  .not_valid_before(now - datetime.timedelta(minutes=5))
                  .not_valid_after(now + datetime.timedelta(days=1))
                  .add_extension(x509.SubjectAlternativeName([
                      x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                  .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                        ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                  .sign(self._key, hashes.SHA256()))
        cert = cert or self.directory / f"{common_name}.pem"
        key = key or self.directory / f"{common_name}.key"
        cert.write_bytes(issued.public_bytes(serialization.Encoding.PEM))
        _write_key(private, key)
        return Issued(cert, key)


def handshake(port: int, ca: Path, client: Issued | None = None) -> tuple[str, bool]:
    """Opens a TLS connection to 127.0.0.1:``port`` as a gRPC client would (ALPN h2), verifying the server
    against ``ca`` and showing ``client`` when given: (the server certificate's common name, whether the
    server accepted this client). A gRPC server that accepts the handshake starts HTTP/2 at once (its
    SETTINGS frame); one that refuses the client's certificate, or its lack of one, closes the connection."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(ca)
    context.set_alpn_protocols(["h2"])
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
        subject = dict(pair[0] for pair in conn.getpeercert()["subject"])
        try:
            first = conn.recv(9)  # an HTTP/2 frame header
        except (ssl.SSLError, ConnectionResetError):
            first = b""
        return subject["commonName"], bool(first)

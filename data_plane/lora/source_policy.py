"""``SourcePolicy``: which adapter sources a pod may fetch (``--adapter-source-allow``).

An entry is a scheme (``file``, ``http``, ``https``, ``s3``, ``hf``: every source of that scheme),
``http[s]://HOST[:PORT]`` (that host, on any port unless one is given), ``s3://BUCKET`` or
``hf://ORG[/REPO]``. Without entries every scheme is allowed. Either way an http(s) connection to a
loopback, link-local or unspecified address (127.0.0.0/8, ::1, 169.254.0.0/16 where cloud metadata
services answer, fe80::/10, 0.0.0.0) is refused unless an entry names that host: an admin token must
not become a way to make a pod fetch its node's credentials. The address is checked on the connected
socket, so a name that resolves elsewhere later, or a redirect, cannot get around it.

The S3 and Hub endpoints the operator configures (--s3-endpoint-url, --hf-endpoint) are trusted: the
policy governs the sources that registrations name, not where the operator's storage lives.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from data_plane.errors import SourceDenied

SCHEMES = ("file", "http", "https", "s3", "hf")
_HOST_SCHEMES = ("http", "https")


def source_scheme(source: str) -> str:
    """The scheme a source is fetched by: a plain path counts as ``file``."""
    return urlparse(source).scheme or "file"


def _entry_parts(entry: str) -> tuple[str, str]:
    """(scheme, what follows ``scheme://``) of an entry, lower-cased but for a bucket or repository."""
    scheme, sep, rest = entry.partition("://")
    return scheme.lower(), rest.strip("/") if sep else ""


def check_entry(entry: str) -> str:
    """Returns ``entry`` if it is a valid --adapter-source-allow entry; raises ValueError saying the forms."""
    scheme, rest = _entry_parts(entry)
    forms = "use a scheme (file, http, https, s3, hf), http[s]://HOST[:PORT], s3://BUCKET or hf://ORG[/REPO]"
    slashes = 1 if scheme == "hf" else 0  # hf://ORG/REPO is the only entry with a path
    malformed = (scheme not in SCHEMES or ("://" in entry and not rest) or (rest and scheme == "file")
                 or rest.count("/") > slashes or any(c in rest for c in "@?# "))
    if malformed:
        raise ValueError(f"--adapter-source-allow {entry!r} is not an allow-list entry; {forms}")
    if scheme in _HOST_SCHEMES and rest:
        try:
            urlparse(f"{scheme}://{rest}").port  # noqa: B018 - raises ValueError for a port that is no number
        except ValueError:
            raise ValueError(f"--adapter-source-allow {entry!r}: the port is not a number in 0..65535") from None
    return entry


def _local_address(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback or addr.is_link_local or addr.is_unspecified


@dataclass(frozen=True)
class SourcePolicy:
    allow: tuple[str, ...] = ()  # --adapter-source-allow entries; empty = every scheme

    def __post_init__(self) -> None:
        for entry in self.allow:
            check_entry(entry)

    def check(self, name: str, source: str, shown: str) -> str:
        """Returns the scheme of ``source`` if the allow-list admits it; raises SourceDenied naming
        ``shown`` (the source without credentials) and the entry that would admit it."""
        scheme = source_scheme(source)
        if not self.allow and scheme in SCHEMES:
            return scheme
        url = urlparse(source)
        for entry in self.allow:
            e_scheme, rest = _entry_parts(entry)
            if e_scheme == scheme and (not rest or self._matches(scheme, rest, url)):
                return scheme
        raise SourceDenied(f"adapter {name!r}: this pod does not fetch {shown}: its --adapter-source-allow "
                           f"({', '.join(self.allow) or 'every scheme'}) admits no such source; add "
                           f"{self._suggestion(scheme, url)} to the pod's --adapter-source-allow if it should")

    def permits_address(self, scheme: str, host: str, port: int | None, ip: str) -> bool:
        """True unless ``ip`` (where an http(s) connection to ``host`` landed) is a loopback,
        link-local or unspecified address that no entry names ``host`` for."""
        if not _local_address(ip):
            return True
        return any(_entry_parts(e)[0] == scheme and _host_matches(_entry_parts(e)[1], host, port)
                   for e in self.allow)

    @staticmethod
    def _matches(scheme: str, rest: str, url) -> bool:
        if scheme in _HOST_SCHEMES:
            return _host_matches(rest, url.hostname or "", url.port)
        if scheme == "s3":
            return url.netloc == rest
        # hf://org/repo[@revision]: an entry names an organisation or one repository
        repo = f"{url.netloc}/{unquote(url.path).strip('/')}".split("@", 1)[0]
        return repo == rest or repo.startswith(f"{rest}/")

    @staticmethod
    def _suggestion(scheme: str, url) -> str:
        if scheme in _HOST_SCHEMES:
            try:
                local = _local_address(url.hostname or "")
            except ValueError:  # a host name, not an address
                local = False
            if local:  # never advise opening a loopback or link-local address (cloud metadata lives there)
                return f"{scheme}://{url.hostname} (a loopback or link-local address: only a server of your own)"
            return f"{scheme}://{url.hostname}"
        if scheme in ("s3", "hf"):
            return f"{scheme}://{url.netloc}"
        return scheme


def _host_matches(rest: str, host: str, port: int | None) -> bool:
    entry = urlparse(f"//{rest}")
    if not rest or (entry.hostname or "") != host.lower().strip("[]"):
        return False
    return entry.port is None or entry.port == port

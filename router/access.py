"""Who may call what through the router: the caller's key names a tenant, the tenant's list says which
adapters it may use, its limits say how often. Both doors (gRPC metadata ``authorization`` and HTTP
``Authorization``) ask here. The keys' file is re-read when it changes, so a key added or revoked takes
effect within one poll, without a restart; a file that no longer parses leaves the last good one in use."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from conventions.errors import ConfigError
from router.errors import PermissionDenied, Unauthenticated
from router.limits import RateLimiter
from router.tenants import Tenant, TenantBook

log = logging.getLogger("lorafleet.router.access")

# The parse function of one kind of keys file: its text and its name for messages -> the book.
Parser = Callable[[str, str], TenantBook]


class KeysFile:
    """A keys file and the book it last parsed to; ``reload`` re-reads it when its bytes changed (a
    Kubernetes Secret volume swaps the whole file, so the content, not the mtime, is compared)."""

    def __init__(self, path: Path, parse: Parser, check: Callable[[TenantBook], None] = lambda book: None) -> None:
        self.path, self._parse, self._check = Path(path), parse, check
        self._digest = b""
        self.book = self._read()  # ConfigError at start-up: the router does not start on a bad file

    def reload(self) -> bool:
        """Re-reads the file if it changed; True when a new book is in use. A bad file is logged and skipped."""
        try:
            data = self.path.read_bytes()
        except OSError as e:
            log.error("cannot re-read the keys file; keeping the last one", extra={"path": str(self.path),
                                                                                 "error": e.strerror})
            return False
        if hashlib.sha256(data).digest() == self._digest:
            return False
        try:
            self.book = self._read(data)
        except ConfigError as e:
            log.error("the keys file changed but is invalid; keeping the last one", extra={"error": str(e)})
            self._digest = hashlib.sha256(data).digest()  # logged once, not every poll
            return False
        log.info("keys file reloaded", extra={"path": str(self.path), "tenants": len(self.book.tenants)})
        return True

    def _read(self, data: bytes | None = None) -> TenantBook:
        if data is None:
            try:
                data = self.path.read_bytes()
            except OSError as e:
                raise ConfigError(f"cannot read {self.path}: {e.strerror}") from None
        book = self._parse(data.decode(errors="replace"), str(self.path))
        self._check(book)
        self._digest = hashlib.sha256(data).digest()
        return book


class Access:
    """The router's one gate. ``keys`` None: the doors are open (every caller, every adapter, no limits).
    ``grpc_guarded`` False (``--api-key-file``, kept as it was) leaves the gRPC door open and names no
    tenant to the pods; True (``--tenants-file``) guards both doors and names each request's tenant."""

    def __init__(self, keys: KeysFile | None, limiter: RateLimiter | None, grpc_guarded: bool) -> None:
        self._keys, self._limiter = keys, limiter
        self.grpc_guarded = grpc_guarded and keys is not None

    @property
    def open(self) -> bool:
        return self._keys is None

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization`` value (``Bearer <key>``); None when the doors are open.
        Unauthenticated for no key, a malformed one, or a key no tenant holds."""
        if self._keys is None:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>' (the HTTP header"
                                  " 'Authorization' or the gRPC metadata 'authorization')")
        tenant = self._keys.book.tenant_for(key.strip())
        if tenant is None:
            raise Unauthenticated("invalid API key: it is not a key of any tenant, or it was revoked")
        return tenant

    async def admit(self, tenant: Tenant | None, adapter: str) -> None:
        """Lets ``tenant`` call ``adapter`` ("" = base model) now, or raises PermissionDenied (the same
        words whether the adapter exists or not) or RateLimited."""
        if tenant is None:
            return
        if not tenant.may_use(adapter):
            what = f"the adapter {adapter!r}" if adapter else "the base model"
            raise PermissionDenied(f"this key may not use {what}; ask the fleet's operator to grant it to"
                                   f" tenant {tenant.name!r}")
        if self._limiter is not None:
            await self._limiter.admit(tenant)

    async def charge(self, tenant: Tenant | None, tokens: int) -> None:
        """Charges a finished request's tokens to its tenant's tokens per minute."""
        if tenant is not None and self._limiter is not None:
            await self._limiter.charge(tenant, tokens)

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        """Re-reads the keys file every ``interval_s`` until ``stop`` is set."""
        while self._keys is not None and not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            await asyncio.to_thread(self._keys.reload)

    async def close(self) -> None:
        if self._limiter is not None:
            await self._limiter.close()


def needs_limiter(book: TenantBook) -> None:
    """ConfigError when a tenant has a limit: the check of a book read without --limits-redis-url."""
    limited = [t.name for t in book.tenants if t.requests_per_s is not None or t.tokens_per_min is not None]
    if limited:
        raise ConfigError(f"tenants {limited} have limits but the router has no --limits-redis-url to count them"
                          " in; give one (the control plane's Redis will do) or drop the limits")

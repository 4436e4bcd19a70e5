"""Tenants: who may call which adapter through the router, found by the key a caller presents.

A tenants file (JSON; a Kubernetes Secret mounted as a file works as is) reads::

    {"tenants": [{"name": "acme", "key_sha256": ["<64 hex digits>", ...],
                  "adapters": ["acme-*", "shared-summary"], "base_model": true,
                  "requests_per_second": 5, "tokens_per_minute": 20000, "share_prefixes_with": "acme-group"}]}

Keys are stored only as the SHA-256 of their UTF-8 bytes (``printf %s "$KEY" | sha256sum``): keys are long
random strings, so one unsalted hash is enough to keep a leaked file from giving a key away. ``adapters``
holds names and ``fnmatch`` globs (``*``, ``?``, ``[...]``); ``base_model`` says whether the base model
(no adapter) is allowed. The two limits are optional; absent means unlimited. A tenant's prompts are cached
apart from every other tenant's (GenerateRequest.cache_salt), unless both name the same
``share_prefixes_with`` group: then their requests may reuse each other's cached prompt blocks."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from conventions.errors import ConfigError

_HASH = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
_TENANT_FIELDS = {"name", "key_sha256", "adapters", "base_model", "requests_per_second", "tokens_per_minute",
                  "share_prefixes_with"}


def key_hash(key: str) -> str:
    """The hex SHA-256 of ``key``, as a tenants file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """One customer or team: the adapters it may use, and its limits (None = unlimited)."""

    name: str
    adapters: tuple[str, ...]  # names and fnmatch globs
    base_model: bool = False
    requests_per_s: float | None = None
    tokens_per_min: int | None = None
    share_prefixes_with: str | None = None  # a group whose tenants' requests may share cached prompt blocks

    @property
    def cache_scope(self) -> str:
        """What its requests' cached prompt blocks are keyed under: its group's, else its own."""
        return f"group:{self.share_prefixes_with}" if self.share_prefixes_with else f"tenant:{self.name}"

    def may_use(self, adapter: str) -> bool:
        """Whether this tenant may call ``adapter`` ("" = the base model)."""
        if not adapter:
            return self.base_model
        return any(fnmatchcase(adapter, pattern) for pattern in self.adapters)


@dataclass(frozen=True)
class TenantBook:
    """Every tenant by the hash of each of its keys; immutable, replaced whole when the file changes."""

    by_key_hash: dict[str, Tenant]

    def tenant_for(self, key: str) -> Tenant | None:
        """The tenant holding ``key``, or None for a key nobody holds."""
        return self.by_key_hash.get(key_hash(key))

    @property
    def tenants(self) -> list[Tenant]:
        return sorted(set(self.by_key_hash.values()), key=lambda t: t.name)


def parse_tenants(text: str, source: str) -> TenantBook:
    """The TenantBook of a tenants file's text; ConfigError naming ``source`` and what to fix otherwise."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source} is not valid JSON ({e}); see docs/SECURITY.md for the format") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), list) or set(doc) != {"tenants"}:
        raise ConfigError(f"{source} must be a JSON object with one field, \"tenants\": a list of tenants")
    by_hash: dict[str, Tenant] = {}
    names: set[str] = set()
    for i, entry in enumerate(doc["tenants"]):
        tenant, hashes = _tenant(entry, f"{source} tenants[{i}]")
        if tenant.name in names:
            raise ConfigError(f"{source}: tenant {tenant.name!r} appears twice; merge its entries")
        names.add(tenant.name)
        for h in hashes:
            if h in by_hash:
                raise ConfigError(f"{source}: a key of tenant {tenant.name!r} is also a key of"
                                  f" {by_hash[h].name!r}; a key belongs to one tenant")
            by_hash[h] = tenant
    return TenantBook(by_hash)


def open_book(keys: frozenset[str]) -> TenantBook:
    """The book of ``--api-key-file``: one tenant, ``default``, that holds every key and may use every adapter."""
    everyone = Tenant("default", ("*",), base_model=True)
    return TenantBook({key_hash(k): everyone for k in keys})


def _tenant(entry, where: str) -> tuple[Tenant, list[str]]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a JSON object")
    unknown = set(entry) - _TENANT_FIELDS
    if unknown:
        raise ConfigError(f"{where} has unknown fields {sorted(unknown)}; the fields are {sorted(_TENANT_FIELDS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: name must be 1-63 lowercase letters, digits, '.', '_' or '-', got {name!r}")
    hashes = entry.get("key_sha256")
    if not isinstance(hashes, list) or not hashes or not all(isinstance(h, str) and _HASH.fullmatch(h)
                                                             for h in hashes):
        raise ConfigError(f"{where} ({name}): key_sha256 must be a non-empty list of lowercase hex SHA-256 digests"
                          " (printf %s \"$KEY\" | sha256sum)")
    adapters = entry.get("adapters", [])
    if not isinstance(adapters, list) or not all(isinstance(a, str) and a for a in adapters):
        raise ConfigError(f"{where} ({name}): adapters must be a list of adapter names or globs")
    base = entry.get("base_model", False)
    if not isinstance(base, bool):
        raise ConfigError(f"{where} ({name}): base_model must be true or false")
    rps = _limit(entry, "requests_per_second", where, name)
    tpm = _limit(entry, "tokens_per_minute", where, name)
    group = entry.get("share_prefixes_with")
    if group is not None and (not isinstance(group, str) or not _NAME.fullmatch(group)):
        raise ConfigError(f"{where} ({name}): share_prefixes_with must name a group in 1-63 lowercase letters,"
                          f" digits, '.', '_' or '-', got {group!r}")
    return Tenant(name, tuple(adapters), base, rps, None if tpm is None else int(tpm), group), hashes


def _limit(entry: dict, field: str, where: str, name: str) -> float | None:
    value = entry.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e9:
        raise ConfigError(f"{where} ({name}): {field} must be a positive number (or absent for no limit),"
                          f" got {value!r}")
    return float(value)

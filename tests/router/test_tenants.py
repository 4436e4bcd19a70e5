"""The tenants file: what a key may use, and every malformed file refused with a message saying what to fix;
a reloaded file that is broken leaves the last good one in use."""

from __future__ import annotations

import asyncio
import json

import pytest
from lorafleet.v1 import generation_pb2 as g

from conventions.errors import ConfigError
from router.access import Access, KeysFile, needs_limiter
from router.door import Door
from router.errors import PermissionDenied, Unauthenticated
from router.request import RoutedRequest
from router.tenants import key_hash, parse_tenants
from tests.router.test_forwarder import router

KEY = "sk-acme-1"


def doc(**fields) -> str:
    return json.dumps({"tenants": [{"name": "acme", "key_sha256": [key_hash(KEY)], **fields}]})


def test_a_tenant_may_use_its_names_and_globs_and_the_base_model_only_when_allowed():
    acme = parse_tenants(doc(adapters=["acme-*", "shared"]), "t").tenant_for(KEY)
    assert [acme.may_use(a) for a in ("acme-legal", "shared", "shared-2", "other", "")] == [
        True, True, False, False, False]
    assert parse_tenants(doc(base_model=True), "t").tenant_for(KEY).may_use("")
    assert parse_tenants(doc(), "t").tenant_for("sk-other") is None


@pytest.mark.parametrize("text, words", [
    ("{", "is not valid JSON"),
    ("[]", "one field, \"tenants\""),
    (json.dumps({"tenants": [], "extra": 1}), "one field"),
    (doc(colour="red"), "unknown fields ['colour']"),
    (json.dumps({"tenants": [{"name": "Bad Name", "key_sha256": [key_hash(KEY)]}]}), "name must be"),
    (json.dumps({"tenants": [{"name": "acme", "key_sha256": [KEY]}]}), "SHA-256 digests"),
    (json.dumps({"tenants": [{"name": "acme", "key_sha256": []}]}), "SHA-256 digests"),
    (doc(adapters="acme-*"), "adapters must be a list"),
    (doc(base_model="yes"), "base_model must be true or false"),
    (doc(requests_per_second=0), "requests_per_second must be a positive number"),
    (doc(tokens_per_minute=True), "tokens_per_minute must be a positive number"),
    (doc(share_prefixes_with="Not A Group"), "share_prefixes_with must name a group"),
    (json.dumps({"tenants": [{"name": "acme", "key_sha256": [key_hash(KEY)]},
                             {"name": "acme", "key_sha256": [key_hash("k2")]}]}), "appears twice"),
    (json.dumps({"tenants": [{"name": "acme", "key_sha256": [key_hash(KEY)]},
                             {"name": "beta", "key_sha256": [key_hash(KEY)]}]}), "a key belongs to one tenant"),
])
def test_a_malformed_tenants_file_is_refused_with_what_to_fix(text, words):
    with pytest.raises(ConfigError, match="tenants.json") as e:
        parse_tenants(text, "tenants.json")
    assert words in str(e.value)


def test_limits_need_a_store_to_count_them_in():
    needs_limiter(parse_tenants(doc(), "t"))
    with pytest.raises(ConfigError, match="--limits-redis-url"):
        needs_limiter(parse_tenants(doc(tokens_per_minute=100), "t"))


def test_the_gate_says_who_is_refused_and_why(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(doc(adapters=["acme-*"]))
    access = Access(KeysFile(path, parse_tenants), None, grpc_guarded=True)
    for header in (None, "", "Basic x", "Bearer ", "Bearer sk-unknown"):
        with pytest.raises(Unauthenticated):
            access.tenant(header)
    acme = access.tenant(f"Bearer {KEY}")
    asyncio.run(access.admit(acme, "acme-legal"))
    messages = []
    for adapter in ("beta-legal", "no-such-adapter"):
        with pytest.raises(PermissionDenied) as e:
            asyncio.run(access.admit(acme, adapter))
        messages.append(str(e.value).replace(repr(adapter), "A"))
    assert messages[0] == messages[1]  # the same words whether the adapter exists or not
    assert Access(None, None, grpc_guarded=True).tenant(None) is None  # open doors: no key asked


def test_a_reloaded_file_takes_effect_and_a_broken_one_keeps_the_last(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(doc(adapters=["a"]))
    keys = KeysFile(path, parse_tenants)
    assert not keys.reload()  # unchanged
    path.write_text(doc(adapters=["b"]))
    assert keys.reload() and keys.book.tenant_for(KEY).adapters == ("b",)
    path.write_text("{broken")
    assert not keys.reload() and keys.book.tenant_for(KEY).adapters == ("b",)
    path.unlink()
    assert not keys.reload() and keys.book.tenant_for(KEY) is not None
    with pytest.raises(ConfigError, match="cannot read"):
        KeysFile(path, parse_tenants)


def test_the_pod_is_told_the_keys_tenant_over_whatever_the_caller_wrote(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(doc(adapters=["pirate"]))

    async def go(grpc_guarded: bool):
        async with router({"a": "ok"}) as f:
            access = Access(KeysFile(path, parse_tenants), None, grpc_guarded=grpc_guarded)
            door = Door(f.forwarder, access, f.metrics)
            claimed = g.GenerateRequest(adapter="pirate", prompt="hi", tenant="someone-else",
                                        cache_salt="tenant:someone-else").SerializeToString()
            async for _ in door.stream(RoutedRequest.parse(claimed), access.tenant(f"Bearer {KEY}"), 10, "grpc"):
                pass
            return f.pods["a"].calls[0].tenant, f.pods["a"].calls[0].cache_salt

    # the key's tenant, and its cache scope before whatever salt the caller wrote
    assert asyncio.run(go(grpc_guarded=True)) == ("acme", "tenant:acme/tenant:someone-else")
    # --api-key-file keeps the pods' fair shares per adapter, as before tenants: nothing is named, and the caller's
    # salt goes under the open doors' scope: it cannot claim a tenant's
    assert asyncio.run(go(grpc_guarded=False)) == ("someone-else", "open/tenant:someone-else")


def test_tenants_sharing_a_group_share_its_cache_scope_and_others_keep_their_own():
    book = parse_tenants(json.dumps({"tenants": [
        {"name": "acme", "key_sha256": [key_hash("a")], "share_prefixes_with": "holding"},
        {"name": "acme-eu", "key_sha256": [key_hash("b")], "share_prefixes_with": "holding"},
        {"name": "globex", "key_sha256": [key_hash("c")]}]}), "tenants.json")
    scopes = [book.tenant_for(k).cache_scope for k in "abc"]
    assert scopes == ["group:holding", "group:holding", "tenant:globex"]

"""--adapter-source-allow: which sources a pod fetches, and which addresses an http(s) source may reach."""

from __future__ import annotations

import pytest

from data_plane.errors import SourceDenied
from data_plane.lora.source_policy import SourcePolicy


@pytest.mark.parametrize("ip", ["127.0.0.1", "127.8.9.10", "::1", "169.254.169.254", "fe80::1", "0.0.0.0",
                                "::ffff:127.0.0.1", "::ffff:169.254.169.254"])
def test_loopback_link_local_and_unspecified_addresses_are_refused_by_default(ip):
    assert not SourcePolicy().permits_address("http", "metadata.example", None, ip)
    assert not SourcePolicy(("http", "https")).permits_address("http", "metadata.example", None, ip)


@pytest.mark.parametrize("ip", ["10.0.0.8", "192.168.1.2", "8.8.8.8", "2001:db8::1"])
def test_other_addresses_are_reachable(ip):
    assert SourcePolicy().permits_address("https", "adapters.example", 443, ip)


def test_an_entry_naming_the_host_and_port_permits_a_loopback_address():
    policy = SourcePolicy(("http://127.0.0.1:8000", "https://localhost"))
    assert policy.permits_address("http", "127.0.0.1", 8000, "127.0.0.1")
    assert not policy.permits_address("http", "127.0.0.1", 8001, "127.0.0.1")
    assert policy.permits_address("https", "localhost", 9443, "::1")
    assert not policy.permits_address("http", "localhost", 80, "127.0.0.1")  # the entry is for https


@pytest.mark.parametrize(("allow", "source", "admitted"), [
    ((), "s3://any/x", True), ((), "hf://o/r", True), ((), "/adapters/x", True), ((), "ftp://h/x", False),
    (("s3://adapters",), "s3://adapters/team/x", True), (("s3://adapters",), "s3://adapters-evil/x", False),
    (("hf://acme",), "hf://acme/style@v1", True), (("hf://acme",), "hf://acme-evil/style", False),
    (("hf://acme/style",), "hf://acme/style@main", True), (("hf://acme/style",), "hf://acme/other", False),
    (("https://adapters.example",), "https://adapters.example:8443/x", True),
    (("https://adapters.example",), "http://adapters.example/x", False),
    (("https://adapters.example",), "https://evil.example/x", False),
    (("file",), "file:///adapters/x", True), (("file",), "relative/dir", True), (("s3",), "relative/dir", False),
])
def test_sources_are_admitted_by_scheme_bucket_repository_or_host(allow, source, admitted):
    policy = SourcePolicy(allow)
    if admitted:
        policy.check("a", source, source)
    else:
        with pytest.raises(SourceDenied, match="adapter 'a': this pod does not fetch"):
            policy.check("a", source, source)


@pytest.mark.parametrize("entry", ["ftp", "s3://", "s3://b/prefix", "file:///adapters", "https://h/path",
                                   "hf://a/b/c", "https://h:port", "http://u@h"])
def test_malformed_entries_are_refused_with_the_forms(entry):
    with pytest.raises(ValueError, match="--adapter-source-allow .*(HOST|port)"):
        SourcePolicy((entry,))

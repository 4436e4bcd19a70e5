"""The control plane's configuration refuses bad values with a message naming the flag to fix."""

from __future__ import annotations

import dataclasses

import pytest

from control_plane.config import ControlPlaneConfig, build_parser, config_from_args
from control_plane.errors import ConfigError
from control_plane.server import main
from conventions.auth import Role


@pytest.fixture
def valid(token_file) -> ControlPlaneConfig:
    return ControlPlaneConfig(redis_url="redis://127.0.0.1:6379/0", admin_token_file=token_file)


@pytest.mark.parametrize(("change", "message"), [
    ({"redis_url": "127.0.0.1:6379"}, "--redis-url"),
    ({"port": 70000}, "not a TCP port"),
    ({"key_prefix": "a:b"}, "--key-prefix"),
    ({"replica_id": "r|1"}, "--replica-id"),
    ({"tls_key": "/nonexistent/key.pem"}, "--tls-key needs --tls-cert"),
    ({"admin_token_file": "/nonexistent/token"}, "is not a readable file"),
    ({"pod_lease_ttl": 0}, "--pod-lease-ttl must be positive"),
    ({"max_load_attempts": 0}, "at least 1"),
    ({"pod_probe_after": -1.0}, "--pod-probe-after must be 0"),
    ({"pod_probe_after": float("nan")}, "--pod-probe-after must be 0"),
    ({"pod_probe_timeout": 0.0}, "--pod-probe-timeout must be positive"),
    ({"pod_lost_after": -1.0}, "--pod-lost-after must be 0"),
    ({"pod_lost_after": float("nan")}, "--pod-lost-after must be 0"),
    ({"pod_lost_after": 2.0}, r"--pod-lost-after \(2.0\) must be at least --pod-probe-after \(3.0\)"),
    ({"replica_high_rate": -1.0}, "--replica-high-rate must be >= 0"),
    ({"replica_high_rate": float("nan")}, "--replica-high-rate"),
    ({"replica_low_rate": 5.0}, "--replica-low-rate must be >= 0 and below the high rate"),
    ({"replica_low_rate": -0.5}, "--replica-low-rate"),
    ({"replica_hold": -1.0}, "--replica-hold"),
    ({"max_replicas": -2}, "--max-replicas"),
])
def test_invalid_settings_are_refused_naming_what_to_fix(valid, change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(valid, **change)


def test_flags_build_the_config(token_file):
    args = build_parser().parse_args(["--redis-url", "redis://r:1/2", "--host", "127.0.0.1", "--port", "5",
                                      "--metrics-port", "6", "--admin-token-file", str(token_file),
                                      "--key-prefix", "fleet", "--base-model", "m", "--pod-probe-after", "2.5",
                                      "--pod-probe-timeout", "0.5", "--pod-lost-after", "6"])
    config = config_from_args(args)
    assert (config.redis_url, config.host, config.port, config.metrics_port, config.key_prefix, config.base_model) \
        == ("redis://r:1/2", "127.0.0.1", 5, 6, "fleet", "m")
    assert (config.pod_probe_after, config.pod_probe_timeout, config.pod_lost_after) == (2.5, 0.5, 6.0)
    assert config.replica  # defaults to hostname-pid
    assert config.replica_policy() is not None  # replication is on by default


def test_replica_flags_build_the_policy_and_a_high_rate_of_zero_turns_replication_off(token_file):
    base = ["--redis-url", "redis://r:1/2", "--admin-token-file", str(token_file)]
    policy = config_from_args(build_parser().parse_args(
        [*base, "--replica-high-rate", "8", "--replica-low-rate", "2", "--replica-hold", "30",
         "--max-replicas", "3"])).replica_policy()
    assert (policy.high_rate, policy.low_rate, policy.hold_s, policy.max_replicas) == (8.0, 2.0, 30.0, 3)
    off = config_from_args(build_parser().parse_args([*base, "--replica-high-rate", "0", "--replica-low-rate", "0"]))
    assert off.replica_policy() is None


def test_main_reports_a_bad_flag_value_and_exits_2(token_file, capsys):
    assert main(["--redis-url", "localhost", "--admin-token-file", str(token_file)]) == 2
    assert "must start with redis://" in capsys.readouterr().err


def test_each_role_reads_its_own_token_and_the_pod_token_defaults_to_the_admin_one(token_file, tmp_path):
    (tmp_path / "reader").write_text("r\n"), (tmp_path / "pod").write_text("p\n")
    one = ControlPlaneConfig(redis_url="redis://127.0.0.1:6379/0", admin_token_file=token_file)
    admin = token_file.read_text().strip()
    assert one.role_tokens() == {Role.ADMIN: admin, Role.POD: admin}
    args = build_parser().parse_args(["--redis-url", "redis://127.0.0.1:6379/0", "--admin-token-file", str(token_file),
                                      "--reader-token-file", str(tmp_path / "reader"), "--pod-token-file",
                                      str(tmp_path / "pod")])
    assert config_from_args(args).role_tokens() == {Role.ADMIN: admin, Role.READER: "r", Role.POD: "p"}
    with pytest.raises(ConfigError, match="not a readable file"):
        ControlPlaneConfig(redis_url="redis://127.0.0.1:6379/0", admin_token_file=token_file,
                           pod_token_file=tmp_path / "absent")

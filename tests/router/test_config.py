"""The router's flags: each bad value is refused with a message naming the flag and what to give."""

from __future__ import annotations

import pytest

from cli.main import main as lorafleet
from conventions.errors import ConfigError
from router.config import RouterConfig, build_parser, config_from_args
from router.server import main


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("t0ken\n")
    return path


def test_flags_build_the_config(token_file, tmp_path):
    args = build_parser().parse_args(["--admin-token-file", str(token_file), "--port", "6000", "--metrics-port", "0",
                                      "--control-plane", "cp.local:7000", "--refresh-interval", "0.25",
                                      "--retries", "0"])
    config = config_from_args(args)
    assert (config.port, config.metrics_port, config.control_plane) == (6000, 0, "cp.local:7000")
    assert (config.refresh_interval, config.retries, config.control_plane_dialer().root) == (0.25, 0, None)


def test_routing_is_at_most_one_second_stale_by_default(token_file):
    assert RouterConfig(admin_token_file=token_file).refresh_interval <= 1.0


@pytest.mark.parametrize(("change", "words"), [
    ({"port": 0}, "--port 0 is not a TCP port"),
    ({"metrics_port": 70000}, "--metrics-port 70000"),
    ({"host": ""}, "--host must not be empty"),
    ({"control_plane": "no-port"}, "must be host:port"),
    ({"control_plane": "h:99999"}, "must be host:port"),
    ({"refresh_interval": 0}, "--refresh-interval must be within"),
    ({"state_timeout": -1}, "--state-timeout must be within"),
    ({"retries": -1}, "--retries must be within 0-10"),
    ({"retries": 11}, "--retries must be within 0-10"),
    ({"http_port": 65536}, "--http-port 65536 is not a TCP port"),
    ({"http_max_body_bytes": 10}, "--http-max-body-bytes must be within"),
    ({"prefix_weight": -1.0}, r"--prefix-weight must be within \[0, 1000\] running requests, got -1.0"),
    ({"prefix_weight": float("nan")}, "--prefix-weight must be within"),
    ({"prefix_weight": 1001.0}, "--prefix-weight must be within"),
    ({"load_bound": -0.1}, r"--load-bound must be within \[0, 100\] \(0: no bound\), got -0.1"),
    ({"load_bound": float("nan")}, "--load-bound must be within"),
    ({"share_bound": -0.1}, r"--share-bound must be within \[0, 100\] \(0: no bound\), got -0.1"),
    ({"share_bound": float("nan")}, "--share-bound must be within"),
    ({"share_bound": 101.0}, "--share-bound must be within"),
])
def test_a_bad_value_is_refused_with_what_to_fix(token_file, change, words):
    with pytest.raises(ConfigError, match=words):
        RouterConfig(admin_token_file=token_file, **change)


def test_missing_files_and_a_ca_without_a_certificate_are_refused(token_file, tmp_path):
    with pytest.raises(ConfigError, match="--admin-token-file .* is not a readable file"):
        RouterConfig(admin_token_file=tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"--control-plane-ca .*: cannot read it \(No such file or directory\)"):
        RouterConfig(admin_token_file=token_file, control_plane_ca=tmp_path / "absent.pem")
    with pytest.raises(ConfigError, match="--control-plane-ca .* holds no PEM certificate"):
        RouterConfig(admin_token_file=token_file, control_plane_ca=token_file)


def test_the_http_api_takes_its_port_keys_and_body_limit_from_flags(token_file, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# one key a line\nsk-one\n\n  sk-two  \n")
    config = config_from_args(build_parser().parse_args([
        "--admin-token-file", str(token_file), "--http-port", "0", "--api-key-file", str(keys),
        "--http-max-body-bytes", "2048"]))
    assert (config.http_port, config.http_max_body_bytes, config.api_keys()) == (0, 2048, {"sk-one", "sk-two"})
    assert RouterConfig(admin_token_file=token_file).api_keys() == frozenset()


def test_a_key_file_without_keys_or_with_a_spaced_key_is_refused(token_file, tmp_path):
    keys = tmp_path / "keys"
    for text in ("# only a comment\n", "sk one\n"):
        keys.write_text(text)
        with pytest.raises(ConfigError, match="--api-key-file .* must hold one key a line"):
            RouterConfig(admin_token_file=token_file, api_key_file=keys).api_keys()
    with pytest.raises(ConfigError, match="--api-key-file .* is not a readable file"):
        RouterConfig(admin_token_file=token_file, api_key_file=tmp_path / "absent")


def test_main_reports_a_bad_flag_in_one_line_and_exits_2(token_file, capsys):
    assert main(["--admin-token-file", str(token_file), "--retries", "-1"]) == 2
    assert capsys.readouterr().err == "lorafleet router: --retries must be within 0-10, got -1\n"


def test_an_empty_token_file_is_refused_before_serving(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert main(["--admin-token-file", str(empty), "--port", "1", "--metrics-port", "0"]) == 2
    assert "must hold one token" in capsys.readouterr().err


def test_lorafleet_router_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        lorafleet(["router", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--metrics-port", "--control-plane", "--admin-token-file",
                 "--refresh-interval", "--retries", "--http-port", "--api-key-file", "--http-max-body-bytes"):
        assert flag in out


def test_tenant_and_credential_flags_are_checked(token_file, tmp_path):
    tenants = tmp_path / "tenants.json"
    tenants.write_text('{"tenants": []}')
    args = build_parser().parse_args(["--reader-token-file", str(token_file), "--tenants-file", str(tenants),
                                      "--limits-redis-url", "redis://127.0.0.1:6379/0", "--keys-reload-interval",
                                      "0.5", "--http-timeout", "30"])
    config = config_from_args(args)
    assert (config.token_file, config.tenants_file, config.keys_reload_interval, config.http_timeout) == (
        token_file, tenants, 0.5, 30.0)
    bad = [({"admin_token_file": token_file, "reader_token_file": token_file}, "exactly one"),
           ({}, "exactly one"),
           ({"admin_token_file": token_file, "api_key_file": tenants, "tenants_file": tenants}, "not both"),
           ({"admin_token_file": token_file, "tenants_file": tmp_path / "absent"}, "--tenants-file .* not a readable"),
           ({"admin_token_file": token_file, "limits_redis_url": "127.0.0.1:6379"}, "--limits-redis-url"),
           ({"admin_token_file": token_file, "keys_reload_interval": 0}, "--keys-reload-interval"),
           ({"admin_token_file": token_file, "http_timeout": 0}, "--http-timeout")]
    for fields, words in bad:
        with pytest.raises(ConfigError, match=words):
            RouterConfig(**fields)

"""The pod's flags checked when the config is built: --control-plane-ca (a file that cannot serve as the
control plane's CA is refused with what to give instead), --stall-timeout, and the admission and
fair-share flags."""

from __future__ import annotations

import argparse
import os
import re

import pytest

from conventions.errors import ConfigError
from data_plane.config import DataPlaneConfig, add_arguments
from tests.control_plane.conftest import self_signed_cert


def config(*flags: str) -> DataPlaneConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return DataPlaneConfig.from_args(parser.parse_args(list(flags)))


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("t\n")
    return path


def test_without_the_flag_the_pod_dials_the_control_plane_in_plaintext(token_file):
    pod = config("--control-plane", "cp:50051", "--admin-token-file", str(token_file))
    assert pod.control_plane_ca is None and pod.control_plane_dialer().root is None


@pytest.mark.slow  # runs openssl
def test_the_flag_gives_the_certificates_the_pod_trusts(tmp_path, token_file):
    cert, _ = self_signed_cert(tmp_path)
    pod = config("--control-plane", "cp:50051", "--admin-token-file", str(token_file), "--control-plane-ca", str(cert))
    assert pod.control_plane_dialer().root == cert.read_bytes()


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d / "missing.pem", r"cannot read it \(No such file or directory\)"),
    (lambda d: d, r"cannot read it \(Is a directory\)"),
    pytest.param(lambda d: self_signed_cert(d)[1], "holds no PEM certificate",  # the private key given by mistake
                 marks=pytest.mark.slow),  # runs openssl
])
def test_a_ca_file_that_cannot_be_used_is_refused_when_the_config_is_built(tmp_path, token_file, make, message):
    path = make(tmp_path)
    with pytest.raises(ConfigError, match=rf"--control-plane-ca {re.escape(str(path))}.*{message}"):
        config("--control-plane", "cp:50051", "--admin-token-file", str(token_file), "--control-plane-ca", str(path))


@pytest.mark.slow  # runs openssl
def test_a_ca_without_a_control_plane_is_refused(tmp_path):
    cert, _ = self_signed_cert(tmp_path)
    with pytest.raises(ValueError, match="--control-plane-ca needs --control-plane"):
        config("--control-plane-ca", str(cert))


def test_the_command_line_reports_a_bad_ca_and_exits(tmp_path, token_file, capsys):
    from data_plane.server import main

    with pytest.raises(SystemExit) as exited:
        main(["--control-plane", "cp:50051", "--admin-token-file", str(token_file),
              "--control-plane-ca", str(tmp_path / "missing.pem")])
    assert exited.value.code == 2
    assert f"--control-plane-ca {tmp_path / 'missing.pem'}: cannot read it" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_stall_timeout_that_could_never_or_always_fire_is_refused(value):
    with pytest.raises(ValueError, match="--stall-timeout must be positive"):
        config("--stall-timeout", value)


def test_the_stall_timeout_is_taken_in_seconds():
    assert config("--stall-timeout", "2.5").stall_timeout == 2.5


def test_admission_and_fair_share_flags_build_the_config():
    pod = config("--max-queue-delay", "2.5", "--scheduling-policy", "fcfs", "--adapter-weight", "pirate=3",
                 "--adapter-weight", "shouty=0.5", "--base-model-weight", "2")
    assert (pod.max_queue_delay, pod.scheduling_policy) == (2.5, "fcfs")
    assert pod.fair_share_weights == {None: 2.0, "pirate": 3.0, "shouty": 0.5}
    assert config().fair_share_weights == {None: 1.0} and config().scheduling_policy == "fair"
    assert config("--max-queue-delay", "0").max_queue_delay == 0.0  # no limit


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_max_queue_delay_that_is_not_a_finite_non_negative_number_is_refused(value):
    with pytest.raises(ValueError, match="--max-queue-delay must be a number of seconds >= 0"):
        config("--max-queue-delay", value)


@pytest.mark.parametrize("value", ["-1", "0.5", "1", "nan", "inf"])
def test_an_itl_growth_that_leaves_prefill_no_room_is_refused_with_what_to_give(value):
    with pytest.raises(ValueError, match=r"--itl-growth must be a factor above 1 \(e.g. 1.4\), or 0"):
        config("--itl-growth", value)


def test_the_compute_threads_default_to_every_cpu_the_process_may_run_on():
    assert config().resolved_compute_threads == len(os.sched_getaffinity(0))
    assert config("--compute-threads", "3").resolved_compute_threads == 3


def test_a_negative_compute_thread_count_is_refused_with_what_to_give():
    with pytest.raises(ValueError, match=r"--compute-threads must be >= 0 \(0 = every CPU"):
        config("--compute-threads", "-1")


def test_itl_growth_defaults_to_1_4_and_0_chooses_the_knee():
    assert config().itl_growth == 1.4 and config("--itl-growth", "0").itl_growth == 0.0


@pytest.mark.parametrize(("flag", "words"), [
    ("pirate", "is not NAME=WEIGHT"),
    ("-bad=2", "is not NAME=WEIGHT"),
    ("pirate=heavy", "is not a number"),
    ("pirate=0", "must be a positive number"),
    ("pirate=nan", "must be a positive number"),
])
def test_a_bad_adapter_weight_is_refused_with_what_to_write(flag, words, capsys):
    with pytest.raises(SystemExit) as exited:
        config(f"--adapter-weight={flag}")
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def test_a_base_model_weight_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="weight of the base model must be a positive number"):
        config("--base-model-weight", "0")


def test_the_precision_is_measured_unless_named():
    assert config().dtype == "auto"
    assert config("--dtype", "bfloat16-matmul").dtype == "bfloat16-matmul"
    assert config("--device", "cuda", "--dtype", "float16").dtype == "float16"


@pytest.mark.parametrize(("device", "dtype", "words"), [
    ("cpu", "fast", "--dtype must be one of auto, float32, bfloat16, float16, bfloat16-matmul, not 'fast'"),
    ("cuda", "bfloat16-matmul", "bfloat16-matmul is a CPU precision; on cuda name bfloat16"),
    ("cpu", "float16", "float16 runs on cuda only; on cpu name float32, bfloat16 or bfloat16-matmul"),
])
def test_a_precision_the_device_does_not_run_is_refused_with_what_to_name(device, dtype, words):
    with pytest.raises(ValueError, match=words):
        DataPlaneConfig(model=None, device=device, dtype=dtype)


@pytest.mark.parametrize(("old", "new"), [("float32", "--dtype float32"), ("bfloat16", "--dtype bfloat16-matmul"),
                                          ("auto", "--dtype auto")])
def test_the_folded_cpu_matmul_flag_is_refused_with_the_dtype_that_says_the_same(old, new, capsys):
    with pytest.raises(SystemExit) as exited:
        config("--cpu-matmul", old)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--cpu-matmul was folded into --dtype" in err and f"{new} " in err and f"was --cpu-matmul {old})" in err


def test_the_adapter_source_flags_build_the_fetch_settings(tmp_path):
    c = config("--adapter-source-allow", "s3://adapters", "--adapter-source-allow", "http://127.0.0.1:8000",
               "--adapter-disk-cache-bytes", "1000", "--s3-endpoint-url", "http://minio:9000", "--s3-region",
               "eu-west-1", "--s3-addressing-style", "path", "--hf-endpoint", "http://hub:8080",
               "--hf-token-file", str(tmp_path / "token"))
    s = c.fetch_settings(tmp_path / "default")
    assert s.cache_dir == tmp_path / "default" and s.disk_cache_bytes == 1000
    assert s.policy.allow == ("s3://adapters", "http://127.0.0.1:8000")
    assert (s.s3.endpoint_url, s.s3.region, s.s3.addressing_style) == ("http://minio:9000", "eu-west-1", "path")
    assert (s.hub.endpoint, s.hub.token_file) == ("http://hub:8080", tmp_path / "token")


@pytest.mark.parametrize(("flags", "words"), [
    (("--adapter-source-allow", "ftp"), "is not an allow-list entry"),
    (("--adapter-source-allow", "s3://bucket/prefix"), "is not an allow-list entry"),
    (("--adapter-disk-cache-bytes", "-1"), "--adapter-disk-cache-bytes must be >= 0"),
    (("--s3-endpoint-url", "minio:9000"), "must be an http"),
])
def test_bad_adapter_source_flags_are_refused_with_what_to_write(flags, words):
    with pytest.raises(ValueError, match=words):
        config(*flags)


def test_a_reader_token_needs_the_control_planes_token(token_file):
    assert config("--admin-token-file", str(token_file), "--reader-token-file", str(token_file)).reader_token_file
    with pytest.raises(ValueError, match="--reader-token-file needs --admin-token-file"):
        config("--reader-token-file", str(token_file))


@pytest.mark.parametrize("value", ["-1", "65537"])
def test_a_prefix_report_size_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match=f"--prefix-report-size must be within 0..65536 .*got {value}"):
        config("--prefix-report-size", value)
    assert config("--prefix-report-size", "0").prefix_report_size == 0  # 0 reports none

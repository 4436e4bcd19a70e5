"""What ``lorafleet up`` gives each process it starts, without starting them: a token per role (the admin's for
the commands, the readers' for the router, the pod token between the control plane and the pod), the tenants
file at the router's doors, and flags that rebuild exactly those configs in the child."""

from __future__ import annotations

import io

import pytest

from cli.up.config import StackConfig, StackError
from cli.up.stack import Stack, ensure_token_file
from control_plane.config import build_parser as control_plane_parser
from conventions.flags import from_args, to_argv
from data_plane.config import DataPlaneConfig
from data_plane.config import build_parser as data_plane_parser
from router.config import RouterConfig
from router.config import build_parser as router_parser


@pytest.fixture
def stack(tmp_path):
    tenants = tmp_path / "tenants.json"
    tenants.write_text('{"tenants": []}')
    config = StackConfig(data_dir=tmp_path / "up", tenants_file=tenants)
    for path in (config.resolved_token_file, config.reader_token_file, config.pod_token_file):
        ensure_token_file(path)
    return Stack(config, io.StringIO())


def test_each_role_has_its_own_token_and_the_router_reads_with_the_readers(stack):
    c = stack.config
    cp, pod, router = stack.control_plane_config(), stack.pod_config(), stack.router_config()
    files = {c.resolved_token_file, c.reader_token_file, c.pod_token_file}
    assert len(files) == 3 and len({f.read_text() for f in files}) == 3
    assert (cp.admin_token_file, cp.reader_token_file, cp.pod_token_file) == (c.resolved_token_file,
                                                                              c.reader_token_file, c.pod_token_file)
    assert (pod.admin_token_file, pod.reader_token_file) == (c.pod_token_file, c.reader_token_file)
    assert (router.reader_token_file, router.admin_token_file, router.tenants_file) == (
        c.reader_token_file, None, c.tenants_file)
    assert all(oct(f.stat().st_mode)[-3:] == "600" for f in files)


def test_the_children_rebuild_from_their_flags_the_configs_up_made(stack):
    for config, parser in ((stack.control_plane_config(), control_plane_parser),
                           (stack.pod_config(), data_plane_parser), (stack.router_config(), router_parser)):
        assert from_args(type(config), parser().parse_args(to_argv(config))) == config
    assert isinstance(stack.pod_config(), DataPlaneConfig) and isinstance(stack.router_config(), RouterConfig)


def test_a_missing_tenants_file_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(StackError, match="--tenants-file .* is not a file"):
        StackConfig(data_dir=tmp_path, tenants_file=tmp_path / "absent.json")

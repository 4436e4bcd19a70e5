"""One flags -> config path: every process's flags are made from its config dataclass, each flag named as its
field, and ``to_argv`` gives back the flags that rebuild a config (what ``lorafleet up`` passes)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli.up.config import StackConfig
from cli.up.config import add_arguments as up_arguments
from control_plane.config import ControlPlaneConfig
from control_plane.config import build_parser as control_plane_parser
from conventions.flag_help import DefaultsShown
from conventions.flags import add_options, flag_name, from_args, option, options, to_argv
from data_plane.config import DataPlaneConfig
from data_plane.config import build_parser as data_plane_parser
from router.config import RouterConfig
from router.config import build_parser as router_parser


@dataclass(frozen=True)
class Toy:
    name: str = option("a required flag")
    count: int = option("a number", 3)
    ratio: float = option("a fraction", 0.5, group="more")
    where: Path | None = option("a file (default: none)", None)
    roots: tuple[Path, ...] = option("repeatable (default: none)", ())
    allow: tuple[str, ...] = option("repeatable, named as its field (default: none)", ())
    cache: bool = option("a switch", True)
    kind: str = option("one of two", "a", choices=("a", "b"))
    internal_s: float = 1.0  # no flag


def toy_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=DefaultsShown)
    add_options(p, Toy)
    return p


def test_flags_are_the_fields_names_types_and_defaults():
    args = toy_parser().parse_args(["--name", "x", "--count", "7", "--root", "/a", "--root", "/b", "--allow", "s3",
                                    "--no-cache", "--kind", "b"])
    toy = from_args(Toy, args)
    assert toy == Toy(name="x", count=7, roots=(Path("/a"), Path("/b")), allow=("s3",), cache=False, kind="b")
    assert from_args(Toy, toy_parser().parse_args(["--name", "x"])) == Toy(name="x")
    assert "--internal-s" not in toy_parser().format_help()


def test_a_required_flag_and_a_wrong_choice_are_refused(capsys):
    for argv in ([], ["--name", "x", "--kind", "c"]):
        with pytest.raises(SystemExit):
            toy_parser().parse_args(argv)
    assert "invalid choice: 'c'" in capsys.readouterr().err


def test_to_argv_rebuilds_the_config_and_names_only_what_differs_from_the_defaults():
    toy = Toy(name="x", ratio=0.25, where=Path("/f"), roots=(Path("/a"), Path("/b")), cache=False)
    argv = to_argv(toy)
    assert argv == ["--name=x", "--ratio=0.25", "--where=/f", "--root=/a", "--root=/b", "--no-cache"]
    assert from_args(Toy, toy_parser().parse_args(argv)) == toy
    dashed = Toy(name="-x")  # a value that begins with "-" still reads as the flag's value
    assert from_args(Toy, toy_parser().parse_args(to_argv(dashed))) == dashed


def test_what_no_flag_can_say_is_refused_rather_than_dropped():
    @dataclass(frozen=True)
    class Defaulted:
        url: str | None = option("a URL with a default", "redis://a")
        roots: tuple[str, ...] = option("repeatable with a default", ("x",))

    p = argparse.ArgumentParser()
    add_options(p, Defaulted)
    assert from_args(Defaulted, p.parse_args([])) == Defaulted()  # an unrepeated flag keeps its default
    with pytest.raises(ValueError, match="--url: no flag gives None"):
        to_argv(Defaulted(url=None))
    with pytest.raises(ValueError, match="--root: no flag gives an empty roots"):
        to_argv(Defaulted(roots=()))


def test_a_field_a_flag_cannot_carry_is_refused():
    @dataclass(frozen=True)
    class Bad:
        pairs: dict[str, int] = option("no flag type for a dict", None)

    with pytest.raises(TypeError, match="no flag type"):
        options(Bad)


PROCESSES = {"router": (RouterConfig, router_parser), "control plane": (ControlPlaneConfig, control_plane_parser),
             "data plane": (DataPlaneConfig, data_plane_parser),
             "up": (StackConfig, lambda: _parser_of(up_arguments))}


def _parser_of(add) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=DefaultsShown)
    add(p)
    return p


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_every_flag_of_a_process_is_a_config_field_of_the_same_name(process):
    config, parser = PROCESSES[process]
    flags = {flag for action in parser()._actions for flag in action.option_strings
             if action.help != argparse.SUPPRESS} - {"-h", "--help", "--log-level"}
    fields = {o.flag for o in options(config)}
    assert flags - {"--no-" + f[2:] for f in fields} == fields
    for o in options(config):
        assert o.flag in (flag_name(o.field.name), flag_name(o.field.name[:-1]))  # a repeated flag: its singular


def test_a_pods_config_comes_back_from_its_flags(tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * 32)
    pod = DataPlaneConfig(model=tmp_path, control_plane="127.0.0.1:1", admin_token_file=token, max_queue_delay=0.0,
                          adapter_roots=(tmp_path, tmp_path / "b"), adapter_weights=(("pirate", 2.5),),
                          prefix_caching=False, heartbeat_interval=0.5)
    assert from_args(DataPlaneConfig, data_plane_parser().parse_args(to_argv(pod))) == pod

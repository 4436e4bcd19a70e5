"""``--help`` shows every default: each flag of every ``lorafleet`` command (the pod, the control plane,
the router, ``up``, ``generate``, ``model``, the admin commands) whose default is a value states it in
its help, as ``(default: VALUE)`` or in its own words ``(default ...)`` naming the value."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from cli.main import build_parser as cli_parser
from cli.main import main as cli_main
from control_plane.config import build_parser as control_plane_parser
from conventions.flag_help import DefaultsShown, has_default, names_default
from data_plane.config import build_parser as data_plane_parser
from router.config import build_parser as router_parser

_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
             argparse.BooleanOptionalAction)


def every_parser() -> Iterator[argparse.ArgumentParser]:
    """Every parser of the ``lorafleet`` command line, subcommands' included; the servers' own parsers
    before the ``lorafleet`` subcommands that only pass their arguments on to them."""
    pending = [data_plane_parser(), control_plane_parser(), router_parser(), cli_parser()]
    while pending:
        parser = pending.pop(0)
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(dict.fromkeys(action.choices.values()))  # one parser may have aliases


PARSERS: dict[str, argparse.ArgumentParser] = {}
for _parser in every_parser():
    PARSERS.setdefault(_parser.prog, _parser)


def test_every_command_is_covered():
    assert len(PARSERS["lorafleet data-plane"]._actions) > 30  # the pod's own parser, not the pass-through
    expected = {"lorafleet", "lorafleet data-plane", "lorafleet control-plane", "lorafleet router", "lorafleet up",
                "lorafleet generate", "lorafleet model demo", "lorafleet adapters register", "lorafleet pods",
                "lorafleet adapters pin", "lorafleet adapters list"}
    assert expected <= PARSERS.keys()


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_flag_with_a_default_shows_it_in_help(prog):
    parser = PARSERS[prog]
    formatter = parser._get_formatter()
    assert isinstance(formatter, DefaultsShown), f"{prog} --help would not show defaults"
    missing = []
    for action in filter(has_default, parser._actions):
        text = formatter._expand_help(action)
        # a switch may say what its default state does in words; any other flag names its value
        if not names_default(text) or (not isinstance(action, _SWITCHES) and str(action.default) not in text):
            missing.append(f"{'/'.join(action.option_strings)} (default {action.default!r}): {text!r}")
    assert not missing, f"{prog} --help hides defaults:\n" + "\n".join(missing)


def test_a_flag_without_a_default_value_gets_no_default_shown():
    text = " ".join(PARSERS["lorafleet generate"].format_help().split())
    assert "(default: None)" not in text
    assert "--seed SEED seed for reproducible sampling --stop" in text
    assert "--raw send the prompt as is, without the template -h" not in text  # positional order aside
    assert "without the template (default" not in text  # --raw's own default would read "True"


@pytest.mark.parametrize(("argv", "shown"), [
    (["data-plane", "--help"], "most sequences in one step (default: 32)"),
    (["control-plane", "--help"], "(default: 4.0)"),
    (["router", "--help"], "(default: 2)"),
    (["up", "--help"], "(default: 30.0)"),
    (["pods", "--help"], "--json"),
])
def test_lorafleet_help_prints_the_defaults(argv, shown, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 0
    assert shown in " ".join(capsys.readouterr().out.split())

"""How every ``lorafleet`` command's ``--help`` shows a flag's default: a flag whose default is a value
(not None, not suppressed) shows it after its help text, as ``(default: VALUE)``, unless its help
already names its default in its own words ("(default 0: sized from ...)"). A flag whose default is
None says what happens without it in its help, e.g. "(default: the demo model)"."""

from __future__ import annotations

import argparse
import re

_NAMES_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


def names_default(text: str) -> bool:
    """Whether ``text`` speaks of a default (then the formatter adds none of its own)."""
    return bool(_NAMES_DEFAULT.search(text))


class DefaultsShown(argparse.HelpFormatter):
    """argparse's formatter with each flag's default appended to its help (see ``shown_default``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return (action.help or "") + shown_default(action)


def has_default(action: argparse.Action) -> bool:
    """Whether ``action`` is a flag with a default value that its help must show."""
    return bool(action.option_strings) and action.default is not None and action.default is not argparse.SUPPRESS \
        and action.help is not argparse.SUPPRESS


def shown_default(action: argparse.Action) -> str:
    """`` (default: %(default)s)`` for a flag with a default value whose help does not state it already."""
    if not has_default(action) or names_default(action.help or ""):
        return ""
    return " (default: %(default)s)"

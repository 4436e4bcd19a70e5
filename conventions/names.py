"""The naming rule shared by adapters and pods: safe inside Redis keys, URLs and file names."""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

NAME_RULE = "1-64 characters of [A-Za-z0-9._-], starting with a letter or a digit"


def is_valid_name(name: str) -> bool:
    """Whether ``name`` follows ``NAME_RULE``."""
    return _NAME.fullmatch(name) is not None

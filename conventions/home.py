"""Where lorafleet keeps its data on this machine. Torch-free, so that the command line can use it."""

from __future__ import annotations

import os
from pathlib import Path

# The admin token's file name inside the data directory of `lorafleet up`.
TOKEN_FILE_NAME = "admin-token"


def lorafleet_home() -> Path:
    """The data directory: ``$LORAFLEET_HOME``, else ``~/.cache/lorafleet``."""
    return Path(os.environ.get("LORAFLEET_HOME") or Path.home() / ".cache" / "lorafleet")


def up_dir() -> Path:
    """Default data directory of ``lorafleet up``: Redis's append-only file, logs, the admin token."""
    return lorafleet_home() / "up"


def default_token_file() -> Path:
    """Where ``lorafleet up`` writes the admin token, and where the command line looks for it."""
    return up_dir() / TOKEN_FILE_NAME

"""How a lorafleet server process ends: the exit status every ``lorafleet <server>`` command shares."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine

from conventions.errors import LorafleetError


def run_server(prog: str, serve: Callable[[], Coroutine]) -> int:
    """Runs ``serve()`` until it returns (SIGTERM or Ctrl-C, handled inside), and returns the exit
    status: 0; 2 with one line on stderr for a LorafleetError, such as a bad flag value found while
    building the config; 130 for a KeyboardInterrupt that reaches here."""
    try:
        asyncio.run(serve())
    except LorafleetError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0

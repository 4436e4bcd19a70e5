"""The ``lorafleet`` command line: ``up`` as a real child process that starts the whole stack and stops
it without leaving anything behind, the admin commands against a real control plane, and errors as
one line with a non-zero exit status."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.processes import TOKEN, ControlPlaneProcess, RedisServer, free_port, scrape
from cli.main import build_parser, main
from cli.up.child_process import spawn, stop_process
from cli.up.config import StackError
from cli.up.stack import ensure_token_file, pid_file
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "cli.main"]
UP_READY_S = 240  # the pod loads and warms up the model on 2 busy cores
PRESENT_DEMO_ADAPTERS = [n for n in DEMO_ADAPTERS if (demo_adapter_dir(n) / "adapter_model.safetensors").is_file()]


def lorafleet(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _live_processes() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every live process (zombies aside), from /proc."""
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:  # ended while listing
            continue
        if fields[0] != "Z":
            found.append((int(stat_file.parent.name), int(fields[1]), int(fields[2])))
    return found


def survivors(pid: int) -> list[int]:
    """Live processes that are ``pid`` or in the process group it led."""
    return [p for p, _, group in _live_processes() if pid in (p, group)]


def gone(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether ``pid`` and its process group are gone within ``timeout_s`` (a SIGKILL lands asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while survivors(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---- without servers ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_help_up_and_the_admin_commands_never_import_torch():
    code = ("import sys\n"
            "from cli.main import build_parser\n"
            "import cli.up.stack, cli.up.config, cli.admin_commands\n"
            "build_parser().parse_args(['adapters', 'list'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _run_without(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter where importing any of ``blocked`` fails."""
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.slow
def test_remote_generate_runs_without_torch():
    code = (f"from cli.main import main\n"
            f"sys.exit(main(['generate', '--endpoint', '127.0.0.1:{free_port()}', 'hi']))\n")
    done = _run_without(("torch",), code)
    assert done.returncode == 1 and "UNAVAILABLE" in done.stderr, done.stderr


@pytest.mark.slow
def test_the_control_plane_command_needs_neither_the_data_plane_nor_the_kernels():
    done = _run_without(("torch", "data_plane", "kernels"),
                        "from cli.main import main\nsys.exit(main(['control-plane', '--help']))\n")
    assert done.returncode == 0 and "--redis-url" in done.stdout, done.stderr


@pytest.mark.slow
def test_the_router_command_needs_neither_plane_nor_the_kernels():
    # What the router image holds: cli, conventions, router and the stubs (helm/images/router.Dockerfile).
    done = _run_without(("torch", "data_plane", "kernels", "control_plane"),
                        "from cli.main import main\nsys.exit(main(['router', '--help']))\n")
    assert done.returncode == 0 and "--admin-token-file" in done.stdout, done.stderr


def test_generate_renders_the_chat_template_by_default_and_sends_raw_text_on_request():
    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).chat is True
    assert parser.parse_args(["generate", "--chat", "hi"]).chat is True
    assert parser.parse_args(["generate", "--raw", "hi"]).chat is False


def test_a_usage_error_is_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["adapters", "pin"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lorafleet adapters pin: error:"), err


def test_an_unreachable_control_plane_is_one_line_and_exits_1(capsys):
    assert main(["pods", "--control-plane", f"127.0.0.1:{free_port()}", "--token", "t"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lorafleet: UNAVAILABLE: "), err


def test_without_a_token_the_error_says_where_to_give_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path))
    for name in ("LORAFLEET_TOKEN", "LORAFLEET_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["adapters", "list"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no admin token" in err and str(tmp_path / "up" / "admin-token") in err


def test_registering_a_path_that_exists_only_on_the_pods_needs_its_sha256(capsys):
    assert main(["adapters", "register", "x", "file:///data/adapters/shared/x", "--token", "t"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give --sha256" in err, err


def test_the_generated_token_file_is_private_and_kept_across_starts(tmp_path):
    path = ensure_token_file(tmp_path / "up" / "admin-token")
    token = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token.strip()) >= 32
    assert ensure_token_file(path).read_text() == token


@pytest.mark.slow
def test_a_second_up_on_the_same_data_directory_is_refused_and_a_stale_pid_file_is_replaced(tmp_path):
    path = tmp_path / "up.pid"
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        path.write_text(f"{sleeper.pid}\n")
        with pytest.raises(StackError, match="already running"), pid_file(path):
            pass
    finally:
        sleeper.kill()
        sleeper.wait()
    with pid_file(path):  # the holder is gone now
        assert path.read_text().strip() == str(os.getpid())
    assert not path.exists()


@pytest.mark.slow
def test_stopping_a_child_that_ignores_sigterm_kills_its_whole_group(tmp_path):
    # The shell and its background sleep both ignore SIGTERM (ignored signals survive exec).
    proc = spawn(["sh", "-c", "trap '' TERM; sleep 300 & wait"], tmp_path / "child.log")
    time.sleep(0.3)
    started = time.monotonic()
    assert stop_process(proc, timeout_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - started < 10
    assert gone(proc.pid)


# ---- against a real control plane (no model) ---------------------------------------------------------------


@pytest.fixture
def control_plane(tmp_path):
    redis = RedisServer(tmp_path)
    redis.start()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cp = ControlPlaneProcess(redis.url, token_file, tmp_path, "cp", base_model="SmolLM2-135M-Instruct").start()
    try:
        yield cp
    finally:
        cp.stop()
        redis.kill()


@pytest.mark.slow
def test_register_computes_the_sha256_of_a_local_directory_and_unregister_removes_it(control_plane, tmp_path,
                                                                                    monkeypatch, capsys):
    monkeypatch.setenv("LORAFLEET_CONTROL_PLANE", control_plane.target)
    monkeypatch.setenv("LORAFLEET_TOKEN", TOKEN)
    adapter = demo_adapter_dir(PRESENT_DEMO_ADAPTERS[0])
    expected = subprocess.run(["sha256sum", str(adapter / "adapter_model.safetensors")], capture_output=True,
                              text=True, check=True).stdout.split()[0]
    assert main(["adapters", "register", "mine", str(adapter), "--base-model", "SmolLM2-135M-Instruct"]) == 0
    assert main(["adapters", "pin", "mine", "--replicas", "2"]) == 0
    capsys.readouterr()
    assert main(["adapters", "list", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert (listed["name"], listed["source"], listed["sha256"]) == ("mine", f"file://{adapter}", expected)
    assert listed["pinned"] is True and listed["pin_replicas"] == 2
    assert main(["adapters", "list"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["NAME", "PINNED"] and row.split()[:3] == ["mine", "2", "pods"]
    assert main(["adapters", "unregister", "mine"]) == 0
    assert main(["adapters", "unpin", "mine"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lorafleet: NOT_FOUND: "), err


@pytest.mark.slow
def test_a_wrong_token_is_one_line_unauthenticated(control_plane, capsys):
    assert main(["pods", "--control-plane", control_plane.target, "--token", "wrong"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lorafleet: UNAUTHENTICATED: "), err


# ---- lorafleet up -----------------------------------------------------------------------------------------


class Up:
    """``lorafleet up`` as a child process on free loopback ports, in a home directory of its own that
    shares the cached demo model; a thread collects its output."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.cp_port, self.pod_port, self.router_port = free_port(), free_port(), free_port()
        self.router_metrics_port, self.router_http_port = free_port(), free_port()
        self.env = dict(os.environ, LORAFLEET_HOME=str(home), LORAFLEET_CONTROL_PLANE=f"127.0.0.1:{self.cp_port}",
                        LORAFLEET_ENDPOINT=f"127.0.0.1:{self.router_port}", PYTHONUNBUFFERED="1")
        for name in ("LORAFLEET_TOKEN", "LORAFLEET_TOKEN_FILE"):
            self.env.pop(name, None)  # the CLI must find the token file that up writes
        self.args = ["up", "--redis-port", str(free_port()), "--control-plane-port", str(self.cp_port),
                     "--control-plane-metrics-port", str(free_port()), "--pod-port", str(self.pod_port),
                     "--pod-metrics-port", str(free_port()), "--router-port", str(self.router_port),
                     "--router-metrics-port", str(self.router_metrics_port),
                     "--router-http-port", str(self.router_http_port), "--stop-timeout", "20"]
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None

    def start(self) -> Up:
        self.proc = subprocess.Popen([*CLI, *self.args], cwd=REPO, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        return self

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        exited_at = None
        while text not in self.output():
            now = time.monotonic()
            if exited_at is None and self.proc.poll() is not None:
                exited_at = now
            if now > deadline or (exited_at is not None and now - exited_at > 2):  # 2 s to drain the pipe
                raise AssertionError(f"{text!r} not printed within {timeout_s} s (exit status "
                                     f"{self.proc.returncode}):\n{self.output()}")
            time.sleep(0.1)

    def child_pids(self) -> set[int]:
        return {int(pid) for pid in re.findall(r"\bpid (\d+)", self.output())}

    def router_requests(self) -> float:
        """Generate requests the router has forwarded to completion, from its /metrics."""
        return sum(float(line.rsplit(" ", 1)[1]) for line in scrape(self.router_metrics_port).splitlines()
                   if line.startswith("lorafleet_router_requests_total{") and 'outcome="OK"' in line)


@pytest.fixture(scope="module")
def up(demo_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    (home / "models").symlink_to(demo_model_dir.parent)  # the cached demo model, not a second download
    stack = Up(home).start()
    try:
        stack.wait_for("lorafleet is ready", UP_READY_S)
        yield stack
    finally:
        if stack.proc.poll() is None:
            stop_process(stack.proc, timeout_s=60)


@pytest.mark.slow
def test_up_prints_its_endpoints_and_each_demo_adapter_becoming_ready(up):
    out = up.output()
    assert f"control plane  127.0.0.1:{up.cp_port}" in out and f"data-plane pod 127.0.0.1:{up.pod_port}" in out
    assert f"router         127.0.0.1:{up.router_port}" in out
    assert f"OpenAI API     http://127.0.0.1:{up.router_http_port}/v1" in out
    assert f"curl -s http://127.0.0.1:{up.router_http_port}/v1/chat/completions" in out
    token_file, readers, pod = (up.home / "up" / name for name in ("admin-token", "reader-token", "pod-token"))
    assert f"tokens         admin {token_file} (the lorafleet commands), readers {readers} (the router), pod {pod}" \
        in out
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in (token_file, readers, pod))
    assert len({f.read_text() for f in (token_file, readers, pod)}) == 3  # a token per role
    for name in PRESENT_DEMO_ADAPTERS:
        assert f"{name} on local-pod: READY (pinned)" in out
    assert (up.home / "up" / "up.pid").read_text().strip() == str(up.proc.pid)
    assert len(up.child_pids()) == 4  # redis-server, control plane, pod, router


@pytest.mark.slow
def test_adapters_list_shows_the_demo_adapters_pinned_and_ready(up):
    done = lorafleet("adapters", "list", "--json", env=up.env)
    assert done.returncode == 0, done.stderr
    adapters = {a["name"]: a for a in json.loads(done.stdout)}
    assert PRESENT_DEMO_ADAPTERS and set(PRESENT_DEMO_ADAPTERS) <= set(adapters)
    for name in PRESENT_DEMO_ADAPTERS:
        a = adapters[name]
        assert a["pinned"] and a["base_model"] == "SmolLM2-135M-Instruct"
        assert [(p["pod"], p["state"], p["pinned"]) for p in a["placements"]] == [("local-pod", "READY", True)]


@pytest.mark.slow
def test_generate_with_the_pirate_adapter_streams_text_as_it_arrives(up):
    proc = subprocess.Popen([*CLI, "generate", "--adapter", "pirate", "--max-tokens", "24", "Where is the treasure?"],
                            cwd=REPO, env=up.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks = []
    while chunk := proc.stdout.read1(4096):
        chunks.append(chunk)
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    text = b"".join(chunks).decode()
    assert len(chunks) >= 2, "the answer came in one piece, not streamed"
    assert "ahoy" in text.lower() or "arr" in text.lower(), text


@pytest.mark.slow
def test_generate_goes_through_the_router_by_default_and_to_the_pod_with_endpoint(up):
    before = up.router_requests()
    through_router = lorafleet("generate", "--max-tokens", "8", "The sky is", env=up.env, timeout=120)
    assert through_router.returncode == 0 and through_router.stdout.strip(), through_router.stderr
    assert up.router_requests() == before + 1
    direct = lorafleet("generate", "--endpoint", f"127.0.0.1:{up.pod_port}", "--max-tokens", "8", "The sky is",
                       env=up.env, timeout=120)
    assert direct.returncode == 0 and direct.stdout == through_router.stdout, direct.stderr  # greedy: same text
    assert up.router_requests() == before + 1


@pytest.mark.slow
def test_the_printed_openai_example_runs_against_the_router(up):
    out = up.output()
    lines = out[out.index("or in Python, with the openai package:"):].splitlines()[1:]
    code = "\n".join(line[4:] for line in itertools.takewhile(lambda line: line.startswith("    "), lines))
    assert "OpenAI(" in code and "print(" in code, out
    before = up.router_requests()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    assert up.router_requests() == before + 1


@pytest.mark.slow
def test_pods_lists_the_pod_ready_with_its_pinned_adapters(up):
    done = lorafleet("pods", "--json", env=up.env)
    assert done.returncode == 0, done.stderr
    (pod,) = json.loads(done.stdout)
    assert (pod["id"], pod["endpoint"], pod["ready"]) == ("local-pod", f"127.0.0.1:{up.pod_port}", True)
    assert set(pod["pinned_adapters"]) == set(PRESENT_DEMO_ADAPTERS)
    assert pod["precision"] in ("float32", "bfloat16-matmul")  # --dtype auto, resolved on a CPU pod
    table = lorafleet("pods", env=up.env)
    assert table.returncode == 0 and table.stdout.splitlines()[1].startswith("local-pod "), table.stdout


@pytest.mark.slow
def test_an_unknown_adapter_is_one_clear_line_and_a_non_zero_exit(up):
    for args in (("adapters", "pin", "no-such-adapter"), ("generate", "--adapter", "no-such-adapter", "hi")):
        done = lorafleet(*args, env=up.env)
        assert done.returncode == 1
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("lorafleet: NOT_FOUND: "), done.stderr


@pytest.mark.slow
def test_ctrl_c_stops_every_process_up_started_and_removes_its_pid_file(up):
    pids = up.child_pids()
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(timeout=90) == 0
    up.wait_for("lorafleet up: stopped", 5)
    stopping = [line.split(" (pid")[0] for line in up.output().splitlines() if line.startswith("stopping the ")]
    assert stopping == ["stopping the router", "stopping the data-plane pod", "stopping the control plane",
                        "stopping the redis-server"]
    assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid)]
    assert not (up.home / "up" / "up.pid").exists()
    redis_dir = up.home / "up" / "redis"
    assert (redis_dir / "appendonly.aof").is_file() or (redis_dir / "appendonlydir").is_dir()  # Redis 6 or 7


@pytest.mark.slow
def test_killing_up_with_sigkill_still_stops_every_child(demo_model_dir, tmp_path):
    # up cannot clean up after SIGKILL; its children are told by the kernel that their parent died.
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(demo_model_dir.parent)
    stack = Up(home).start()
    children: list[int] = []
    try:
        stack.wait_for("starting the data-plane pod (pid", UP_READY_S)  # redis, control plane and pod spawned
        children = _children_of(stack.proc.pid)
        assert len(children) == 3, children
        stack.proc.kill()
        stack.proc.wait(timeout=10)
        assert all(gone(pid, timeout_s=60) for pid in children), [pid for pid in children if survivors(pid)]
    finally:
        if stack.proc.poll() is None:
            stop_process(stack.proc, timeout_s=60)
        for pid in children:  # orphans now, if the test failed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def _children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    return [p for p, parent, _ in _live_processes() if parent == pid]

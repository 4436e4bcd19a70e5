"""lorafleet's processes on loopback ports, as the benchmarks and the integration tests start them: a
redis-server, control-plane replicas (``python -m control_plane.server``), data-plane pods
(``python -m data_plane.server``, waited on through the gRPC health service), a fleet of all three
and a router in front of a fleet (``python -m router.server``)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc
from lorafleet.v1 import data_plane_admin_pb2 as dpa
from lorafleet.v1 import data_plane_admin_pb2_grpc, generation_pb2_grpc

from cli.admin_client import sha256_of
from cli.up.child_process import find_redis_server, spawn, stop_process, tail, wait_listening, wait_serving
from conventions.auth import bearer_metadata
from conventions.tls import PLAINTEXT, Dialer
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir

REPO = Path(__file__).resolve().parent.parent
TOKEN = "s3cret-token-for-tests"  # what control planes started here, and a fleet's pods, accept
POD_TOKEN = "pod-admin-token-for-tests"
BASE_MODEL = "smollm2-135m"
FLEET_BASE_MODEL = "SmolLM2-135M-Instruct"  # the demo model's directory name, which pods report as their base model


def scrape(port: int) -> str:
    """The Prometheus text a process serves on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def cpu_model() -> str:
    """The CPU's model name, for a benchmark's report."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


# Instruction-set extensions that decide how fast torch's CPU kernels can be, as /proc/cpuinfo names them.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> str:
    """Which of the vector extensions that matter to torch's CPU kernels this CPU has."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(flag for flag in _CPU_FLAGS if flag in have) or "none of " + " ".join(_CPU_FLAGS)
    return "unknown flags"


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds that process ``pid`` (all its threads) has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # after "(comm)", which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime: fields 14 and 15 of stat(5)


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages, for a benchmark's report."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def sample_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text ``text``, 0 when absent."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    key = f"{name}{{{want}}}" if want else name
    for line in text.splitlines():
        if line.rsplit(" ", 1)[0] == key:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float = 60.0, what: str = "condition", failed=None):
    """Polls ``predicate`` until it returns something truthy, and returns that. Fails as soon as ``failed``
    (if given) returns a reason, text saying why the state can no longer come (a call ended, a process
    exited), else after ``timeout_s``: a limit for a state that never comes, generous enough for real
    processes sharing a loaded 2-core machine, not a measure of how long it should take."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        reason = failed() if failed is not None else None
        if reason:
            raise AssertionError(f"{what} will not be reached: {reason}")
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


class RedisServer:
    """A redis-server child process with an append-only file fsynced on every write (unless not
    ``durable``: then it keeps nothing on disk, so that a benchmark measures the registry, not fsync)."""

    def __init__(self, directory: Path, durable: bool = True) -> None:
        self.port = free_port()
        self.dir = directory
        self.durable = durable
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.durable else "no", "--appendfsync", "always", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening("127.0.0.1", self.port, self.proc, 10, what="redis-server")

    def kill(self) -> None:
        """Kills the server without warning (no shutdown save), as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()


class PodProcess:
    """One ``lorafleet data-plane`` child process; its stderr (JSON logs) goes to ``log_path``."""

    def __init__(self, workdir: Path, *extra_args: str, name: str = "pod", token: str = POD_TOKEN,
                 repo: Path = REPO, dialer: Dialer = PLAINTEXT) -> None:
        """``repo``: the checkout whose pod runs (another one's, to compare versions of the pod); ``dialer``:
        how this process dials the pod (TLS, with a certificate, for a pod given --tls-cert)."""
        self.repo = repo
        self.dialer = dialer
        self.port = free_port()
        self.metrics_port = free_port()
        self.token = token
        self.token_file = workdir / f"{name}.token"
        self.token_file.write_text(token + "\n")
        self.log_path = workdir / f"{name}.log"
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                     "--admin-token-file", str(self.token_file), "--pod-id", name, "--drain-grace", "20",
                     *extra_args]
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None
        self.health_seen: list[int] = []  # every distinct health status observed while starting

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> PodProcess:
        self.launch()
        self.wait_serving(timeout_s)
        return self

    def launch(self) -> PodProcess:
        """Starts the process without waiting for it to serve."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.repo != REPO:
            env["PYTHONPATH"] = os.pathsep.join([str(self.repo), str(self.repo / "protos"), env.get("PYTHONPATH", "")])
        self.proc = spawn([sys.executable, "-m", "data_plane.server", *self.args], self.log_path, cwd=self.repo,
                          env=env)
        self.channel = self.dialer.channel(self.address)
        return self

    def wait_serving(self, timeout_s: float) -> None:
        wait_serving(self.channel, self.proc, timeout_s, what="pod", log_tail=self.log_tail, observe=self._observe)

    def _observe(self, status: int) -> None:
        if not self.health_seen or self.health_seen[-1] != status:
            self.health_seen.append(status)

    def log_tail(self, n: int = 40) -> str:
        return tail(self.log_path, n)

    def generation(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def admin(self) -> data_plane_admin_pb2_grpc.DataPlaneAdminStub:
        return data_plane_admin_pb2_grpc.DataPlaneAdminStub(self.channel)

    def auth(self) -> tuple[tuple[str, str]]:
        return bearer_metadata(self.token)

    def state(self) -> dpa.PodState:
        return self.admin().GetState(dpa.GetStateRequest(), metadata=self.auth(), timeout=10)

    def metrics(self) -> str:
        return scrape(self.metrics_port)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of the pod's /metrics, 0 when absent."""
        return sample_value(self.metrics(), name, **labels)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None:
            stop_process(self.proc, timeout_s=30)


class RouterProcess:
    """``python -m router.server`` reading the fleet from ``control_plane``, its OpenAI HTTP API on
    ``http_port``; stderr (JSON logs) goes to ``log_path``. ``door_ca``: the doors serve TLS
    (--door-tls-cert) with a certificate this CA signed; the process's channel and base_url use it."""

    def __init__(self, workdir: Path, control_plane: str, token_file: Path, *extra_args: str,
                 token_flag: str = "--admin-token-file", name: str = "router", door_ca: Path | None = None) -> None:
        self.door_ca = door_ca
        self.port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.log_path = workdir / f"{name}.log"
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                     "--http-port", str(self.http_port),
                     "--control-plane", control_plane, token_flag, str(token_file), *extra_args]
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> RouterProcess:
        self.launch()
        wait_serving(self.channel, self.proc, timeout_s, what="router", log_tail=lambda: tail(self.log_path))
        return self

    def launch(self) -> RouterProcess:
        """Starts the process without waiting for it to serve."""
        self.proc = spawn([sys.executable, "-m", "router.server", *self.args], self.log_path, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.channel = grpc.insecure_channel(self.address) if self.door_ca is None else grpc.secure_channel(
            self.address, grpc.ssl_channel_credentials(self.door_ca.read_bytes()))
        return self

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL, as the ``openai`` client takes it."""
        return f"{'http' if self.door_ca is None else 'https'}://127.0.0.1:{self.http_port}/v1"

    def generation(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of the router's /metrics, 0 when absent."""
        return sample_value(scrape(self.metrics_port), name, **labels)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None:
            stop_process(self.proc, timeout_s=20)


class ControlPlaneProcess:
    """``python -m control_plane.server`` as a child process: with pod leases of ``lease_s`` plus
    ``grace_s`` and a quick leader lease and reconcile interval, so that tests see leases lapse within
    seconds; with none of those flags (the shipped defaults) when ``lease_s`` is None."""

    def __init__(self, redis_url: str, token_file: Path, log_dir: Path, replica: str, port: int | None = None,
                 base_model: str = BASE_MODEL, lease_s: float | None = 1.0, grace_s: float = 1.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port, self.metrics_port = port or free_port(), free_port()
        self.args = [sys.executable, "-m", "control_plane.server", "--redis-url", redis_url, "--host", "127.0.0.1",
                     "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                     "--admin-token-file", str(token_file), "--key-prefix", "it", "--base-model", base_model,
                     "--replica-id", replica]
        if lease_s is not None:
            self.args += ["--pod-lease-ttl", str(lease_s), "--pod-grace", str(grace_s),
                          "--leader-lease-ttl", "1.5", "--reconcile-interval", "0.3"]
        self.args += extra_args
        self.log = log_dir / f"{replica}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ControlPlaneProcess:
        self.proc = spawn(self.args, self.log, cwd=REPO)
        wait_listening("127.0.0.1", self.port, self.proc, 30, what="control plane", log_tail=lambda: tail(self.log))
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop_process(self.proc, timeout_s=20, sig=sig) if self.proc else 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        """The sample ``name`` with exactly ``labels`` (0 when absent)."""
        return sample_value(scrape(self.metrics_port), name, **labels)


def copy_demo_adapters(root: Path) -> Path:
    """``root`` holding a copy of every demo adapter (tests may add broken ones beside them)."""
    for name in DEMO_ADAPTERS:
        shutil.copytree(demo_adapter_dir(name), root / name)
    return root


class Fleet:
    """A redis-server, a control plane and ``pods`` CPU pods (two unless told) on the demo model that
    heartbeat to it. ``pod_args`` are added to every pod's command line and ``control_plane_args`` to the
    control plane's (a flag given again overrides the default); a subclass may route a pod's control-plane
    traffic elsewhere by overriding ``control_plane_for``. Leases and heartbeats are shortened (2 s pod lease
    plus 2 s grace, 0.3 s beats) unless ``shipped_timing``, which runs the control plane's and the pods'
    defaults. ``dialer`` is how this process dials the control plane and the pods (TLS, with a certificate,
    for a fleet given --tls-cert and --tls-ca)."""

    def __init__(self, workdir: Path, adapter_root: Path, *pod_args: str, pods: int = 2,
                 shipped_timing: bool = False, control_plane_args: tuple[str, ...] = (),
                 dialer: Dialer = PLAINTEXT) -> None:
        self.workdir, self.adapter_root, self.pod_args = workdir, adapter_root, pod_args
        self.dialer = dialer
        self.control_plane_args = control_plane_args
        self.shipped_timing = shipped_timing
        self.pod_names = [f"pod-{chr(ord('a') + i)}" for i in range(pods)]
        self.redis = RedisServer(workdir)
        self.token_file = workdir / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.cp: ControlPlaneProcess | None = None
        self.pods: dict[str, PodProcess] = {}

    def start(self) -> Fleet:
        self.redis.start()
        self.start_control_plane()
        for name in self.pod_names:
            self.pods[name] = PodProcess(
                self.workdir, "--control-plane", self.control_plane_for(name),
                *(() if self.shipped_timing else ("--heartbeat-interval", "0.3")),
                "--max-loras", "4", "--max-cpu-loras", "6", "--max-num-seqs", "4", "--num-kv-blocks", "64",
                "--adapter-root", str(self.adapter_root), *self.pod_args, name=name, token=TOKEN,
                dialer=self.dialer).launch()
        for pod in self.pods.values():
            pod.wait_serving(180)
        wait_until(lambda: len(self.pod_ids()) == len(self.pod_names), timeout_s=20, what="every pod registered")
        return self

    def control_plane_for(self, pod_name: str) -> str:
        """The host:port pod ``pod_name`` heartbeats to."""
        return self.cp.target

    def start_control_plane(self, port: int | None = None, replica: str = "cp") -> None:
        """Starts the control plane; a ``replica`` name other than the last one's is a new leader."""
        self.cp = ControlPlaneProcess(self.redis.url, self.token_file, self.workdir, replica, port,
                                      base_model=FLEET_BASE_MODEL, lease_s=None if self.shipped_timing else 2.0,
                                      grace_s=2.0, extra_args=self.control_plane_args).start()
        self.channel = self.dialer.channel(self.cp.target)

    def admin(self) -> pb_grpc.AdapterAdminStub:
        return pb_grpc.AdapterAdminStub(self.channel)

    def auth(self) -> tuple[tuple[str, str]]:
        """Call metadata the control plane accepts."""
        return bearer_metadata(TOKEN)

    def pod_ids(self) -> list[str]:
        """The pods the control plane lists."""
        return [p.id for p in self.admin().ListPods(pb.ListPodsRequest(), metadata=self.auth(), timeout=5).pods]

    def adapter(self, name: str) -> pb.Adapter:
        return self.admin().GetAdapter(pb.GetAdapterRequest(name=name), metadata=self.auth(), timeout=5)

    def register(self, name: str, directory: Path | None = None, sha256: str | None = None) -> pb.Adapter:
        directory = directory or self.adapter_root / name
        return self.admin().RegisterAdapter(pb.RegisterAdapterRequest(
            name=name, source=f"file://{directory}", sha256=sha256 or sha256_of(directory),
            base_model=FLEET_BASE_MODEL), metadata=self.auth(), timeout=5)

    def pin(self, name: str, replicas: int) -> pb.Adapter:
        return self.admin().PinAdapter(pb.PinAdapterRequest(name=name, replicas=replicas), metadata=self.auth(),
                                       timeout=5)

    def placements(self, name: str, state: int = pb.READY) -> set[str]:
        return {p.pod for p in self.adapter(name).placements if p.state == state}

    def pinned_on(self, name: str) -> set[str]:
        """Pods whose own GetState reports ``name`` pinned."""
        return {pod_id for pod_id, pod in self.pods.items() if pod.proc.poll() is None
                and any(a.name == name and a.pinned for a in pod.state().adapters)}

    def stop(self) -> None:
        for pod in self.pods.values():
            pod.stop()
        if self.cp:
            self.cp.stop(signal.SIGKILL)
        self.redis.kill()

"""C++ kernels for CPU pods, compiled on the machine that runs them and called through ctypes.

A CPU pod's hot loops that no library call does well stay in C++ (``kernels/native/*.cpp``): attention
that reads the paged KV cache in place instead of gathering it first. Each source is compiled once per
machine with the C++ compiler on the path (``CXX``, else ``c++``) for the CPU it runs on
(``-march=native``), into a cache folder keyed by the source, the headers beside it (``simd.h``), the
flags and the CPU's model and flags (``LORAFLEET_NATIVE_CACHE``, else ``~/.cache/lorafleet/native``), so a
folder shared between machines never hands one CPU another's instructions. Processes that build at once
each write their own file and rename it into place. Where no compiler is found or the build fails,
``library`` says why and returns None, and the caller keeps its PyTorch path.

Floating point is compiled as written (no ``-ffast-math``, no contraction of a multiply and an add the
source did not fuse itself): a kernel's sums are the order its loops give them, whatever the shapes of the
call, which is what keeps a row's bits whatever shares its step.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("native")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC",
         "-pthread")
BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
_built: dict[str, ctypes.CDLL | None] = {}
_why: dict[str, str] = {}


def library(name: str) -> ctypes.CDLL | None:
    """``kernels/native/<name>.cpp`` compiled for this CPU and loaded, or None where it cannot be
    (``why_not(name)`` says why). Built once per process and per machine."""
    with _lock:
        if name not in _built:
            try:
                _built[name] = ctypes.CDLL(str(_compiled(name)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _built[name], _why[name] = None, str(exc)
                log.warning("native kernel %s unavailable: %s", name, exc)
        return _built[name]


def why_not(name: str) -> str:
    """Why ``library(name)`` returned None ("" where it did not, or was not asked)."""
    return _why.get(name, "")


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    path = shutil.which(cxx) or shutil.which("g++")
    if path is None:
        raise RuntimeError(f"no C++ compiler found (looked for {cxx!r} and 'g++' on PATH; set CXX)")
    return path


def _cpu() -> str:
    """This CPU's model name and flags, as /proc/cpuinfo gives them (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(dict.fromkeys(keep))


def _cache() -> Path:
    root = os.environ.get("LORAFLEET_NATIVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "lorafleet" / "native"


def _compiled(name: str) -> Path:
    source = SOURCES / f"{name}.cpp"
    cxx = _compiler()
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the sources include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, cxx, *FLAGS, _cpu()]).encode()).hexdigest()[:16]
    target = _cache() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, str(source), "-o", partial], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} could not compile {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    log.info("compiled native kernel %s for this CPU into %s", name, target)
    return target

"""The wheels a bare GPU machine needs before benchmarks/gpu.py runs there, fetched on a machine with
network, and the one command to run there.

    python benchmarks/gpu_wheels.py [--dest build/gpu-wheels] [--carry NAME ...]

The GPU image (Python 3.12, torch, Triton, transformers, peft, ...: IMAGE below) has no network, so
whatever else gpu.py imports must travel as wheels. This script:

1. follows every import of gpu.py and of the project's modules it reaches, statically (``ast``), into
   function bodies and CUDA-only branches too, and keeps the third-party top-level modules;
2. maps them to their distributions as installed here (``importlib.metadata``), drops those the image
   has, adds ``--carry`` ones (a distribution the image has in a version too old), and follows each
   wheel's own requirements the same way;
3. ``pip download``s each at the version installed here (this project's pins), as a binary wheel for
   CPython 3.12 on manylinux x86_64, into ``--dest``; fails when they exceed 64 MiB, what one transfer
   to the GPU machine may carry;
4. prints the command that installs them there (no index, no dependencies resolved) and runs gpu.py.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata as metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
ENTRY = REPO / "benchmarks" / "gpu.py"
LIMIT_BYTES = 64 << 20
PYTHON = "3.12"
# pip matches a manylinux tag exactly: every glibc the GPU image's (2.39) can run, newest first.
PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)), "manylinux2014_x86_64", "manylinux1_x86_64")
# The GPU image's Python packages (its package list, read on a machine running it, 2026-11-17).
IMAGE = frozenset(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())


def _own_file(name: str, siblings: Path) -> Path | None:
    """The project file of module ``name``: under the repository, or beside gpu.py for its bare imports."""
    parts = name.split(".")
    for root in (REPO, REPO / "protos", siblings):
        for path in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
            if path.is_file():
                return path
    return None


def third_party_modules(entry: Path = ENTRY) -> set[str]:
    """Top-level names of the non-project, non-standard-library modules that ``entry`` and every project
    module it imports (transitively, wherever the import statement sits) import."""
    todo, seen, found = [entry], set(), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules, members = [a.name for a in node.names], []
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules, members = [node.module], [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in modules:
                parts = name.split(".")
                if _own_file(name, entry.parent) is None:
                    if parts[0] not in sys.stdlib_module_names and parts[0] != "__future__":
                        found.add(parts[0])
                    continue
                # importing a.b.c runs a/__init__.py and a/b/__init__.py first
                todo += [f for i in range(1, len(parts) + 1) if (f := _own_file(".".join(parts[:i]), entry.parent))]
            todo += [f for name in members if (f := _own_file(name, entry.parent))]  # from a import submodule
    return found


def distributions(modules: set[str]) -> set[str]:
    """The installed distributions providing ``modules``; raises LookupError naming any module none provides."""
    provided = metadata.packages_distributions()
    unknown = sorted(m for m in modules if m not in provided)
    if unknown:
        raise LookupError(f"no installed distribution provides {unknown}: install the project's requirements "
                          "(make setup) before preparing wheels")
    return {canonicalize_name(d) for m in modules for d in provided[m]}


def wheel_requirements(wheel: Path) -> set[str]:
    """The distributions a wheel requires on CPython 3.12 / Linux x86_64, extras left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    env = {**default_environment(), "python_version": PYTHON, "python_full_version": f"{PYTHON}.0",
           "sys_platform": "linux", "platform_machine": "x86_64", "extra": ""}
    needed = set()
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                needed.add(canonicalize_name(req.name))
    return needed


def download(dist: str, dest: Path) -> Path:
    """``dist`` at its version installed here, as a wheel for the GPU image, into ``dest``."""
    spec = f"{dist}=={metadata.version(dist)}"
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           PYTHON, "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d", str(dest), spec]
    subprocess.run(cmd, check=True)
    new = set(dest.glob("*.whl")) - before
    return new.pop() if new else next(dest.glob(f"{dist.replace('-', '_')}-*.whl"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=REPO / "build" / "gpu-wheels", help="where the wheels go")
    parser.add_argument("--carry", action="append", default=[], metavar="NAME",
                        help="a distribution to carry although the image has it (repeatable)")
    args = parser.parse_args()
    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    modules = third_party_modules()
    wanted = {d for d in distributions(modules) if d not in IMAGE} | {canonicalize_name(n) for n in args.carry}
    print(f"gpu.py imports {len(modules)} third-party modules: {', '.join(sorted(modules))}")
    done: dict[str, Path] = {}
    while wanted - done.keys():
        dist = min(wanted - done.keys())
        done[dist] = download(dist, args.dest)
        wanted |= {d for d in wheel_requirements(done[dist]) if d not in IMAGE}
    size = sum(w.stat().st_size for w in done.values())
    for wheel in sorted(done.values()):
        print(f"  {wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB")
    print(f"{len(done)} wheels, {size / 2**20:.1f} MiB in {args.dest}" if done
          else "the GPU image has every distribution gpu.py imports: nothing to carry")
    if size > LIMIT_BYTES:
        sys.exit(f"the wheels take {size / 2**20:.1f} MiB, over the {LIMIT_BYTES >> 20} MiB one transfer to the GPU "
                 "machine may carry: carry fewer (--carry) or split them over two transfers")
    run, where = "python3 benchmarks/gpu.py", "in the repository's root"
    if done:
        dest = args.dest.resolve()
        dest = dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest
        run = (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
               f"/tmp/site {dest}/*.whl && PYTHONPATH=/tmp/site {run}")
        where += f", with {dest} copied along"
    print(f"\non the GPU machine, {where}:\n{run}")


if __name__ == "__main__":
    main()

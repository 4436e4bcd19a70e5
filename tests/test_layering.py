"""The house drawing, checked: each package imports only its own floor and the floors below.

Data plane, from the ground up: kernels → model → lora → engine → the pod (servicers, server,
config, metrics). The control plane stands beside it on the same ground (``conventions``), and so does
the router, which talks to both planes over gRPC only; the CLI and the fleet simulator are on top of all
three. No arrow goes back up, and neither plane imports the other or the router.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("cli", "conventions", "control_plane", "data_plane", "kernels", "router", "fleetsim")

# The floor of a module: the longest prefix listed wins. Higher numbers stand on lower ones.
FLOORS = {
    "conventions": 0,
    "kernels": 1,
    "data_plane.errors": 1,
    "data_plane.model": 2,
    "data_plane.lora": 3,
    "data_plane.engine": 4,
    "data_plane.metrics": 4,  # the pod's one metrics module: the engine records steps in it, servicers read it
    "data_plane": 5,
    "control_plane": 5,
    "router": 5,
    "cli": 6,
    "fleetsim": 6,  # the fleet simulator drives the real placement, plan and router picker
}
# Packages side by side on one floor that must not see each other.
APART = {"data_plane": {"control_plane", "router"}, "control_plane": {"data_plane", "router"},
         "router": {"data_plane", "control_plane"}}


def floor(module: str) -> int:
    best = max((prefix for prefix in FLOORS if module == prefix or module.startswith(prefix + ".")), key=len)
    return FLOORS[best]


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module of ours that ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in OURS}


def _sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for package in OURS for p in (root / package).rglob("*.py"))


def arrows_up(root: Path = ROOT) -> list[str]:
    """One line per import that points up a floor or across the planes."""
    wrong = []
    for path in _sources(root):
        here = _module_name(path, root)
        for target in _imports(path):
            top_here, top_there = here.split(".")[0], target.split(".")[0]
            if top_there in APART.get(top_here, ()):
                wrong.append(f"{here} imports {target}: the planes do not import each other or the router")
            elif floor(target) > floor(here):
                wrong.append(f"{here} (floor {floor(here)}) imports {target} (floor {floor(target)})")
    return wrong


def test_no_module_imports_a_floor_above_its_own_and_the_planes_stay_apart():
    assert arrows_up() == []


def test_every_top_level_package_is_on_a_floor():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert packages == set(OURS), "a new top-level package needs its floor in FLOORS"


@pytest.mark.parametrize(("module", "line", "seen"), [
    ("data_plane/model/llama.py", "from data_plane.engine.engine import Engine", "floor 2) imports"),
    ("kernels/reference.py", "import data_plane.lora.layer", "floor 1) imports"),
    ("control_plane/server.py", "from data_plane.errors import NotReady", "planes do not import"),
    ("router/forwarder.py", "from data_plane.errors import NotReady", "planes do not import"),
    ("data_plane/server.py", "from router.scoring import rank", "planes do not import"),
    ("data_plane/server.py", "    from cli.main import main", "floor 5) imports"),
])
def test_an_arrow_up_is_reported(tmp_path, module, line, seen):
    path = tmp_path / module
    path.parent.mkdir(parents=True)
    path.write_text(f"def f():\n    pass\n{line}\n" if not line.startswith(" ") else f"def f():\n{line}\n")
    assert len(arrows_up(tmp_path)) == 1 and seen in arrows_up(tmp_path)[0]


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ours that ``path`` imports when it runs (``if TYPE_CHECKING:`` blocks aside), a
    ``from package import submodule`` counted as the submodule."""
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                 ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names)
    return found & modules


def import_circles(root: Path = ROOT) -> list[list[str]]:
    """Every set of our modules that import each other round in a circle, at run time."""
    paths = {_module_name(p, root): p for p in _sources(root)}
    graph = {m: _runtime_imports(p, set(paths)) - {m} for m, p in paths.items()}
    order, low, stack, circles = {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return circles


def test_no_modules_import_each_other_in_a_circle():
    assert import_circles() == []


def test_a_circle_is_reported(tmp_path):
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "a.py").write_text("from router.b import f\n")
    (tmp_path / "router" / "b.py").write_text("def f():\n    from router import a\n")
    assert import_circles(tmp_path) == [["router.a", "router.b"]]


def device_branches(root: Path = ROOT) -> list[str]:
    """``module:line`` of each ``forward`` (or ``__call__`` of a model part) in the model, LoRA layers and
    kernels that asks which device a tensor is on: device choices are made once, where a pod builds its
    engine (attention backend, linear path, LoRA backend), never per call."""
    found = []
    for path in _sources(root):
        module = _module_name(path, root)
        if not module.startswith(("data_plane.model", "data_plane.lora", "kernels")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("forward", "__call__"):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Attribute) and inner.attr in ("is_cuda", "is_cpu") or (
                            isinstance(inner, ast.Attribute) and inner.attr == "type"
                            and isinstance(inner.value, ast.Attribute) and inner.value.attr == "device"):
                        found.append(f"{module}:{inner.lineno}")
    return found


def test_no_forward_branches_on_the_device():
    assert device_branches() == []


def test_a_device_branch_in_a_forward_is_reported(tmp_path):
    package = tmp_path / "data_plane" / "model"
    package.mkdir(parents=True)
    (package / "layer.py").write_text("class Layer:\n    def forward(self, x):\n"
                                      "        return x if x.device.type == 'cpu' else x * 2\n")
    assert device_branches(tmp_path) == ["data_plane.model.layer:3"]

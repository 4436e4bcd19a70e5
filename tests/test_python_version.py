"""The oldest supported Python is pyproject.toml's requires-python. Ruff's target-version (which
rejects newer syntax in `make lint`), the README and `make setup`'s check say the same, and the
tests run on at least that Python."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def stated_minimum() -> tuple[int, int]:
    spec = PYPROJECT["project"]["requires-python"]
    m = re.fullmatch(r">=(\d+)\.(\d+)", spec)
    assert m, f"requires-python {spec!r} should be a plain lower bound such as '>=3.11'"
    return int(m[1]), int(m[2])


def make(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    return subprocess.run(["make", "-s", "--no-print-directory", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def test_ruff_targets_the_minimum_python():
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py{}{}".format(*stated_minimum())


def test_readme_states_the_minimum_python():
    stated = re.findall(r"Python (\d+)\.(\d+)\+", (REPO / "README.md").read_text())
    assert stated, "the README should say which Python it needs, as 'Python X.Y+'"
    assert {(int(a), int(b)) for a, b in stated} == {stated_minimum()}


@pytest.mark.slow  # runs make
def test_make_setup_checks_for_the_minimum_python():
    out = make("--eval", "print-py-min: ; @echo $(PY_MIN)", "print-py-min", cwd=REPO)
    assert out.stdout.strip() == "{}.{}".format(*stated_minimum()), out.stderr


@pytest.mark.slow  # runs make
def test_make_setup_stops_before_installing_on_a_python_older_than_the_minimum(tmp_path):
    for name in ("Makefile", "pyproject.toml", "requirements.txt", "requirements-test.txt"):
        shutil.copy(REPO / name, tmp_path / name)
    newer = f"{sys.version_info.major}.{sys.version_info.minor + 1}"  # this interpreter is too old for it
    out = make("setup", f"PY_SYS={sys.executable}", f"PY_MIN={newer}", cwd=tmp_path)
    assert out.returncode != 0
    assert f"lorafleet needs Python {newer} or newer" in out.stderr
    assert not (tmp_path / ".venv").exists()


def test_the_tests_run_on_at_least_the_minimum_python():
    assert sys.version_info[:2] >= stated_minimum()

"""Building the native CPU kernels: once per machine into a cache keyed by source, flags and CPU, and where
no compiler is found or a source does not compile, None with the reason (the caller keeps its PyTorch
path), never an exception at a pod's start-up."""

from __future__ import annotations

import pytest

from kernels import native_build


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native_build, "_built", {})
    monkeypatch.setattr(native_build, "_why", {})
    return tmp_path


def test_a_kernel_is_built_once_per_cpu_and_source(fresh, monkeypatch):
    source = fresh / "src"
    source.mkdir()
    (source / "answer.cpp").write_text('extern "C" int answer() { return 42; }\n')
    monkeypatch.setattr(native_build, "SOURCES", source)
    lib = native_build.library("answer")
    assert lib is not None and lib.answer() == 42
    assert native_build.library("answer") is lib  # once per process
    built = sorted(p.name for p in (fresh / "cache").iterdir())
    assert len(built) == 1 and built[0].startswith("answer-") and built[0].endswith(".so")
    # another CPU (what -march=native compiles for) gets its own build beside the first
    monkeypatch.setattr(native_build, "_built", {})
    monkeypatch.setattr(native_build, "_cpu", lambda: "model name : another CPU\nflags : sse2")
    assert native_build.library("answer").answer() == 42
    assert len([p for p in (fresh / "cache").iterdir() if not p.name.startswith(".")]) == 2


def test_no_compiler_gives_none_and_says_why(fresh, monkeypatch):
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    monkeypatch.setenv("CXX", "no-such-c++")
    assert native_build.library("paged_attention") is None
    assert "no C++ compiler" in native_build.why_not("paged_attention")
    assert "set CXX" in native_build.why_not("paged_attention")


def test_a_source_that_does_not_compile_gives_none_with_the_compilers_message(fresh, monkeypatch):
    source = fresh / "src"
    source.mkdir()
    (source / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(native_build, "SOURCES", source)
    assert native_build.library("broken") is None
    assert "could not compile broken.cpp" in native_build.why_not("broken")
    assert not [p for p in (fresh / "cache").iterdir()]  # no partial file left behind

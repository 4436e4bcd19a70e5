"""Where local adapter files may come from: only directories under the configured adapter roots.

(http(s) sources are downloaded by ``http_source`` into a cache directory, then read from there.)
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from conventions.names import NAME_RULE, is_valid_name
from data_plane.errors import InvalidAdapter, InvalidRequest


def check_adapter_name(name: str) -> None:
    """Raises InvalidRequest unless ``name`` is a valid adapter name (the one rule for every entry point)."""
    if not is_valid_name(name):
        raise InvalidRequest(f"adapter name {name!r} is invalid: use {NAME_RULE}")


def resolve_adapter_dir(name: str, source: str, roots: tuple[Path, ...]) -> Path:
    """The real directory that ``source`` (a path or ``file://`` URL) names, after following
    every symlink, provided it lies under one of ``roots``.

    Raises InvalidAdapter for another scheme, a NUL byte, a path outside the roots (``..``, an
    absolute path elsewhere, a symlink that escapes), or a source that is not a directory.
    """
    if not source:
        raise InvalidAdapter(f"adapter {name!r}: no source given; pass the adapter directory")
    parsed = urlparse(source)
    if parsed.scheme == "file":
        raw = unquote(parsed.path)
    elif parsed.scheme == "":
        raw = source
    else:
        raise InvalidAdapter(
            f"adapter {name!r}: source scheme {parsed.scheme!r} is not supported; use a path or file:// URL "
            "under the pod's adapter roots, or an http(s):// URL"
        )
    if "\x00" in raw:
        raise InvalidAdapter(f"adapter {name!r}: the source {source!r} contains a NUL byte, which no path can hold")
    if not roots:
        raise InvalidAdapter(f"adapter {name!r}: this pod has no adapter roots configured (--adapter-root)")
    real_roots = tuple(Path(os.path.realpath(r)) for r in roots)
    try:
        real = _real_path(Path(raw), real_roots)
    except OSError as e:  # a name too long for the file system, a permission denied
        raise InvalidAdapter(f"adapter {name!r}: cannot read {source!r}: {e.strerror}") from e
    if not any(real == root or root in real.parents for root in real_roots):
        raise InvalidAdapter(
            f"adapter {name!r}: {source!r} resolves to {real}, outside the adapter roots "
            f"({', '.join(str(r) for r in real_roots)}); put the adapter under a root"
        )
    if not _is_dir(real):
        if not Path(raw).is_absolute():
            raise InvalidAdapter(f"adapter {name!r}: no adapter root holds a directory {source!r} "
                                 f"({', '.join(str(r) for r in real_roots)}); expected a PEFT adapter directory")
        raise InvalidAdapter(f"adapter {name!r}: {real} is not a directory (expected a PEFT adapter directory)")
    return real


def _real_path(candidate: Path, real_roots: tuple[Path, ...]) -> Path:
    if not candidate.is_absolute():  # relative: under the first root that holds it
        candidate = next((r / candidate for r in real_roots if (r / candidate).exists()), real_roots[0] / candidate)
    return Path(os.path.realpath(candidate))


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def contained_file(name: str, adapter_dir: Path, filename: str, roots: tuple[Path, ...]) -> Path:
    """``adapter_dir/filename`` after following symlinks; refused if a symlink leads outside the roots."""
    real = Path(os.path.realpath(adapter_dir / filename))
    real_roots = tuple(Path(os.path.realpath(r)) for r in roots)
    if not any(root in real.parents for root in real_roots):
        raise InvalidAdapter(f"adapter {name!r}: {filename} is a symlink to {real}, outside the adapter roots")
    return real

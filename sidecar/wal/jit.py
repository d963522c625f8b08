"""numba compilation for the WAL kernels, with a compile cache that every process, Spark workers included, reuses."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_SOURCES = Path(__file__).resolve().parent


def cache_dir() -> str | None:
    """Where numba keeps compiled kernels: NUMBA_CACHE_DIR if set, None (next to the sources) when their __pycache__
    is writable, else a per-user directory."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    if _writable(_SOURCES / "__pycache__"):
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(base / "walsidecar" / "numba")


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


@functools.cache
def _configure() -> None:
    """Point numba at cache_dir(); the environment variable must be set before numba is first imported."""
    where = cache_dir()
    if where is None:
        return
    os.environ["NUMBA_CACHE_DIR"] = where
    import numba

    # numba read its configuration when it was imported, maybe before this module was.
    numba.config.CACHE_DIR = where


def compiled(fn: F) -> F:
    """fn compiled to machine code on first call (nopython, GIL released), cached on disk for later processes."""
    _configure()
    import numba

    dispatcher = numba.njit(cache=True, nogil=True)(fn)
    drop_stale(dispatcher._cache, f"{fn.__module__}.{fn.__qualname__}")
    return dispatcher  # type: ignore[no-any-return]


@functools.cache
def sources_digest(sources: Path = _SOURCES) -> str:
    """A digest of the sources compiled code is built from: this package and sidecar/lsn.py."""
    digest = hashlib.sha256()
    for path in sorted([*sources.glob("*.py"), sources.parent / "lsn.py"]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def drop_stale(cache: Any, name: str) -> None:
    """Empty a numba cache filled from other sources than these: numba only notices changes to the decorated
    function's own file, not to the constants and helpers it takes from other modules."""
    stamp = Path(cache.cache_path) / f"{name}.sources"
    try:
        if stamp.read_text() == sources_digest():
            return
    except OSError:
        pass
    cache.flush()
    try:
        stamp.write_text(sources_digest())
    except OSError:
        pass  # an unwritable cache: numba will not save there either


def helper(fn: F) -> F:
    """A function that compiled functions call: compiled into each caller, for argument types as seen without
    the constant values (one version, not one per constant passed)."""
    _configure()
    from numba.extending import register_jitable

    return register_jitable(fn)  # type: ignore[no-any-return]

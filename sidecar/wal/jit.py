"""numba compilation for the WAL kernels, with a compile cache that every process, Spark workers included, reuses."""

from __future__ import annotations

import functools
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

    return numba.njit(cache=True, nogil=True)(fn)  # type: ignore[no-any-return]


def helper(fn: F) -> F:
    """A function that compiled functions call: compiled into each caller, for argument types as seen without
    the constant values (one version, not one per constant passed)."""
    _configure()
    from numba.extending import register_jitable

    return register_jitable(fn)  # type: ignore[no-any-return]

"""Crash-safe file writes, shared by the safekeeper's stores, the archive's directory store and the reader auth file.

A leaf: it imports nothing of walsidecar, so that any layer may use it (as neon's `crashsafe` is a library of
its own, not a module of one service). A file reaches its final name only once its bytes are fsynced, and the
rename is made durable by fsyncing the directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


class StorageError(Exception):
    """Misuse of a store, or an I/O failure that leaves stored data in doubt (a failed fsync above all)."""


def fsync_dir(path: Path) -> None:
    """Make creations, renames and deletions inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """All of `view` at `offset`: pwrite may write less than asked."""
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def write_durably(path: Path, data: bytes) -> None:
    """Replace `path` with `data` (mode 0600): temp file, fsync, rename, fsync the directory."""
    # One fixed temp name per file: a crash leaves at most one, which the next write truncates.
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        pwrite_all(fd, memoryview(data), 0)
        try:
            os.fsync(fd)
        except OSError as e:
            # Whatever the errno, ENOSPC included (a thin device): a failed fsync is fatal.
            raise StorageError(f"fsync of {tmp} failed: {e}") from None
    except (OSError, StorageError):
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def synced_temp(path: Path, data: bytes, mode: int = 0o644) -> Iterator[Path]:
    """A new temp file beside `path` holding `data`, fsynced; removed when the block ends (after a rename or
    link to its final name, nothing is left to remove). OSError as the system gives it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A dot name with a random part: listings skip it, and two writers of one key never share a temp file.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            pwrite_all(fd, memoryview(data), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)

"""The disk guard (--max-disk-usage): above the limit a safekeeper stops taking new WAL until it is below again.

It stops reading from the elected proposer's connection, so the proposer sees a slow safekeeper
(it stops sending at its in-flight window) and commits go on with the others; nothing received
is lost, and what was received before the stop is still flushed and acknowledged. A byte limit
counts this safekeeper's WAL files; a percentage, the whole filesystem of the data directory.
It measures as each new segment is begun (so it stops within a segment of the limit), after each
removal, and every second while it holds WAL back.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from sidecar.sizes import DiskLimit


@dataclass(frozen=True)
class DiskUsage:
    """What the guard measured: this safekeeper's WAL files and its filesystem."""

    wal_bytes: int
    fs_used: int
    fs_total: int


def measure(path: Path, wal_bytes: int) -> DiskUsage:
    """The filesystem holding `path`, as df counts it (blocks reserved for root count as used)."""
    st = os.statvfs(path)
    total = st.f_blocks * st.f_frsize
    return DiskUsage(wal_bytes, total - st.f_bfree * st.f_frsize, total)


class DiskGuard:
    """Whether new WAL may be taken; the proposer's connection thread waits in `wait_resumed()` while it may not.

    Thread contract: `update` runs on the loop (the remover) and in a proposer connection's thread
    (a new segment begun), one at a time under the guard's own lock; `active`, `reason` and
    `wait_resumed` may be used from any thread at any time.
    """

    def __init__(self, limit: DiskLimit | None, path: Path) -> None:
        self.limit, self.path = limit, path
        self.usage = DiskUsage(0, 0, 0)
        self.reason: str | None = None  # why WAL is refused now; None: it is taken
        self._resumed = threading.Event()
        self._resumed.set()
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.reason is not None

    def update(self, wal_bytes: int, holder: str) -> bool:
        """Measure again; `holder` says what keeps WAL from being removed. True if the guard flipped."""
        with self._lock:  # one flip is reported once, whichever thread measured it
            return self._update(wal_bytes, holder)

    def _update(self, wal_bytes: int, holder: str) -> bool:
        self.usage = u = measure(self.path, wal_bytes)
        if self.limit is None:
            return False
        if self.limit.percent is not None:
            over = self.limit.exceeded(u.fs_used, u.fs_total)
            what = f"the filesystem of {self.path} is {100 * u.fs_used / max(u.fs_total, 1):.1f}% full"
        else:
            over = self.limit.exceeded(u.wal_bytes, 0)
            what = f"this safekeeper's WAL takes {u.wal_bytes} bytes"
        was = self.active
        if over:
            self.reason = f"disk guard: {what}, above --max-disk-usage {self.limit}; WAL is removed only below " \
                          f"the removal horizon, held by {holder}"
            self._resumed.clear()
        else:
            self.reason = None
            self._resumed.set()
        return over != was

    def wait_resumed(self, timeout: float | None = None) -> bool:
        """Block until WAL may be taken again (True), or `timeout` seconds passed (False)."""
        return self._resumed.wait(timeout)

"""The remover: deletes whole WAL segments below the removal horizon (horizon.py) as positions move.

It waits on the published positions (and on a wake-up when a reader slot moves, a pin is released
or the archive's backup_lsn advances), never on a timer; the storage refuses to delete a segment
a reader or the uploader holds (WalStorage.pin). A reader asking for removed WAL is refused with
58P01 by its cursor (consensus/reading.py), as PostgreSQL refuses a recycled segment. After each
pass the disk guard measures again: only removal lowers what it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Protocol

from sidecar.lsn import format_lsn
from sidecar.metrics import SafekeeperMetrics
from sidecar.safekeeper.diskguard import DiskGuard
from sidecar.safekeeper.horizon import Horizon, removal_horizon
from sidecar.safekeeper.positions import Positions, PositionWatch
from sidecar.safekeeper.slots import Slots
from sidecar.safekeeper.storage import NoWal, Removal, StorageError, WalStorage

# While the guard holds WAL back nothing is written, so nothing wakes the remover when space is
# freed by someone else on the filesystem: measure again this often until it lets WAL in.
GUARD_RECHECK = 1.0


class Removed(Protocol):
    """What the remover needs of the safekeeper."""

    positions: PositionWatch
    slots: Slots
    stats: SafekeeperMetrics
    storage: WalStorage | NoWal
    log: Any


class Remover:
    """One safekeeper's removal task; `horizon` is the latest one computed, for status and metrics.

    Thread contract: `run` and `pass_once` on the event loop; `wake` from any thread; `guard_check`
    on the loop or in the elected proposer's connection thread (a new segment begun), concurrently
    with a pass (the guard serializes its measurements).
    """

    def __init__(self, sk: Removed, guard: DiskGuard, keep_bytes: int | None = None,
                 backup_lsn: Callable[[], int | None] = lambda: None) -> None:
        self.sk, self.guard = sk, guard
        self.keep_bytes = keep_bytes
        self.backup_lsn = backup_lsn  # the archive's uploaded position; None: no archive configured
        self.horizon = Horizon(0, "nothing stored yet")
        self.stopped_by: str | None = None  # what kept the last pass below the horizon
        self.failed: str | None = None  # the last removal error, logged once
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        """Compute the horizon again (a slot moved, a pin was released, backup_lsn advanced); any thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def compute(self, p: Positions) -> Horizon:
        st = self.sk.storage
        if not isinstance(st, WalStorage):
            return Horizon(0, "nothing stored yet")
        slots = {s.name: s.holds for s in self.sk.slots if s.holds}  # 0: no WAL reserved, or invalidated
        return removal_horizon(flush_lsn=p.flush_lsn, commit_lsn=p.commit_lsn, seg_size=st.seg_size,
                               backup_lsn=self.backup_lsn(), slot_lsns=slots, keep_bytes=self.keep_bytes)

    async def run(self) -> None:
        """Remove and guard until cancelled."""
        self._loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            p = self.sk.positions.value
            await self.pass_once(p)
            await self._next(p)

    async def pass_once(self, p: Positions) -> None:
        """Invalidate slots beyond --max-slot-wal-keep-size, remove what the horizon allows now, then let the guard measure."""
        invalidated = self.sk.slots.invalidate_beyond(p.flush_lsn)
        for slot, held in invalidated:
            self.sk.log.warning("reader slot invalidated: it held more WAL than --max-slot-wal-keep-size",
                                slot=slot.name, reader=slot.reader or None, restart_lsn=format_lsn(slot.restart_lsn),
                                flush_lsn=format_lsn(p.flush_lsn), held_bytes=held,
                                max_slot_wal_keep_size=self.sk.slots.limits.max_wal_keep, term=p.term)
        if invalidated:
            # On disk before what it held goes: after a crash it must not come back holding WAL that is gone.
            await self.sk.slots.save()
        h = self.horizon = self.compute(p)
        st = self.sk.storage
        removal = Removal([])
        if isinstance(st, WalStorage):
            first = st.first_lsn()
            if first is not None and first + st.seg_size <= h.lsn:
                try:
                    removal = await asyncio.to_thread(st.remove_below, h.lsn)
                except StorageError as e:
                    # Not fatal here: a failed fsync has failed the storage, and its next write stops
                    # the safekeeper; anything else leaves the segment stored, tried again next time.
                    if str(e) != self.failed:
                        self.sk.log.error("removing WAL failed", error=str(e), horizon=format_lsn(h.lsn), term=p.term)
                    self.failed = str(e)
                    removal = Removal([], "removal failed (see the log)")
            if removal.removed:
                self.sk.stats.wal_removed.inc(len(removal.removed) * st.seg_size)
                self.sk.log.info("removed WAL segments", count=len(removal.removed), first=removal.removed[0],
                                 last=removal.removed[-1], horizon=format_lsn(h.lsn), held_by=h.held_by,
                                 term=p.term, flush_lsn=format_lsn(p.flush_lsn), commit_lsn=format_lsn(p.commit_lsn))
        if removal.stopped_by is not None and removal.stopped_by != self.stopped_by:
            self.sk.log.info("WAL removal waits", reason=removal.stopped_by, horizon=format_lsn(h.lsn), term=p.term)
        self.stopped_by = removal.stopped_by
        self.guard_check(p)

    def guard_check(self, p: Positions) -> None:
        """Let the guard measure now; also called by the server as each new segment is begun."""
        h, st = self.horizon, self.sk.storage
        holder = self.stopped_by or f"{h.held_by} at {format_lsn(h.lsn)}"
        if self.guard.update(st.wal_bytes(), holder):
            if self.guard.active:
                self.sk.log.error("no longer accepting WAL: " + (self.guard.reason or ""), term=p.term,
                                  flush_lsn=format_lsn(p.flush_lsn), horizon=format_lsn(h.lsn), held_by=holder)
            else:
                self.sk.log.warning("accepting WAL again: disk use is below --max-disk-usage",
                                    wal_bytes=self.guard.usage.wal_bytes, term=p.term,
                                    horizon=format_lsn(h.lsn))

    async def _next(self, p: Positions) -> None:
        """Wait until the horizon may have moved: a segment boundary crossed, a cut, or a wake-up."""
        st = self.sk.storage
        seg = st.seg_size if isinstance(st, WalStorage) else 0
        keep = self.keep_bytes or 0

        def key(q: Positions) -> tuple[int, ...]:
            if not seg:
                return (q.flush_lsn > 0,)  # nothing stored yet: the first WAL makes a storage
            return ((q.flush_lsn - 1) // seg, q.commit_lsn // seg, (q.flush_lsn - keep) // seg, q.generation)

        seen = key(p)
        moved = asyncio.ensure_future(self.sk.positions.wait(lambda q: key(q) != seen))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((moved, woken), timeout=GUARD_RECHECK if self.guard.active else None,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (moved, woken):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t

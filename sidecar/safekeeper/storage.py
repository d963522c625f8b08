"""WAL segment files of a safekeeper, laid out as PostgreSQL's pg_wal (docs/protocol.md, "Storage").

A segment being written is `NAME.partial`; it gets its final name only after all of its
bytes were fdatasync'ed, so a final name always means "complete and durable". Positions
are raw byte positions: finding the end of the last valid record is the caller's job.

Beside the WAL directory `wal/`: `wal.spare` (the next segment, zero-filled ahead),
`wal.in-doubt` (after a failed fsync: the last durable position, for the next start to cut
back to) and `wal.verified` (where the start-up check of the record chain resumes).

Timelines are laid out as in the primary's pg_wal: a segment is named with the timeline that
holds its last byte, so the segment holding a switch point carries the new timeline's name (its
bytes below the switch are the old timeline's, as PostgreSQL copies them at a promotion), and
the `.history` file of every timeline after a switch is beside the segments. The old
timeline's copy of that segment is not kept under its own name (PostgreSQL's
`.partial`): the same bytes are served by position from the new timeline's file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.timelines import TimelineHistory
from sidecar.durable import StorageError, fsync_dir, pwrite_all, write_durably
from sidecar.lsn import format_lsn, parse_segment_file_name, segment_file_name
from sidecar.pgrepl import format_timeline_history, history_file_name, timeline_of

MIN_SEGMENT_SIZE = 64 * 1024
MAX_SEGMENT_SIZE = 1024 * 1024 * 1024
MAX_TIMELINE = 0xFFFFFFFF
_ZEROS = memoryview(bytes(1024 * 1024))
_PARTIAL = ".partial"
_IN_DOUBT = "the WAL above the last flush is in doubt: the next start cuts it back there"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# Files beside the WAL directory (not in it: the directory holds segments only).
IN_DOUBT_SUFFIX = ".in-doubt"
_MARKER_SIZE = 512  # one sector: rewritten in place, so a crash leaves the old or the new text
VERIFIED_SUFFIX = ".verified"


class DiskFull(StorageError):
    """A write found no space (ENOSPC/EDQUOT); nothing fsynced before it is in doubt."""


class WalInDoubt(StorageError):
    """An fdatasync of the WAL failed: WAL above the last good flush may not be on disk."""


def is_disk_full(e: BaseException) -> bool:
    """True for a lack of space, the error itself or one that caused it."""
    while e is not None:
        if isinstance(e, DiskFull) or (isinstance(e, OSError) and e.errno in _NO_SPACE):
            return True
        e = e.__cause__  # type: ignore[assignment]
    return False


@dataclass(frozen=True)
class InDoubt:
    """The marker a failed fsync (or any fatal failure) leaves: WAL in [durable_lsn, written_lsn) may be lost."""

    durable_lsn: int
    written_lsn: int
    reason: str


@dataclass
class _File:
    """A stored segment file: its name's timeline and whether it is still `.partial`."""

    tli: int
    partial: bool


@dataclass(eq=False)
class _Open:
    """A segment open for writing; `dirty` means written since its last fdatasync."""

    segno: int
    fd: int
    dirty: bool = False
    final_tli: int = 0  # set when the segment is filled: the timeline its final name gets


@dataclass
class _FlushPlan:
    target: int
    to_sync: list[_Open] = field(default_factory=list)
    done: list[_Open] = field(default_factory=list)
    dir_dirty: bool = False


class SpareSegment:
    """One zero-filled, fdatasync'ed segment file kept ready beside the WAL directory.

    ext4 (and XFS) record fallocate'd blocks as unwritten, so the first fdatasync after writing
    into them must also commit a journal transaction, and concurrent syncs queue behind one
    another's commits. Blocks already written with zeros need none: PostgreSQL and
    pg_receivewal zero-fill their segments for this reason. A thread makes the next spare while
    the current segment fills, so the zeros cost no commit any latency.
    """

    def __init__(self, path: Path, size: int, on_error: Callable[[OSError], None] | None = None) -> None:
        self.path = path
        self._on_error = on_error
        self._tmp = path.with_name(path.name + ".tmp")
        self.size = size
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._stopping = False
        self._ready = False
        self._thread: threading.Thread | None = None
        self._tmp.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if self.path.stat().st_size == size:
                self._ready = True  # left by an earlier run: zeros, fdatasync'ed before its rename
            else:
                self.path.unlink()

    def take(self, dest: Path) -> bool:
        """Rename the spare to `dest` if one is ready, and start making the next one."""
        with self._lock:
            taken = self._ready
            if taken:
                os.rename(self.path, dest)
                self._ready = False
        self.want()
        return taken

    def want(self) -> None:
        """Make a spare in the background unless one is ready."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spare-segment", daemon=True)
            self._thread.start()
        self._wanted.set()

    def stop(self) -> None:
        self._stopping = True
        self._wanted.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stopping:
                return
            with self._lock:
                if self._ready:
                    continue
            try:
                self._make()
            except OSError as e:
                # No spare is not fatal: the next segment is then fallocate'd, and a full disk
                # fails there, before any WAL byte is written. But it is reported now.
                self._tmp.unlink(missing_ok=True)
                if self._on_error is not None:
                    self._on_error(e)

    def _make(self) -> None:
        fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            pos = 0
            while pos < self.size and not self._stopping:
                pos += os.pwrite(fd, _ZEROS[:self.size - pos], pos)
            if self._stopping:
                return
            os.fdatasync(fd)
        finally:
            os.close(fd)
            if self._stopping:
                self._tmp.unlink(missing_ok=True)
        with self._lock:
            os.rename(self._tmp, self.path)
            self._ready = True


class WalPin:
    """A lease on stored WAL: no segment holding `lsn` or above is removed while it is held.

    Taken by whatever reads stored segments outside the writer (a WAL sender, an uploader), so
    that removal never deletes a file under it; `move` follows the reader forward.
    """

    def __init__(self, lock: threading.Lock, pins: set[WalPin], lsn: int, holder: str,
                 on_release: Callable[[], None] | None = None) -> None:
        self._lock, self._pins = lock, pins
        self.lsn, self.holder = lsn, holder
        self._on_release = on_release  # told when held segments may have become removable
        with lock:
            pins.add(self)

    def move(self, lsn: int, seg_size: int) -> None:
        """Hold from `lsn` on instead (only forward); tells the remover when a segment was left."""
        with self._lock:
            old, self.lsn = self.lsn, max(self.lsn, lsn)
        if self.lsn // seg_size != old // seg_size and self._on_release is not None:
            self._on_release()

    def release(self) -> None:
        with self._lock:
            held = self in self._pins
            self._pins.discard(self)
        if held and self._on_release is not None:
            self._on_release()

    def __enter__(self) -> WalPin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class Removal:
    """What `remove_below` deleted, and what stopped it below the LSN asked for (None: nothing did)."""

    removed: list[str]
    stopped_by: str | None = None


class NoWal:
    """The WAL store of a safekeeper never greeted: no segment size yet, so nothing stored or to sync."""

    flush_lsn = write_lsn = 0

    def segments(self) -> list[tuple[int, int, bool]]:
        return []

    def flush(self) -> int:
        return 0

    def pin(self, lsn: int, holder: str, on_release: Callable[[], None] | None = None) -> WalPin:
        return WalPin(threading.Lock(), set(), lsn, holder)  # nothing stored: nothing to hold

    def wal_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class WalStorage:
    """PostgreSQL-format WAL segments in one directory, written contiguously.

    Threads: write() may run while flush() runs in another thread (flush does its fdatasync
    outside the state lock); read() is safe from any thread; open_at(), truncate() and
    close() wait for a running flush. Call open_at() once before the first write.
    """

    def __init__(self, wal_dir: Path, seg_size: int, timeline: int,
                 on_disk_full: Callable[[str], None] | None = None, history: TimelineHistory = ()) -> None:
        _check_seg_size(seg_size)
        _check_timeline(timeline)
        self.wal_dir = Path(wal_dir)
        self._on_disk_full = on_disk_full
        self.seg_size = seg_size
        self._timeline = timeline
        self._history = history
        self._lock = threading.Lock()        # guards every field below
        self._fdatasync_lock = threading.Lock()  # one flush/truncate/close at a time
        self._files: dict[int, _File] = {}
        self._cur: _Open | None = None
        self._done: list[_Open] = []         # filled segments awaiting fdatasync + rename
        self._dir_dirty = False
        self._positioned = False
        self._closed = False
        self._failed: str | None = None
        self._marked = False  # an in-doubt marker was written by this process
        self._pins: set[WalPin] = set()  # leases of readers and uploaders (see remove_below)
        self.wal_dir.mkdir(parents=True, exist_ok=True)
        self._spare = SpareSegment(self._beside(".spare"), seg_size, self._spare_failed)
        if not self.in_doubt_path.exists():
            # Made now, zeroed and synced, so that recording a failed fdatasync later overwrites
            # blocks already on disk: that needs no free space on a full or failing device.
            write_durably(self.in_doubt_path, bytes(_MARKER_SIZE))
        self._scan_dir()
        # Until open_at(), reads may go up to the raw end of the stored files (for the
        # caller's startup scan); nothing is known to be durable yet.
        self._write_lsn = (max(self._files) + 1) * seg_size if self._files else 0
        self._flush_lsn = 0

    # -- positions -----------------------------------------------------------------------

    @property
    def write_lsn(self) -> int:
        """End of the bytes written (not necessarily durable)."""
        return self._write_lsn

    @property
    def flush_lsn(self) -> int:
        """End of the bytes known to be fdatasync'ed (a raw position, maybe mid-record)."""
        return self._flush_lsn

    @property
    def timeline(self) -> int:
        """Timeline used to name segments created (or completed) from now on."""
        return self._timeline

    @timeline.setter
    def timeline(self, value: int) -> None:
        _check_timeline(value)
        with self._lock:
            self._timeline = value

    def name_timeline(self, segno: int) -> int:
        """The timeline that names segment `segno`: the one holding its last byte, as in the primary's pg_wal."""
        return timeline_of(self._history, self._timeline, (segno + 1) * self.seg_size - 1)

    def adopt_timeline(self, timeline: int, history: TimelineHistory) -> None:
        """Follow the primary onto `timeline`: write its `.history` files and rename the segments it names anew.

        Durable on return. A crash in between leaves some segments under their old names, which
        reading by position does not mind, and the next adoption renames them.
        """
        _check_timeline(timeline)
        for i, entry in enumerate(history):
            following = history[i + 1].timeline if i + 1 < len(history) else timeline
            path = self.wal_dir / history_file_name(following)
            content = format_timeline_history(history[:i + 1]).encode()
            with contextlib.suppress(FileNotFoundError):
                if path.read_bytes() == content:
                    continue
            write_durably(path, content)
        with self._fdatasync_lock, self._lock:
            self._check_usable()
            self._timeline, self._history = timeline, history
            open_segs = {s.segno: s for s in self._done + ([self._cur] if self._cur else [])}
            renamed = False
            for segno, f in sorted(self._files.items()):
                want = self.name_timeline(segno)
                seg = open_segs.get(segno)
                if seg is not None and seg.final_tli:
                    seg.final_tli = want
                if f.tli == want:
                    continue
                old = self._path(segno)
                self._files[segno] = _File(want, f.partial)
                try:
                    os.replace(old, self._path(segno))
                except OSError as e:
                    self._failed = f"renaming {old} for timeline {timeline} failed: {e}; {_IN_DOUBT}"
                    raise StorageError(self._failed) from e
                renamed = True
            if renamed:
                fsync_dir(self.wal_dir)

    def history_files(self) -> list[str]:
        """Names of the `.history` files beside the segments."""
        return sorted(e.name for e in os.scandir(self.wal_dir) if e.name.endswith(".history"))

    def segments(self) -> list[tuple[int, int, bool]]:
        """(timeline, segno, partial) of every stored segment file, by segno."""
        with self._lock:
            return [(f.tli, segno, f.partial) for segno, f in sorted(self._files.items())]

    def complete_segment(self, segno: int) -> Path | None:
        """The final-named (complete and durable) file of segment `segno`, or None."""
        with self._lock:
            f = self._files.get(segno)
            return None if f is None or f.partial else self._path(segno)

    def first_lsn(self) -> int | None:
        """Start of the lowest stored segment, or None when nothing is stored."""
        with self._lock:
            return min(self._files) * self.seg_size if self._files else None

    def wal_bytes(self) -> int:
        """Bytes the segment files take in the WAL directory (every file is pre-sized whole)."""
        with self._lock:
            return len(self._files) * self.seg_size

    # -- leases and removal ------------------------------------------------------------------

    def pin(self, lsn: int, holder: str, on_release: Callable[[], None] | None = None) -> WalPin:
        """Hold the segments from `lsn`'s on against removal until the pin is released."""
        return WalPin(self._lock, self._pins, lsn, holder, on_release)

    def remove_below(self, lsn: int) -> Removal:
        """Delete whole segments that end at or below `lsn`, lowest first, each deletion durable.

        Stops at the first segment that is pinned, still open for writing or not yet final-named:
        the stored WAL stays one run without gaps (walcheck.py takes a gap for a lost segment).
        """
        removed: list[str] = []
        while True:
            with self._lock:
                self._check_usable()
                if not self._files:
                    return Removal(removed)
                segno = min(self._files)
                if (segno + 1) * self.seg_size > lsn:
                    return Removal(removed)
                why = self._held(segno)
                if why is not None:
                    return Removal(removed, why)
                path = self._path(segno)
                gone = self._files.pop(segno)  # no reader finds it from now on; writers need not wait
            try:
                path.unlink()
            except OSError as e:  # nothing changed: the segment is still stored, and may still be read
                with self._lock:
                    self._files[segno] = gone
                raise StorageError(f"removing WAL segment {path} failed: {e}") from e
            removed.append(path.name)
            # Outside the state lock (writers go on); before the next deletion, so that a crash
            # leaves the lowest segments gone, never one in the middle.
            self._sync_dir()

    def _held(self, segno: int) -> str | None:
        """Why segment `segno` may not be removed now, or None."""
        if self._files[segno].partial or any(s.segno == segno for s in self._done) or \
                (self._cur is not None and self._cur.segno == segno):
            return "the segment is still being written"
        end = (segno + 1) * self.seg_size
        pins = [p for p in self._pins if p.lsn < end]
        if pins:
            low = min(pins, key=lambda p: p.lsn)
            return f"{low.holder} reads from {format_lsn(low.lsn)}"
        return None

    # -- writing -------------------------------------------------------------------------

    def write(self, lsn: int, data: bytes | bytearray | memoryview) -> None:
        """Append `data` at `lsn`, which must equal write_lsn; durable only after flush()."""
        view = memoryview(data).cast("B")
        with self._lock:
            self._check_usable()
            if not self._positioned:
                raise StorageError("WAL storage: call open_at() before the first write")
            if lsn != self._write_lsn:
                raise StorageError(
                    f"non-contiguous write at {format_lsn(lsn)}: "
                    f"the stored WAL ends at {format_lsn(self._write_lsn)}")
            try:
                while view:
                    view = self._write_piece(view)
            except OSError as e:
                # As in PostgreSQL, a failed WAL write is fatal: bytes past write_lsn may now
                # be neither the old zeros nor the new data. Nothing below flush_lsn is touched.
                where = f"{format_lsn(self._write_lsn)} in {self.wal_dir}"
                if e.errno in _NO_SPACE:
                    self._failed = (f"disk full: no space for WAL at {where} ({e.strerror}); WAL up to "
                                    f"{format_lsn(self._flush_lsn)} is durable; free space, then restart")
                    self._disk_full(self._failed)
                    raise DiskFull(self._failed) from e
                self._failed = f"writing WAL at {where} failed: {e}; {_IN_DOUBT}"
                raise StorageError(self._failed) from e

    def write_span(self) -> tuple[int, int, int] | None:
        """(descriptor, first LSN, end LSN) of the segment open for writing at write_lsn, for a writer
        that writes inside it itself and then calls `wrote` (the compiled stream loop); None when no
        segment is open there or the storage cannot be written (then `write` says why)."""
        with self._lock:
            seg = self._cur
            if seg is None or self._failed is not None or self._closed or not self._positioned:
                return None
            start = seg.segno * self.seg_size
            return seg.fd, start, start + self.seg_size

    def wrote(self, lsn: int, end: int) -> None:
        """The bytes from `lsn`, which was write_lsn, to `end` were written into the segment `write_span`
        gave, short of its end: the same state as `write` leaves."""
        with self._lock:
            self._check_usable()
            seg = self._cur
            if seg is None or lsn != self._write_lsn or not lsn <= end < (seg.segno + 1) * self.seg_size:
                raise StorageError(f"a write in place from {format_lsn(lsn)} to {format_lsn(end)} is not inside "
                                   f"the open segment at {format_lsn(self._write_lsn)}")
            seg.dirty = True
            self._write_lsn = end

    def _write_piece(self, view: memoryview) -> memoryview:
        segno, off = divmod(self._write_lsn, self.seg_size)
        seg = self._cur if self._cur is not None else self._open_for_write(segno)
        self._cur = seg
        n = min(len(view), self.seg_size - off)
        pwrite_all(seg.fd, view[:n], off)
        seg.dirty = True
        self._write_lsn += n
        if off + n == self.seg_size:
            seg.final_tli = self.name_timeline(seg.segno)
            self._done.append(seg)
            self._cur = None
        return view[n:]

    def _open_for_write(self, segno: int) -> _Open:
        if segno in self._files:
            return _Open(segno, self._open_fd(segno))
        tli = self.name_timeline(segno)
        path = self.wal_dir / (segment_file_name(tli, segno, self.seg_size) + _PARTIAL)
        if self._spare.take(path):
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _presize(fd, self.seg_size)
            except OSError:
                os.close(fd)
                path.unlink()
                raise
        self._files[segno] = _File(tli, True)
        self._dir_dirty = True
        return _Open(segno, fd)

    # -- flushing ------------------------------------------------------------------------

    def flush(self) -> int:
        """fdatasync everything written so far, give filled segments their final names; return flush_lsn."""
        with self._fdatasync_lock:
            with self._lock:
                self._check_usable()
                if not self._positioned:
                    return self._flush_lsn
                plan = self._plan_flush()
            # Outside the state lock: the writer keeps appending while the disk works. Only
            # bytes written before the plan was taken are claimed durable.
            self._sync(plan.to_sync)
            if plan.done:
                self._finish_all(plan.done)
            if plan.done or plan.dir_dirty:
                self._sync_dir()
            with self._lock:
                self._flush_lsn = max(self._flush_lsn, plan.target)
                return self._flush_lsn

    def _plan_flush(self) -> _FlushPlan:
        plan = _FlushPlan(self._write_lsn, done=list(self._done), dir_dirty=self._dir_dirty)
        candidates = self._done + ([self._cur] if self._cur is not None else [])
        plan.to_sync = [s for s in candidates if s.dirty or s in plan.done]
        for seg in plan.to_sync:
            seg.dirty = False
        self._dir_dirty = False
        return plan

    def _sync(self, segs: list[_Open]) -> None:
        for seg in segs:
            try:
                os.fdatasync(seg.fd)
            except OSError as e:
                self._fail(f"fdatasync of WAL segment {self._path(seg.segno)} failed: {e}")

    def _sync_dir(self) -> None:
        try:
            fsync_dir(self.wal_dir)
        except OSError as e:
            self._fail(f"fsync of WAL directory {self.wal_dir} failed: {e}")

    def _fail(self, what: str) -> None:
        # After a failed fsync the kernel may have dropped the dirty pages and a retry, or a
        # new process reading the page cache, would "succeed": never trust this view of the
        # WAL again. The marker makes the next start cut the WAL back to what was durable.
        with self._lock:
            self._failed = f"{what}; {self._mark_in_doubt(what)}"
        raise WalInDoubt(self._failed)

    def mark_in_doubt(self, what: str) -> None:
        """After any fatal failure: the next start cuts the WAL back to the last good flush."""
        with self._lock:
            self._mark_in_doubt(what)

    def _mark_in_doubt(self, what: str) -> str:
        durable, written = self._flush_lsn, self._write_lsn
        doubt = f"WAL from {format_lsn(durable)} to {format_lsn(written)} is in doubt"
        if self._marked or not self._positioned:  # unpositioned: nothing was ever flushed here
            return doubt
        self._marked = True
        try:
            self._write_in_doubt(InDoubt(durable, written, what))
            return f"{doubt}; the next start cuts the WAL back to {format_lsn(durable)} (marker {self.in_doubt_path})"
        except (OSError, StorageError) as e:
            return (f"{doubt}; the marker {self.in_doubt_path} could not be written ({e}): reboot the machine "
                    f"before restarting this safekeeper, or remove its WAL above {format_lsn(durable)}")

    def _finish_all(self, done: list[_Open]) -> None:
        """Rename filled, fdatasync'ed segments to their final names and close them."""
        with self._lock:
            for seg in done:
                old = self._path(seg.segno)
                try:
                    os.replace(old, self.wal_dir / segment_file_name(seg.final_tli, seg.segno, self.seg_size))
                except OSError as e:
                    self._failed = f"renaming {old} failed: {e}; {_IN_DOUBT}"
                    raise StorageError(self._failed) from e
                self._files[seg.segno] = _File(seg.final_tli, False)
                self._done.remove(seg)
                os.close(seg.fd)

    # -- reading -------------------------------------------------------------------------

    def read(self, lsn: int, size: int) -> bytes:
        """Stored bytes at [lsn, lsn + size), cut short at write_lsn."""
        if lsn < 0 or size < 0:
            raise ValueError(f"read at {lsn} of {size} bytes")
        with self._lock:
            self._check_open()
            end = min(lsn + size, self._write_lsn)
        pieces = []
        pos = lsn
        while pos < end:
            segno, off = divmod(pos, self.seg_size)
            n = min(end - pos, self.seg_size - off)
            pieces.append(self._read_segment(segno, off, n))
            pos += n
        return b"".join(pieces)

    def _read_segment(self, segno: int, off: int, n: int) -> bytes:
        return read_segment_file(self._open_for_read(segno), off, n)

    def _open_for_read(self, segno: int) -> int:
        for _ in range(2):  # a concurrent flush may rename the file between lookup and open
            with self._lock:
                if segno not in self._files:
                    break
                path = self._path(segno)
            try:
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
        raise StorageError(
            f"WAL segment {segment_file_name(self._timeline, segno, self.seg_size)} "
            f"(from {format_lsn(segno * self.seg_size)}) is not stored in {self.wal_dir}")

    # -- truncation and positioning ------------------------------------------------------

    def open_at(self, lsn: int) -> None:
        """Position the writer at `lsn` and durably discard every stored byte from `lsn` on."""
        self.truncate(lsn)
        self._spare.want()

    def truncate(self, lsn: int) -> None:
        """Cut the WAL at `lsn`: later segments are deleted, the rest of lsn's segment zeroed.

        On return the cut is durable and write_lsn = flush_lsn = lsn. A crash during the
        call leaves a prefix of the old WAL that ends at or after `lsn`.
        """
        with self._fdatasync_lock, self._lock:
            self._check_usable()
            if lsn < 0 or (self._files and lsn > self._write_lsn):
                raise StorageError(
                    f"cannot cut the WAL at {format_lsn(lsn)}: the stored WAL ends at "
                    f"{format_lsn(self._write_lsn)} and a gap cannot be stored")
            try:
                if lsn < self.verified_lsn():
                    # Durably first: the bytes written over the cut were never checked.
                    self.set_verified(lsn - lsn % self.seg_size)
                self._cut(lsn)
            except OSError as e:
                self._failed = f"cutting the WAL at {format_lsn(lsn)} failed: {e}; {_IN_DOUBT}"
                raise StorageError(self._failed) from e

    def _cut(self, lsn: int) -> None:
        cut_segno, off = divmod(lsn, self.seg_size)
        open_segs = {s.segno: s for s in self._done + ([self._cur] if self._cur else [])}
        self._cur, self._done = None, []
        self._finalize_below(cut_segno, open_segs)
        # Delete from the highest down, each deletion durable before the next, and only then
        # zero the tail of the cut segment: a crash at any point leaves a prefix of the old
        # WAL without gaps (as if the cut had not begun), never a gap, which the start-up
        # check takes for a lost segment.
        for segno in sorted((s for s in self._files if s > cut_segno or (s == cut_segno and not off)),
                            reverse=True):
            seg = open_segs.pop(segno, None)
            if seg is not None:
                os.close(seg.fd)
            self._path(segno).unlink()
            del self._files[segno]
            fsync_dir(self.wal_dir)
        if off:
            self._cur = self._cut_segment(cut_segno, off, open_segs.pop(cut_segno, None))
        else:
            fsync_dir(self.wal_dir)
        self._dir_dirty = False
        self._write_lsn = self._flush_lsn = lsn
        self._positioned = True

    def _finalize_below(self, cut_segno: int, open_segs: dict[int, _Open]) -> None:
        """Make every segment before the cut durable and final-named."""
        for segno in sorted(s for s in self._files if s < cut_segno):
            seg = open_segs.pop(segno, None)
            if not self._files[segno].partial and seg is None:
                continue
            # A partial found at startup may hold bytes a crashed process wrote but never
            # synced; they are about to count as flushed.
            fd = seg.fd if seg is not None else self._open_fd(segno)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            tli = seg.final_tli if seg is not None and seg.final_tli else self._files[segno].tli
            os.replace(self._path(segno), self.wal_dir / segment_file_name(tli, segno, self.seg_size))
            self._files[segno] = _File(tli, False)

    def _cut_segment(self, segno: int, off: int, seg: _Open | None) -> _Open:
        """Zero `segno` from `off` on, durably, and make it the `.partial` being written."""
        created = segno not in self._files
        if seg is None:
            seg = self._open_for_write(segno)
        if not self._files[segno].partial:
            # The .partial name first, durably: a crash before the zeros are durable leaves the
            # old bytes (a prefix of the old WAL), never a final-named file ending in zeros,
            # which the start-up check would take for damage.
            tli = self._files[segno].tli
            os.replace(self._path(segno), self.wal_dir / (segment_file_name(tli, segno, self.seg_size) + _PARTIAL))
            self._files[segno] = _File(tli, True)
        fsync_dir(self.wal_dir)
        zero_end = self.seg_size
        if created:
            zero_end = off
        elif self._positioned and self._write_lsn < (segno + 1) * self.seg_size:
            # Past write_lsn this process has only ever left zeros (a failed write is fatal).
            zero_end = max(off, self._write_lsn - segno * self.seg_size)
        pos = off
        while pos < zero_end:
            pos += os.pwrite(seg.fd, _ZEROS[:zero_end - pos], pos)
        os.fdatasync(seg.fd)
        seg.dirty = False
        return seg

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Close every file without flushing (unsynced bytes may be lost, as in a crash)."""
        with self._fdatasync_lock, self._lock:
            if self._closed:
                return
            for seg in self._done + ([self._cur] if self._cur else []):
                os.close(seg.fd)
            self._cur, self._done = None, []
            self._closed = True
        self._spare.stop()

    def __enter__(self) -> WalStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- files beside the WAL directory ----------------------------------------------------

    @property
    def in_doubt_path(self) -> Path:
        return self._beside(IN_DOUBT_SUFFIX)

    def in_doubt(self) -> InDoubt | None:
        """The marker a failed fdatasync left, if any (StorageError if it is unreadable)."""
        try:
            raw = self.in_doubt_path.read_bytes().rstrip(b"\0")
        except FileNotFoundError:
            return None
        if not raw:
            return None  # zeros: no fdatasync ever failed here
        try:
            d = json.loads(raw)
            marker = InDoubt(int(d["durable_lsn"]), int(d["written_lsn"]), str(d["reason"]))
        except (ValueError, KeyError, TypeError) as e:
            raise StorageError(f"{self.in_doubt_path} is unreadable ({e}): it marks WAL in doubt after a failed "
                               f"fdatasync; restore it, or remove this safekeeper's WAL and the file") from e
        if not 0 <= marker.durable_lsn <= marker.written_lsn:
            raise StorageError(f"{self.in_doubt_path}: invalid positions {d}")
        return marker

    def resolve_in_doubt(self, marker: InDoubt) -> None:
        """Cut the WAL at the marker's durable position, durably, then clear the marker."""
        self.truncate(marker.durable_lsn)
        self._overwrite_marker(bytes(_MARKER_SIZE))

    def _write_in_doubt(self, marker: InDoubt) -> None:
        body = json.dumps({"durable_lsn": marker.durable_lsn, "written_lsn": marker.written_lsn,
                           "reason": marker.reason[:300]}).encode()
        self._overwrite_marker(body[:_MARKER_SIZE].ljust(_MARKER_SIZE, b"\0"))

    def _overwrite_marker(self, data: bytes) -> None:
        try:
            fd = os.open(self.in_doubt_path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            write_durably(self.in_doubt_path, data)
            return
        try:
            pwrite_all(fd, memoryview(data), 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def verified_lsn(self) -> int:
        """Where the record chain was last checked up to (0 if never): see walcheck.py."""
        try:
            return int(self._beside(VERIFIED_SUFFIX).read_text().strip(), 16)
        except (FileNotFoundError, ValueError):
            return 0  # unknown: the next start checks everything

    def set_verified(self, lsn: int) -> None:
        write_durably(self._beside(VERIFIED_SUFFIX), f"{lsn:X}\n".encode())

    def segment_files(self) -> list[tuple[int, Path, bool, int]]:
        """(segno, path, partial, size in bytes) of every stored segment file, by segno."""
        with self._lock:
            paths = [(segno, self._path(segno), f.partial) for segno, f in sorted(self._files.items())]
        return [(segno, path, partial, path.stat().st_size) for segno, path, partial in paths]

    def _beside(self, suffix: str) -> Path:
        return self.wal_dir.with_name(self.wal_dir.name + suffix)

    def _disk_full(self, what: str) -> None:
        if self._on_disk_full is not None:
            self._on_disk_full(what)

    def _spare_failed(self, e: OSError) -> None:
        if e.errno in _NO_SPACE:
            self._disk_full(f"disk full: no space for a spare WAL segment in {self.wal_dir.parent} ({e.strerror})")
        elif self._on_disk_full is not None:
            # Not a full disk, but a disk that fails writes is worth a word before the WAL meets it.
            self._on_disk_full(f"making a spare WAL segment in {self.wal_dir.parent} failed: {e}")

    # -- helpers -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"WAL storage {self.wal_dir} is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if self._failed is not None:
            raise StorageError(self._failed)

    def _path(self, segno: int) -> Path:
        f = self._files[segno]
        name = segment_file_name(f.tli, segno, self.seg_size)
        return self.wal_dir / (name + _PARTIAL if f.partial else name)

    def _open_fd(self, segno: int) -> int:
        return os.open(self._path(segno), os.O_RDWR | os.O_CLOEXEC)

    def _scan_dir(self) -> None:
        """Index the segment files present, keeping exactly one file per segment number."""
        found: dict[int, list[_File]] = {}
        for entry in os.scandir(self.wal_dir):
            try:
                tli, segno, partial = parse_segment_file_name(entry.name, self.seg_size)
            except ValueError:
                continue  # .history files and anything else are not segments
            found.setdefault(segno, []).append(_File(tli, partial))
        removed = False
        for segno, files in found.items():
            # A final name is only given after every byte of the segment was fdatasync'ed,
            # so a final file is complete and durable; a .partial beside it (another
            # timeline's copy, or a file put there by hand) can only be older or shorter.
            # Keeping both would make reads ambiguous. Among equals the newest timeline wins.
            files.sort(key=lambda f: segment_file_rank(f.tli, f.partial))
            self._files[segno] = files[-1]
            for stale in files[:-1]:
                name = segment_file_name(stale.tli, segno, self.seg_size)
                (self.wal_dir / (name + _PARTIAL if stale.partial else name)).unlink()
                removed = True
        if removed:
            fsync_dir(self.wal_dir)


def segment_file_rank(tli: int, partial: bool) -> tuple[bool, int]:
    """Which of a segment's files is the one to read: the highest rank. A final name before a .partial (a
    final name is given only once every byte is fdatasynced), then the newest timeline."""
    return not partial, tli


def read_segment_file(fd: int, off: int, n: int) -> bytes:
    """`n` bytes of a segment file at `off`, then close `fd`. A crash while the file was being pre-sized
    leaves its end missing: that reads as zeros."""
    try:
        data = os.pread(fd, n, off)
        while len(data) < n:
            more = os.pread(fd, n - len(data), off + len(data))
            if not more:
                return data + bytes(n - len(data))
            data += more
        return data
    finally:
        os.close(fd)


def _check_seg_size(seg_size: int) -> None:
    if not (MIN_SEGMENT_SIZE <= seg_size <= MAX_SEGMENT_SIZE) or seg_size & (seg_size - 1):
        raise ValueError(
            f"WAL segment size {seg_size} must be a power of two between "
            f"{MIN_SEGMENT_SIZE} and {MAX_SEGMENT_SIZE}")


def _check_timeline(timeline: int) -> None:
    if not 1 <= timeline <= MAX_TIMELINE:
        raise ValueError(f"timeline {timeline} out of range 1..{MAX_TIMELINE}")


def _presize(fd: int, size: int) -> None:
    """Give a new segment its full size up front, reading as zeros, like PostgreSQL's."""
    try:
        # Reserving the blocks now makes a full disk fail here, not in the middle of a write.
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise  # ENOSPC above all: a sparse file would only fail later, mid-write
        os.ftruncate(fd, size)  # a filesystem without fallocate

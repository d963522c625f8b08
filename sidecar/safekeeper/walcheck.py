"""What a safekeeper checks in its stored WAL before it serves, and why it refuses to start.

A final segment name means "complete and fdatasync'ed" (storage.py), so every byte below the
end of the last final-named segment (the durable end, D) must be valid WAL. Checked at start:

1. Layout, from names and sizes only: no segment missing between the first and the last, every
   final-named segment exactly one segment long, a `.partial` below D complete too.
2. Page headers of every page of every segment below D (magic, info bits, the page's own
   address, and at each segment start the system id and segment size). One 40-byte read per
   8 KiB page: about 0.5% of the bytes, so this stays cheap for many GB. PostgreSQL 15 zeroes
   the rest of a segment after an XLOG_SWITCH, headers included, so a segment may end in zeroed
   pages; a zeroed page followed by a written one is damage.
3. The record chain (each record's header, xl_prev link and CRC) from the checkpoint to D.
   The checkpoint (`wal.verified`) is where the previous start's walk ended, rounded down to
   its segment: below it every segment is final-named, and storage never writes below its
   flush position except to cut, which lowers the checkpoint first. So each start re-reads only
   the WAL written since the previous one; bit rot in older segments is caught only where it
   breaks a page header.

Above D lies the tail that a crash may have torn; `record_end` finds where valid WAL ends
there (at start-up, and for every vote and Elected). Nothing is renamed or deleted to repair damage: the
operator decides (docs/operations.md, "A safekeeper refuses to start").
"""

from __future__ import annotations

import os
from pathlib import Path

import google_crc32c

from sidecar.consensus.acceptor import RecordEnd
from sidecar.consensus.state import AcceptorState
from sidecar.lsn import WAL_PAGE_SIZE, format_lsn, segment_file_name
from sidecar.safekeeper.storage import NoWal, WalStorage
from sidecar.wal.format import SizeOfXLogLongPHD, WalFormatError, parse_page_header, validate_page_header
from sidecar.wal.reader import WalReader, find_end_of_wal

TAIL_FINGERPRINT = 1024 * 1024  # bytes before flush_lsn whose CRC a vote reports

_HINT = ("the safekeeper does not start on damaged WAL and changed nothing; stop it, move its data directory "
         "aside and re-create it from a healthy peer (docs/operations.md: \"A safekeeper refuses to start\")")


class StartupError(Exception):
    """The safekeeper must not start; the message says why and what to do."""


def record_end(st: WalStorage | NoWal, state: AcceptorState) -> RecordEnd:
    """End of the last complete record with a valid CRC, and a fingerprint of its bytes."""
    segments = st.segments()
    if not segments:
        return RecordEnd(0)
    assert isinstance(st, WalStorage)
    seg = state.wal_seg_size
    first = segments[0][1] * seg
    # Only a completed segment is known durable (fsynced before its rename), so the walk
    # starts in the last one. A term start is no such anchor: a safekeeper that crashed
    # while catching up below it may hold torn bytes on both sides of it.
    durable = [segno for _, segno, partial in segments if not partial]
    start = durable[-1] * seg if durable else first
    while True:
        end, last = find_end_of_wal(st, start, seg_size=seg, system_id=state.system_id or None)
        if last is not None or start <= first:
            break
        start = max(start - seg, first)  # no record begins here: one spans the whole segment
    if last is None:
        return RecordEnd(first)
    # Fingerprint the last record wherever it lies, even before the last term's start:
    # after a term that wrote nothing it is still what a stale primary must match.
    tail = max(last, end - TAIL_FINGERPRINT)
    return RecordEnd(end, tail, google_crc32c.value(st.read(tail, end - tail)))


def check_stored_wal(st: WalStorage, system_id: int | None) -> int:
    """Check layout, page headers and the record chain below the durable end; return that end.

    Raises StartupError naming the file and LSN of the first damage found.
    """
    seg = st.seg_size
    files = st.segment_files()
    if not files:
        return 0
    finals = [segno for segno, _, partial, _ in files if not partial]
    durable_end = (finals[-1] + 1) * seg if finals else files[0][0] * seg
    _check_layout(files, seg, durable_end)
    for segno, path, _, _ in files:
        if segno * seg < durable_end:
            _check_page_headers(path, segno, seg, system_id)
    start = max(st.verified_lsn(), files[0][0] * seg, seg)  # no WAL record starts at 0
    if start < durable_end:
        _check_chain(st, start, durable_end, system_id)
    return durable_end


def _check_layout(files: list[tuple[int, Path, bool, int]], seg: int, durable_end: int) -> None:
    prev: tuple[int, Path] | None = None
    for segno, path, partial, size in files:
        if prev is not None and segno != prev[0] + 1:
            missing = segment_file_name(_tli(prev[1]), prev[0] + 1, seg)
            raise StartupError(
                f"WAL segment {missing} (from {format_lsn((prev[0] + 1) * seg)}) is missing from {path.parent}: "
                f"{prev[1].name} is followed by {path.name}; {_HINT}")
        prev = (segno, path)
        below = segno * seg < durable_end
        if size == seg or (partial and size < seg and not below):
            continue  # a short .partial at the tail: a crash while it was pre-sized
        state = "cut short" if size < seg else "too long"
        raise StartupError(
            f"WAL segment {path} is {size} bytes, not {seg}: {state} at {format_lsn(segno * seg + min(size, seg))} "
            f"(a {'completed .partial' if partial else 'final-named'} segment holds a whole segment); {_HINT}")


def _check_page_headers(path: Path, segno: int, seg: int, system_id: int | None) -> None:
    base = segno * seg
    zeroed_from: int | None = None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for off in range(0, seg, WAL_PAGE_SIZE):
            raw = os.pread(fd, SizeOfXLogLongPHD, off)
            lsn = base + off
            if not any(raw):
                if off == 0:
                    raise StartupError(f"WAL segment {path} begins with a zeroed page at {format_lsn(lsn)}; {_HINT}")
                zeroed_from = lsn if zeroed_from is None else zeroed_from
                continue
            if zeroed_from is not None:
                raise StartupError(
                    f"WAL segment {path} has a written page at {format_lsn(lsn)} after zeroed pages from "
                    f"{format_lsn(zeroed_from)}; {_HINT}")
            try:
                validate_page_header(parse_page_header(raw), lsn, seg, system_id=system_id)
            except WalFormatError as e:
                raise StartupError(
                    f"WAL segment {path} has a bad page header at {format_lsn(lsn)}: {e}; {_HINT}") from None
    finally:
        os.close(fd)


class _Below:
    """The stored WAL cut off at `end`, so the reader stops there as at the end of the files."""

    def __init__(self, st: WalStorage, end: int) -> None:
        self.st, self.end = st, end

    def read(self, lsn: int, size: int) -> bytes:
        return self.st.read(lsn, min(size, self.end - lsn)) if lsn < self.end else b""


def _check_chain(st: WalStorage, start: int, durable_end: int, system_id: int | None) -> None:
    reader = WalReader(_Below(st, durable_end), start, seg_size=st.seg_size, system_id=system_id)
    for _ in reader.tuples():
        pass
    # The only good way to stop below D is to need bytes past it: a record continuing into the
    # tail, or the end of the last final segment itself.
    if reader.stop_reason.startswith("end of stored WAL"):
        return
    at = reader.stop_lsn
    path = next((p for segno, p, _, _ in st.segment_files() if segno == at // st.seg_size), st.wal_dir)
    raise StartupError(
        f"WAL segment {path} is damaged: the record chain breaks after {format_lsn(at)} "
        f"({reader.stop_reason}), below the end of the completed segments at {format_lsn(durable_end)}; {_HINT}")


def _tli(path: Path) -> int:
    return int(path.name[:8], 16)

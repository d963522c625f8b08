"""Sequential PostgreSQL 15 WAL record reader, following xlogreader.c, and end-of-WAL detection."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import google_crc32c

from sidecar.lsn import DEFAULT_SEGMENT_SIZE, WAL_PAGE_SIZE, format_lsn, maxalign, segment_file_name
from sidecar.wal.format import (
    MAX_RECORD_LENGTH,
    RECORD_HEADER,
    RM_MAX_BUILTIN_ID,
    RM_MIN_CUSTOM_ID,
    RM_XLOG_ID,
    SizeOfXLogLongPHD,
    SizeOfXLogRecord,
    SizeOfXLogShortPHD,
    XLP_LONG_HEADER,
    XLOG_OVERWRITE_CONTRECORD,
    XLOG_SWITCH,
    PageHeader,
    RecordHeader,
    WalFormatError,
    main_data,
    parse_page_header,
    rmid_is_valid,
    validate_page_header,
)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_PAGE = WAL_PAGE_SIZE
_crc_value = google_crc32c.value
_crc_extend = google_crc32c.extend

DEFAULT_READ_SIZE = 1024 * 1024


class WalSource(Protocol):
    """Random access to stored WAL bytes by LSN."""

    def read(self, lsn: int, size: int) -> bytes:
        """Up to size bytes at lsn; fewer (or b"") where the stored WAL ends."""
        ...


@dataclass(frozen=True)
class WalRecord:
    """One valid WAL record; end_lsn is PostgreSQL's EndRecPtr for it."""

    lsn: int
    end_lsn: int
    header: RecordHeader
    data: bytes | None = None


class BytesSource:
    """WAL held in memory, covering [base_lsn, base_lsn + len(data))."""

    def __init__(self, base_lsn: int, data: bytes) -> None:
        self.base_lsn = base_lsn
        self.data = bytes(data)

    def read(self, lsn: int, size: int) -> bytes:
        """Bytes at lsn; nothing before base_lsn or past the end."""
        off = lsn - self.base_lsn
        if off < 0 or size <= 0:
            return b""
        return self.data[off : off + size]


class SegmentDirSource:
    """WAL segment files of one timeline in a directory (pg_wal layout); a `.partial` file is used when no full one exists."""

    def __init__(self, directory: Path | str, timeline: int = 1, seg_size: int = DEFAULT_SEGMENT_SIZE) -> None:
        self.directory = Path(directory)
        self.timeline = timeline
        self.seg_size = seg_size

    def _path(self, segno: int) -> Path | None:
        name = segment_file_name(self.timeline, segno, self.seg_size)
        for candidate in (self.directory / name, self.directory / f"{name}.partial"):
            if candidate.exists():
                return candidate
        return None

    def read(self, lsn: int, size: int) -> bytes:
        """Bytes at lsn, crossing segment files; stops at the first missing file or short read."""
        parts: list[bytes] = []
        while size > 0:
            segno, off = divmod(lsn, self.seg_size)
            path = self._path(segno)
            if path is None:
                break
            want = min(size, self.seg_size - off)
            with open(path, "rb") as f:
                chunk = os.pread(f.fileno(), want, off)
            parts.append(chunk)
            if len(chunk) < want:
                break
            lsn += want
            size -= want
        return b"".join(parts)


@dataclass(frozen=True, slots=True)
class _Aborted:
    """The record being assembled was aborted; the page at page_lsn carries XLP_FIRST_IS_OVERWRITE_CONTRECORD."""

    page_lsn: int


# lsn, end_lsn, tot_len, xid, prev, info, rmid, crc, data
_RawRecord = tuple[int, int, int, int, int, int, int, int, bytes | None]


class WalReader:
    """Iterates the valid WAL records from start_lsn; stops quietly at the end of valid WAL.

    After iteration, stop_lsn is the end of the last valid record (start_lsn if none) and stop_reason says why reading stopped.
    """

    def __init__(
        self,
        source: WalSource,
        start_lsn: int,
        *,
        seg_size: int = DEFAULT_SEGMENT_SIZE,
        keep_data: bool = False,
        expect_prev: int | None = None,
        system_id: int | None = None,
        read_size: int = DEFAULT_READ_SIZE,
    ) -> None:
        if seg_size <= 0 or seg_size & (seg_size - 1) or seg_size < _PAGE:
            raise ValueError(f"segment size {seg_size} is not a power of two of at least {_PAGE}")
        if start_lsn <= 0 or start_lsn != maxalign(start_lsn):
            raise ValueError(f"start LSN {format_lsn(start_lsn)} is not a valid MAXALIGNed position")
        self.source = source
        self.start_lsn = start_lsn
        self.seg_size = seg_size
        self.keep_data = keep_data
        self.expect_prev = expect_prev
        self.system_id = system_id
        self._read_size = max(_PAGE, read_size - read_size % _PAGE)
        self.stop_lsn = start_lsn
        self.stop_reason = "not read yet"
        self.last_record_lsn: int | None = None
        self._reset()

    def _reset(self) -> None:
        self._buf = b""
        self._bstart = 0
        self._bend = 0
        self._latest_page = -1
        self._latest_tli = 0
        self.stop_lsn = self.start_lsn
        self.stop_reason = "not finished"
        self.last_record_lsn = None

    def __iter__(self) -> Iterator[WalRecord]:
        for lsn, end, tot_len, xid, prev, info, rmid, crc, data in self._scan():
            yield WalRecord(lsn, end, RecordHeader(tot_len, xid, prev, info, rmid, crc), data)

    def tuples(self) -> Iterator[tuple[int, int, int, int, int, int, int, int, bytes | None]]:
        """Like iterating, but each record as a plain (lsn, end_lsn, tot_len, xid, prev, info, rmid, crc, data) tuple.

        For bulk decoding, where building a WalRecord per record would cost more than reading it.
        """
        return self._scan()

    # ----- page access -----

    def _load(self, page: int) -> int:
        """Make the page at page resident in the read window; return how many of its bytes are stored."""
        if not self._bstart <= page < self._bend:
            seg_end = page - page % self.seg_size + self.seg_size
            # One read never crosses a segment boundary, so file-per-segment sources stay simple.
            want = min(self._read_size, seg_end - page)
            data = self.source.read(page, want)
            if len(data) > want:
                data = data[:want]
            self._buf = bytes(data)
            self._bstart = page
            self._bend = page + len(self._buf)
        return max(0, min(_PAGE, self._bend - page))

    def _stop(self, reason: str) -> None:
        self.stop_reason = reason

    def _page_header(self, page: int) -> PageHeader | None:
        """Load and validate the header of the page at page; None (with stop_reason set) if unusable."""
        avail = self._load(page)
        j = page - self._bstart
        if avail < SizeOfXLogShortPHD or (avail < SizeOfXLogLongPHD and self._buf[j + 2] & XLP_LONG_HEADER):
            self._stop(f"end of stored WAL at page {format_lsn(page)}")
            return None
        try:
            hdr = parse_page_header(self._buf, j)
        except WalFormatError as exc:
            self._stop(f"{exc} (page {format_lsn(page)})")
            return None
        try:
            validate_page_header(hdr, page, self.seg_size, system_id=self.system_id)
        except WalFormatError as exc:
            self._stop(str(exc))
            return None
        if page > self._latest_page:
            if hdr.tli < self._latest_tli:
                self._stop(f"out-of-sequence timeline ID {hdr.tli} (after {self._latest_tli}) at {format_lsn(page)}")
                return None
        self._latest_page = page
        self._latest_tli = hdr.tli
        return hdr

    # ----- record scanning -----

    def _header_problem(self, lsn: int, tot_len: int, rmid: int, xl_prev: int, expect_prev: int | None) -> str | None:
        where = format_lsn(lsn)
        if tot_len == 0:
            return f"zero record length at {where}"
        if tot_len < SizeOfXLogRecord:
            return f"invalid record length at {where}: wanted {SizeOfXLogRecord}, got {tot_len}"
        if tot_len > MAX_RECORD_LENGTH:
            return f"record length {tot_len} at {where} too long"
        if not rmid_is_valid(rmid):
            return f"invalid resource manager ID {rmid} at {where}"
        if expect_prev is None:
            if not xl_prev < lsn:
                return f"xl_prev mismatch at {where}: prev-link {format_lsn(xl_prev)} is not before the record"
        elif xl_prev != expect_prev:
            return f"xl_prev mismatch at {where}: prev-link {format_lsn(xl_prev)}, expected {format_lsn(expect_prev)}"
        return None

    def _skip_continuation(self, page: int, hdr: PageHeader) -> int | None:
        """Skip the tail of a record begun before start_lsn (XLogFindNextRecord); return where records begin."""
        rem = hdr.rem_len
        if rem == 0:
            self._stop(f"contrecord length mismatch at {format_lsn(page)}: contrecord flag with zero xlp_rem_len")
            return None
        while True:
            space = _PAGE - hdr.size
            if maxalign(rem) < space:
                return page + hdr.size + maxalign(rem)
            page += _PAGE
            expected = rem - space
            if expected <= 0:
                # The continuation filled its page; the next page starts with a record of its own.
                return page
            nxt = self._page_header(page)
            if nxt is None:
                return None
            if nxt.is_overwrite_contrecord and not nxt.is_contrecord:
                # The skipped record was aborted; PostgreSQL resumed writing at this page.
                return page
            if not nxt.is_contrecord:
                self._stop(f"missing contrecord flag at {format_lsn(page)}")
                return None
            if nxt.rem_len != expected:
                self._stop(
                    f"contrecord length mismatch at {format_lsn(page)}: xlp_rem_len {nxt.rem_len}, expected {expected}"
                )
                return None
            hdr, rem = nxt, expected

    def _assemble(
        self, lsn: int, tot_len: int, header: tuple[int, int, int, int, int, int] | None, expect_prev: int | None, keep: bool
    ) -> _RawRecord | _Aborted | None:
        """Reassemble a record that continues on later pages; None (stop_reason set) if it is not valid."""
        page = lsn - lsn % _PAGE
        if self._load(page) < _PAGE:
            self._stop(f"end of stored WAL in record at {format_lsn(lsn)}")
            return None
        i = lsn - self._bstart
        first = self._buf[i : page + _PAGE - self._bstart]
        gotlen = len(first)
        parts: list[bytes] = [first] if keep else []
        if header is not None:
            head = first[:SizeOfXLogRecord]
            crc = _crc_value(first[SizeOfXLogRecord:])
        else:
            head = first
            crc = 0
        while gotlen < tot_len:
            page += _PAGE
            ph = self._page_header(page)
            if ph is None:
                if self.stop_reason.startswith("end of stored WAL"):
                    self._stop(f"end of stored WAL in record at {format_lsn(lsn)}")
                return None
            if ph.is_overwrite_contrecord:
                return _Aborted(page)
            if not ph.is_contrecord:
                self._stop(f"missing contrecord flag at {format_lsn(page)} for record at {format_lsn(lsn)}")
                return None
            if ph.rem_len == 0 or ph.rem_len != tot_len - gotlen:
                self._stop(
                    f"contrecord length mismatch at {format_lsn(page)}: xlp_rem_len {ph.rem_len},"
                    f" expected {tot_len - gotlen} for record at {format_lsn(lsn)}"
                )
                return None
            hsz = ph.size
            n = min(ph.rem_len, _PAGE - hsz)
            if self._load(page) < hsz + n:
                self._stop(f"end of stored WAL in record at {format_lsn(lsn)}")
                return None
            j = page + hsz - self._bstart
            frag = self._buf[j : j + n]
            gotlen += n
            if keep:
                parts.append(frag)
            if header is None:
                need = SizeOfXLogRecord - len(head)
                head += frag[:need]
                frag = frag[need:]
                if len(head) == SizeOfXLogRecord:
                    header = RECORD_HEADER.unpack_from(head)
                    tl, _, xl_prev, _, rmid, _ = header
                    problem = self._header_problem(lsn, tl, rmid, xl_prev, expect_prev)
                    if problem is not None:
                        self._stop(problem)
                        return None
            if frag:
                crc = _crc_extend(crc, frag)
        assert header is not None  # tot_len >= 24 guarantees the header was assembled
        crc = _crc_extend(crc, head[:20])
        tot_len, xid, xl_prev, info, rmid, xl_crc = header
        if crc != xl_crc:
            self._stop(f"CRC mismatch at {format_lsn(lsn)}")
            return None
        end = page + hsz + maxalign(ph.rem_len)
        return (lsn, end, tot_len, xid, xl_prev, info, rmid, xl_crc, b"".join(parts) if keep else None)

    def _scan(self, emit: bool = True) -> Iterator[_RawRecord]:
        """Yield raw record tuples in order until the end of valid WAL (nothing, but still scan, when emit is false)."""
        self._reset()
        pos = self.start_lsn
        page = pos - pos % _PAGE
        hdr = self._page_header(page)
        if hdr is None:
            return
        off = pos - page
        if off == 0:
            if hdr.is_contrecord:
                skipped = self._skip_continuation(page, hdr)
                if skipped is None:
                    return
                pos = skipped
            else:
                pos = page + hdr.size
        elif off < hdr.size:
            self._stop(f"invalid record offset at {format_lsn(pos)}: expected at least {hdr.size}, got {off}")
            return
        elif off == hdr.size and hdr.is_contrecord:
            self._stop(f"contrecord is requested by {format_lsn(pos)}")
            return
        yield from self._records(pos, emit)

    def _records(self, pos: int, emit: bool) -> Iterator[_RawRecord]:
        """The record loop proper, from a position where a record starts (or a page boundary before one)."""
        seg_size = self.seg_size
        keep = self.keep_data
        prev = self.expect_prev
        overwritten: int | None = None
        unpack_header = RECORD_HEADER.unpack_from
        unpack_u32 = _U32.unpack_from
        crc_value = _crc_value
        crc_extend = _crc_extend
        page_mask = _PAGE - 1
        last_lsn: int | None = None
        last_end = self.start_lsn
        try:
            while True:
                off = pos & page_mask
                if off == 0:
                    hdr = self._page_header(pos)
                    if hdr is None:
                        return
                    if hdr.is_contrecord:
                        self._stop(f"contrecord is requested by {format_lsn(pos + hdr.size)}")
                        return
                    pos += hdr.size
                    off = hdr.size
                elif not self._bstart <= pos < self._bend:
                    self._load(pos - off)
                buf = self._buf
                bstart = self._bstart
                bend = self._bend
                # Records lying within this page are handled inline; the loop leaves at a page boundary,
                # for a record continuing on later pages, and for records needing special treatment.
                while True:
                    i = pos - bstart
                    room = _PAGE - off
                    avail = bend - pos
                    if avail < 4:
                        self._stop(f"end of stored WAL at {format_lsn(pos)}")
                        return
                    if room < SizeOfXLogRecord:
                        break
                    if avail < SizeOfXLogRecord:
                        if unpack_u32(buf, i)[0] == 0:
                            self._stop(f"zero record length at {format_lsn(pos)}")
                        else:
                            self._stop(f"end of stored WAL at {format_lsn(pos)}")
                        return
                    tot_len, xid, xl_prev, info, rmid, xl_crc = header = unpack_header(buf, i)
                    if (
                        tot_len < SizeOfXLogRecord
                        or tot_len > MAX_RECORD_LENGTH
                        or RM_MAX_BUILTIN_ID < rmid < RM_MIN_CUSTOM_ID
                        or (xl_prev >= pos if prev is None else xl_prev != prev)
                    ):
                        self._stop(self._header_problem(pos, tot_len, rmid, xl_prev, prev) or "invalid record header")
                        return
                    if tot_len > room:
                        break
                    if avail < tot_len:
                        self._stop(f"end of stored WAL in record at {format_lsn(pos)}")
                        return
                    if crc_extend(crc_value(buf[i + 24 : i + tot_len]), buf[i : i + 20]) != xl_crc:
                        self._stop(f"CRC mismatch at {format_lsn(pos)}")
                        return
                    end = pos + ((tot_len + 7) & ~7)
                    if rmid == RM_XLOG_ID or overwritten is not None:
                        break
                    last_lsn = pos
                    last_end = end
                    if emit:
                        yield (pos, end, tot_len, xid, xl_prev, info, rmid, xl_crc, buf[i : i + tot_len] if keep else None)
                    prev = pos
                    pos = end
                    off = end & page_mask
                    if off == 0:
                        break
                if off == 0:
                    continue

                if room < SizeOfXLogRecord or tot_len > room:
                    # The record continues on later pages (possibly only part of its header does).
                    if room < SizeOfXLogRecord:
                        tot_len = unpack_u32(buf, i)[0]
                        if tot_len < SizeOfXLogRecord or tot_len > MAX_RECORD_LENGTH:
                            self._stop(self._header_problem(pos, tot_len, 0, 0, 0) or "invalid record header")
                            return
                        got = self._assemble(pos, tot_len, None, prev, keep or overwritten is not None)
                    else:
                        got = self._assemble(pos, tot_len, header, prev, keep or overwritten is not None)
                    if got is None:
                        return
                    if isinstance(got, _Aborted):
                        # PostgreSQL restarts at the flagged page; prev stays the last complete record.
                        overwritten = pos
                        pos = got.page_lsn
                        continue
                    rec = got
                else:
                    rec = (pos, end, tot_len, xid, xl_prev, info, rmid, xl_crc, buf[i : i + tot_len])

                lsn, end, _, _, _, info, rmid, _, data = rec
                if overwritten is not None:
                    problem = _overwrite_problem(rec, overwritten)
                    if problem is not None:
                        self._stop(problem)
                        return
                    overwritten = None
                if rmid == RM_XLOG_ID and info & 0xF0 == XLOG_SWITCH:
                    # The rest of the segment is padding; XLogDecodeNextRecord pretends the record covers it.
                    end = end + seg_size - 1
                    end -= end % seg_size
                last_lsn = lsn
                last_end = end
                if emit:
                    yield (lsn, end) + rec[2:8] + (data if keep else None,)
                prev = lsn
                pos = end
        finally:
            self.stop_lsn = last_end
            self.last_record_lsn = last_lsn


def _overwrite_problem(rec: _RawRecord, overwritten: int) -> str | None:
    """Why rec is not the XLOG_OVERWRITE_CONTRECORD record for the aborted record at overwritten, or None."""
    lsn, _, _, _, _, info, rmid, _, data = rec
    where = format_lsn(lsn)
    if rmid != RM_XLOG_ID or info & 0xF0 != XLOG_OVERWRITE_CONTRECORD:
        return (
            f"overwrite contrecord mismatch at {where}: expected an OVERWRITE_CONTRECORD record for the"
            f" aborted record at {format_lsn(overwritten)}, found rmid {rmid} info {info:02X}"
        )
    body = main_data(data) if data is not None else None
    if body is None or len(body) < 8:
        return f"overwrite contrecord mismatch at {where}: unreadable xl_overwrite_contrecord"
    lost = _U64.unpack_from(body)[0]
    if lost != overwritten:
        return (
            f"overwrite contrecord mismatch at {where}: overwritten LSN {format_lsn(lost)},"
            f" expected {format_lsn(overwritten)}"
        )
    return None


def find_end_of_wal(
    source: WalSource,
    start_lsn: int,
    *,
    seg_size: int = DEFAULT_SEGMENT_SIZE,
    system_id: int | None = None,
) -> tuple[int, int | None]:
    """Return (end_lsn, last_record_lsn): end of the last valid complete record at or after start_lsn (start_lsn itself if none), and the start of that record (None if none)."""
    reader = WalReader(source, start_lsn, seg_size=seg_size, system_id=system_id)
    for _ in reader._scan(emit=False):
        pass
    return reader.stop_lsn, reader.last_record_lsn

"""Synthesise valid PostgreSQL 15 WAL (page headers, records with correct CRCs) the way XLogInsert lays it out."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from sidecar.lsn import WAL_PAGE_SIZE, maxalign
from sidecar.wal.format import (
    LONG_PAGE_HEADER,
    RECORD_HEADER,
    SHORT_PAGE_HEADER,
    XLOG_BLCKSZ,
    XLOG_OVERWRITE_CONTRECORD,
    XLOG_PAGE_MAGIC,
    XLOG_SWITCH,
    XLP_BKP_REMOVABLE,
    XLP_FIRST_IS_CONTRECORD,
    XLP_FIRST_IS_OVERWRITE_CONTRECORD,
    XLP_LONG_HEADER,
    SizeOfXLogLongPHD,
    SizeOfXLogShortPHD,
    record_crc,
)
from sidecar.wal.reader import BytesSource

RM_LOGICALMSG_ID = 21
DEFAULT_SYSID = 7_300_000_000_000_000_001
_PATTERN = bytes(range(256))


@dataclass(frozen=True)
class Placed:
    """Where a synthesised record landed: its start and PostgreSQL's EndRecPtr for it."""

    lsn: int
    end_lsn: int
    tot_len: int
    data_end: int  # just past the record's last byte: it is complete once the stored WAL reaches here


def make_record(
    body: bytes, *, prev: int, rmid: int = RM_LOGICALMSG_ID, info: int = 0, xid: int = 0, long_length: bool = False
) -> bytes:
    """A complete record: header (with xl_crc) plus a main-data-only body."""
    if len(body) <= 255 and not long_length:
        frag = bytes([255, len(body)]) + body
    else:
        frag = bytes([254]) + struct.pack("<I", len(body)) + body
    tot_len = 24 + len(frag)
    rec = bytearray(RECORD_HEADER.pack(tot_len, xid, prev, info, rmid, 0) + frag)
    struct.pack_into("<I", rec, 20, record_crc(bytes(rec)))
    return bytes(rec)


class WalBuilder:
    """A WAL stream starting at a segment start; records are appended as XLogInsert would place them."""

    def __init__(
        self,
        start_lsn: int,
        *,
        seg_size: int = 16 * 1024 * 1024,
        tli: int = 1,
        sysid: int = DEFAULT_SYSID,
        prev: int = 0,
    ) -> None:
        assert start_lsn % seg_size == 0, "the stream must begin at a segment start"
        self.base = start_lsn
        self.seg_size = seg_size
        self.tli = tli
        self.sysid = sysid
        self.buf = bytearray()
        self.insert = start_lsn  # next byte to write; always past a page header once a page is begun
        self.prev = prev
        self.records: list[Placed] = []
        self._begin_page(start_lsn, 0, 0)

    @property
    def end(self) -> int:
        """LSN just past the last byte written."""
        return self.base + len(self.buf)

    def _begin_page(self, page: int, info: int, rem_len: int) -> None:
        assert page == self.end and page % XLOG_BLCKSZ == 0
        info |= XLP_BKP_REMOVABLE
        if page % self.seg_size == 0:
            hdr = LONG_PAGE_HEADER.pack(
                XLOG_PAGE_MAGIC, info | XLP_LONG_HEADER, self.tli, page, rem_len, self.sysid, self.seg_size, XLOG_BLCKSZ
            )
        else:
            hdr = SHORT_PAGE_HEADER.pack(XLOG_PAGE_MAGIC, info, self.tli, page, rem_len)
        self.buf += hdr
        self.insert = page + len(hdr)

    def _write(self, data: bytes) -> None:
        """Write record bytes at the insert position, adding contrecord page headers as pages fill."""
        written = 0
        while True:
            room = XLOG_BLCKSZ - self.insert % XLOG_BLCKSZ
            n = min(room, len(data) - written)
            self.buf += data[written : written + n]
            self.insert += n
            written += n
            if written == len(data):
                return
            self._begin_page(self.insert, XLP_FIRST_IS_CONTRECORD, len(data) - written)

    def _align_after_record(self) -> None:
        pad = maxalign(self.insert) - self.insert
        self.buf += bytes(pad)
        self.insert += pad

    def _start_position(self) -> int:
        if self.insert % XLOG_BLCKSZ == 0:
            self._begin_page(self.insert, 0, 0)
        return self.insert

    def add_raw(self, rec: bytes) -> Placed:
        """Append an already built record (its xl_prev is not touched)."""
        lsn = self._start_position()
        self._write(rec)
        data_end = self.insert
        end = maxalign(self.insert)
        self._align_after_record()
        placed = Placed(lsn, end, len(rec), data_end)
        self.records.append(placed)
        self.prev = lsn
        return placed

    def add(self, size: int | None = None, *, body: bytes | None = None, rmid: int = RM_LOGICALMSG_ID, info: int = 0) -> Placed:
        """Append a record whose total length is size (at least 26), or carrying body."""
        long_length = False
        if body is None:
            assert size is not None and size >= 26
            long_length = size - 26 > 255
            n = size - (29 if long_length else 26)
            shift = len(self.records) % 256
            body = (_PATTERN * (n // len(_PATTERN) + 2))[shift : shift + n]
        rec = make_record(body, prev=self.prev, rmid=rmid, info=info, xid=len(self.records) + 3, long_length=long_length)
        assert size is None or len(rec) == size, (size, len(rec))
        return self.add_raw(rec)

    def fill_to(self, target: int, size: int = 200) -> None:
        """Add records of about size bytes until the insert position reaches target or later."""
        while self.insert < target:
            self.add(size)

    def add_ending_at(self, target: int, *, single: bool = False) -> Placed:
        """Add records so that the last one's EndRecPtr is exactly target (a page boundary is fine).

        With single, one record covers everything up to target.
        """
        while True:
            start = self._start_position()
            usable = self._usable_between(start, target)
            if single or usable <= 24 + 2 + 255 + 200:
                placed = self.add(usable)
                assert placed.end_lsn == target, (placed, target)
                return placed
            self.add(min(300, usable - 300))

    def _usable_between(self, start: int, target: int) -> int:
        """Record bytes that fit in [start, target) around the page headers of the pages begun in between."""
        usable = target - start
        page = start - start % XLOG_BLCKSZ + XLOG_BLCKSZ
        while page < target:
            usable -= SizeOfXLogLongPHD if page % self.seg_size == 0 else SizeOfXLogShortPHD
            page += XLOG_BLCKSZ
        return usable

    def switch(self) -> Placed:
        """XLOG_SWITCH: a bare header, then zeroes (headers included) to the end of the segment, as PG15 writes."""
        lsn = self._start_position()
        rec = bytearray(RECORD_HEADER.pack(24, 0, self.prev, XLOG_SWITCH, 0, 0))
        struct.pack_into("<I", rec, 20, record_crc(bytes(rec)))
        self._write(bytes(rec))
        data_end = self.insert
        seg_end = lsn - lsn % self.seg_size + self.seg_size
        self.buf += bytes(seg_end - self.insert)
        self.insert = seg_end
        placed = Placed(lsn, seg_end, 24, data_end)
        self.records.append(placed)
        self.prev = lsn
        return placed

    def abort_record(self, tot_len: int) -> int:
        """Write the first page of a record that never got finished (as if the primary crashed); return its LSN.

        The record must not fit on the current page; the next call must be overwrite_contrecord().
        """
        lsn = self._start_position()
        room = XLOG_BLCKSZ - lsn % XLOG_BLCKSZ
        assert tot_len > room
        rec = bytearray(RECORD_HEADER.pack(tot_len, 9, self.prev, 0, RM_LOGICALMSG_ID, 0xDEADBEEF))
        rec += bytes(i & 0xFF for i in range(room - len(rec)))
        self.buf += rec[:room]
        self.insert += room
        return lsn

    def overwrite_contrecord(self, aborted_lsn: int, overwrite_time: int = 0) -> Placed:
        """Begin the page after an aborted record with XLP_FIRST_IS_OVERWRITE_CONTRECORD and an OVERWRITE_CONTRECORD record."""
        assert self.insert % XLOG_BLCKSZ == 0
        self._begin_page(self.insert, XLP_FIRST_IS_OVERWRITE_CONTRECORD, 0)
        body = struct.pack("<Qq", aborted_lsn, overwrite_time)
        return self.add_raw(make_record(body, prev=self.prev, rmid=0, info=XLOG_OVERWRITE_CONTRECORD))

    def bytes(self) -> bytes:
        """The whole stream from base."""
        return bytes(self.buf)

    def source(self, start: int | None = None, end: int | None = None) -> BytesSource:
        """A WalSource holding [start, end) of the stream (default: all of it)."""
        start = self.base if start is None else start
        end = self.end if end is None else end
        return BytesSource(start, bytes(self.buf[start - self.base : end - self.base]))

    def corrupt(self, lsn: int, data: bytes) -> None:
        """Overwrite stored bytes at lsn."""
        off = lsn - self.base
        self.buf[off : off + len(data)] = data

    def page_end_after(self, lsn: int) -> int:
        """The next page boundary after lsn."""
        return lsn - lsn % WAL_PAGE_SIZE + WAL_PAGE_SIZE

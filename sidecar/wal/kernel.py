"""The compiled segment scan: the records starting in one WAL segment, decoded into columns by numba-compiled code.

It takes the steps of WalReader and decode_record in the same order, so it stops where they stop and for the
same reason, given as a code and numbers (see sidecar/wal/stopcodes.py for their text). The segment's bytes
are `data`; the heads of the following segments, fetched as far as the last record needs, are `tail`. When
the scan needs bytes past the tail it returns NEED_MORE and is called again with a longer tail: all of its
progress is kept in the `st` array, the output arrays and `scratch` (where the first bytes of a record crossing
pages are put together).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sidecar.lsn import maxalign
from sidecar.wal import stopcodes as C
from sidecar.wal.crc32c import crc32c
from sidecar.wal.decode import (
    BKPBLOCK_HAS_DATA,
    BKPBLOCK_HAS_IMAGE,
    BKPBLOCK_SAME_REL,
    BKPIMAGE_COMPRESSED,
    BKPIMAGE_HAS_HOLE,
    XLOG_XACT_ABORT,
    XLOG_XACT_ABORT_PREPARED,
    XLOG_XACT_COMMIT,
    XLOG_XACT_COMMIT_PREPARED,
    XLR_MAX_BLOCK_ID,
)
from sidecar.wal.format import (
    BLCKSZ,
    MAX_RECORD_LENGTH,
    RM_XLOG_ID,
    XLOG_BLCKSZ,
    XLOG_OVERWRITE_CONTRECORD,
    XLOG_PAGE_MAGIC,
    XLOG_SWITCH,
    XLP_ALL_FLAGS,
    XLP_FIRST_IS_CONTRECORD,
    XLP_FIRST_IS_OVERWRITE_CONTRECORD,
    XLP_LONG_HEADER,
    XLR_BLOCK_ID_DATA_LONG,
    XLR_BLOCK_ID_DATA_SHORT,
    XLR_BLOCK_ID_ORIGIN,
    XLR_BLOCK_ID_TOPLEVEL_XID,
    SizeOfXLogLongPHD,
    SizeOfXLogRecord,
    SizeOfXLogShortPHD,
    page_header_size,
    rmid_is_valid,
)
from sidecar.wal.jit import compiled, helper
from sidecar.wal.reader import DEFAULT_READ_SIZE
from sidecar.wal.recordscan import (
    B_BIMG_INFO,
    B_BIMG_LEN,
    B_BLKNO,
    B_BLOCK_ID,
    B_DATA_LEN,
    B_DATA_OFFSET,
    B_DB,
    B_FORK_FLAGS,
    B_HOLE_LENGTH,
    B_HOLE_OFFSET,
    B_IMAGE_OFFSET,
    B_REL,
    B_SPC,
    BLOCK_COLUMNS,
    R_BLOCK_COUNT,
    R_CRC,
    R_END,
    R_FPI_LEN,
    R_INFO,
    R_LSN,
    R_MAIN_LEN,
    R_PREV,
    R_RMID,
    R_TOT_LEN,
    R_XACT_TIME,
    R_XACT_VALID,
    R_XID,
    RECORD_COLUMNS,
    RecordScan,
)
from sidecar.wal.rmgrdesc import RM_XACT_ID, XLOG_XACT_OPMASK

PAGE = XLOG_BLCKSZ
_CRC_HEAD = SizeOfXLogRecord - 4  # xl_crc is the header's last field: the CRC covers the bytes before it

# The scan's state: slots of the int64 `st` array.
(S_STATUS, S_PHASE, S_STOP, S_A, S_B, S_C, S_D,  # how and why the reader stopped, with the reason's numbers
 S_STOP_LSN,  # WalReader.stop_lsn: the end of the last record read
 S_POS, S_PREV, S_OVERWRITTEN, S_LATEST_PAGE, S_LATEST_TLI,  # the reader's position and memory
 S_NREC, S_NBLK,  # rows filled in recs and blks
 S_RECORDS, S_RECORD_BYTES, S_FPI_BYTES, S_FIRST_LSN, S_FIRST_PREV, S_LAST_LSN, S_LAST_END,  # summary
 S_REACHED_END, S_LAST_IS_SWITCH,
 S_DECODE, S_DA, S_DB, S_DC, S_DLSN,  # a decode error: its code, numbers and record
 S_ASM_LSN, S_ASM_TOT_LEN, S_ASM_GOT, S_ASM_CRC, S_ASM_PAGE,  # a record being put together across pages
 ) = range(34)
STATE_SLOTS = 34
NONE = -1  # an absent LSN (xl_prev to expect, overwritten record, ...)

# S_STATUS values
RUNNING = 0
NEED_MORE = 1
DONE = 2
# S_PHASE values: where a resumed scan carries on
PHASE_START = 0
PHASE_RECORDS = 1
PHASE_ASSEMBLE = 2

# What a step returns: go on, stop (reason in st), wait for more bytes, the record was aborted, or the record's
# first bytes do not suffice to decode it.
OK = 1
STOPPED = 0
MORE = -1
ABORTED = 2
FULL = 3

# Of a record crossing pages only its first bytes are copied together: the header fragments lie there (a
# record with 33 block references needs less than 1 KiB). The rest is checked in place and copied only in
# the rare case that decoding needs it.
_KEEP = 1024

_INITIAL_ROWS = 4096

for _shared in (maxalign, page_header_size, rmid_is_valid):
    helper(_shared)


def new_state(start_lsn: int) -> np.ndarray:
    """The state of a scan that has not begun, reading the segment starting at start_lsn."""
    st = np.zeros(STATE_SLOTS, dtype=np.int64)
    st[S_STOP_LSN] = start_lsn
    for slot in (S_PREV, S_OVERWRITTEN, S_LATEST_PAGE, S_FIRST_LSN, S_FIRST_PREV, S_LAST_LSN, S_LAST_END):
        st[slot] = NONE
    return st


def new_outputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty record and block arrays and scratch space, grown by the scan as needed."""
    return (np.empty((len(RECORD_COLUMNS), _INITIAL_ROWS), dtype=np.int64),
            np.empty((len(BLOCK_COLUMNS), _INITIAL_ROWS), dtype=np.int64),
            np.empty(_KEEP, dtype=np.uint8))


class _Tail:
    """The bytes fetched from the following segments, in one growing buffer."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)
        self.size = 0

    def reserve(self, size: int) -> None:
        """Make room for size bytes in all."""
        if size > len(self._buf):
            bigger = np.empty(max(size, 2 * len(self._buf)), dtype=np.uint8)
            bigger[: self.size] = self._buf[: self.size]
            self._buf = bigger

    def add(self, chunk: bytes) -> None:
        self.reserve(self.size + len(chunk))
        self._buf[self.size : self.size + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
        self.size += len(chunk)

    def view(self) -> np.ndarray:
        # Read-only like the segment's own bytes: the kernel is compiled for one array type.
        view = self._buf[: self.size]
        view.flags.writeable = False
        return view


def read_records(data: bytes, fetch: Callable[[int, int], tuple[bytes, bool]], start: int, seg_size: int,
                 keep: bool) -> RecordScan:
    """The records starting in the segment at start whose bytes are data, as WalReader and decode_record read
    them; fetch(lsn, size) reads the following segments' heads as WalReader would ask for them."""
    own = np.frombuffer(data, dtype=np.uint8)[:seg_size]
    tail = _Tail()
    # A short segment is never read past: the reader stops where its bytes end.
    final = len(own) < seg_size
    st = new_state(start)
    recs, blks, scratch = new_outputs()
    while True:
        recs, blks, scratch = scan(own, tail.view(), final, start, seg_size, keep, st, recs, blks, scratch)
        if st[S_STATUS] != NEED_MORE:
            break
        if tail.size == 0 and st[S_PHASE] == PHASE_ASSEMBLE:
            # Room for the rest of the record being put together, with a page header per page.
            left = st[S_ASM_TOT_LEN] - st[S_ASM_GOT]
            tail.reserve(int(left + (left // (PAGE - SizeOfXLogLongPHD) + 2) * PAGE))
        lsn = start + seg_size + tail.size
        chunk, complete = fetch(lsn, min(DEFAULT_READ_SIZE, seg_size - lsn % seg_size))
        tail.add(chunk)
        final = not complete
    return _outcome(st, recs, blks)


def _outcome(st: np.ndarray, recs: np.ndarray, blks: np.ndarray) -> RecordScan:
    """The RecordScan the final state and arrays describe (fetched is left for the caller)."""
    got = RecordScan(
        records=dict(zip(RECORD_COLUMNS, recs[:, : st[S_NREC]])),
        blocks=dict(zip(BLOCK_COLUMNS, blks[:, : st[S_NBLK]])),
        count=int(st[S_RECORDS]),
        record_bytes=int(st[S_RECORD_BYTES]),
        fpi_bytes=int(st[S_FPI_BYTES]),
        reached_end=bool(st[S_REACHED_END]),
        last_is_switch=bool(st[S_LAST_IS_SWITCH]),
        stop_lsn=int(st[S_STOP_LSN]),
    )
    if st[S_FIRST_LSN] != NONE:
        got.first_lsn, got.first_prev = int(st[S_FIRST_LSN]), int(st[S_FIRST_PREV])
        got.last_lsn, got.last_end = int(st[S_LAST_LSN]), int(st[S_LAST_END])
    if st[S_DECODE]:
        got.decode_error = C.describe(*(int(v) for v in st[[S_DECODE, S_DA, S_DB, S_DC, S_DLSN]]))
    elif st[S_STOP]:
        got.stop_reason = C.describe(*(int(v) for v in st[[S_STOP, S_A, S_B, S_C, S_D]]))
    return got


# ----- little-endian fields -----


@helper
def _u16(b: np.ndarray, i: int) -> int:
    return np.int64(b[i]) | (np.int64(b[i + 1]) << 8)


@helper
def _u32(b: np.ndarray, i: int) -> int:
    return np.int64(b[i]) | (np.int64(b[i + 1]) << 8) | (np.int64(b[i + 2]) << 16) | (np.int64(b[i + 3]) << 24)


@helper
def _u64(b: np.ndarray, i: int) -> int:
    """Eight bytes as int64: a uint64 above 2**63 comes out negative, with the same bits."""
    return _u32(b, i) | (_u32(b, i + 4) << 32)


@helper
def _stop(st: np.ndarray, code: int, a: int, b: int, c: int, d: int) -> int:
    st[S_STOP] = code
    st[S_A] = a
    st[S_B] = b
    st[S_C] = c
    st[S_D] = d
    return STOPPED


@helper
def _grow(arr: np.ndarray, columns: int) -> np.ndarray:
    """arr, or a copy with room for at least `columns` entries per row."""
    if arr.shape[1] >= columns:
        return arr
    bigger = np.empty((arr.shape[0], max(columns, 2 * arr.shape[1])), dtype=arr.dtype)
    bigger[:, : arr.shape[1]] = arr
    return bigger


# ----- where bytes are -----


@helper
def _where(data: np.ndarray, tail: np.ndarray, start: int, end: int, lsn: int) -> tuple[np.ndarray, int]:
    """The array holding the byte at lsn and its index there (pages never straddle the two)."""
    if lsn < end:
        return data, lsn - start
    return tail, lsn - end


@helper
def _stored(data: np.ndarray, tail: np.ndarray, start: int, end: int, lsn: int) -> int:
    """How many bytes are stored from lsn on, up to the end of its segment or of the tail."""
    if lsn < end:
        return start + data.shape[0] - lsn
    return end + tail.shape[0] - lsn


# ----- page headers -----


@helper
def _page_header(data: np.ndarray, tail: np.ndarray, tail_final: bool, start: int, end: int, seg_size: int,
                 page: int, st: np.ndarray) -> tuple[int, int, int]:
    """(OK, xlp_info, xlp_rem_len) for a usable page header at page, as WalReader._page_header checks it."""
    avail = min(PAGE, _stored(data, tail, start, end, page))
    b, j = _where(data, tail, start, end, page)
    if avail < SizeOfXLogShortPHD or (avail < SizeOfXLogLongPHD and b[j + 2] & XLP_LONG_HEADER):
        if page >= end and not tail_final:
            return MORE, 0, 0
        return _stop(st, C.END_AT_PAGE, page, 0, 0, 0), 0, 0
    magic = _u16(b, j)
    info = _u16(b, j + 2)
    tli = _u32(b, j + 4)
    pageaddr = _u64(b, j + 8)
    rem = _u32(b, j + 16)
    if magic != XLOG_PAGE_MAGIC:
        return _stop(st, C.BAD_MAGIC, magic, pageaddr, page, 0), 0, 0
    if info & ~XLP_ALL_FLAGS:
        return _stop(st, C.BAD_INFO, info, pageaddr, page, 0), 0, 0
    if info & XLP_LONG_HEADER:
        if _u32(b, j + 32) != seg_size:
            return _stop(st, C.SEG_SIZE, _u32(b, j + 32), page, 0, 0), 0, 0
        if _u32(b, j + 36) != XLOG_BLCKSZ:
            return _stop(st, C.PAGE_SIZE, _u32(b, j + 36), page, 0, 0), 0, 0
    elif page % seg_size == 0:
        return _stop(st, C.NO_LONG_HEADER, info, page, 0, 0), 0, 0
    if pageaddr != page:
        return _stop(st, C.PAGEADDR, pageaddr, page, 0, 0), 0, 0
    if page > st[S_LATEST_PAGE] and tli < st[S_LATEST_TLI]:
        return _stop(st, C.TIMELINE, tli, st[S_LATEST_TLI], page, 0), 0, 0
    st[S_LATEST_PAGE] = page
    st[S_LATEST_TLI] = tli
    return OK, info, rem


@helper
def _skip_continuation(data: np.ndarray, tail: np.ndarray, tail_final: bool, start: int, end: int, seg_size: int,
                       page: int, info: int, rem: int, st: np.ndarray) -> tuple[int, int]:
    """(OK, where records begin) past the tail of a record begun before the segment (WalReader._skip_continuation)."""
    if rem == 0:
        return _stop(st, C.CONT_ZERO_REM, page, 0, 0, 0), 0
    while True:
        space = PAGE - page_header_size(info)
        if maxalign(rem) < space:
            return OK, page + page_header_size(info) + maxalign(rem)
        page += PAGE
        expected = rem - space
        if expected <= 0:
            return OK, page
        got, info, next_rem = _page_header(data, tail, tail_final, start, end, seg_size, page, st)
        if got != OK:
            return got, 0
        if info & XLP_FIRST_IS_OVERWRITE_CONTRECORD and not info & XLP_FIRST_IS_CONTRECORD:
            return OK, page
        if not info & XLP_FIRST_IS_CONTRECORD:
            return _stop(st, C.CONT_MISSING, page, 0, 0, 0), 0
        if next_rem != expected:
            return _stop(st, C.CONT_REM, page, next_rem, expected, 0), 0
        rem = expected


# ----- record headers and CRC -----


@helper
def _header_problem(st: np.ndarray, lsn: int, tot_len: int, rmid: int, xl_prev: int, expect_prev: int) -> int:
    """STOPPED with WalReader._header_problem's reason, or OK for a sound header."""
    if tot_len == 0:
        return _stop(st, C.ZERO_LENGTH, lsn, 0, 0, 0)
    if tot_len < SizeOfXLogRecord:
        return _stop(st, C.SHORT_LENGTH, lsn, tot_len, 0, 0)
    if tot_len > MAX_RECORD_LENGTH:
        return _stop(st, C.LONG_LENGTH, lsn, tot_len, 0, 0)
    if not rmid_is_valid(rmid):
        return _stop(st, C.BAD_RMID, lsn, rmid, 0, 0)
    if expect_prev == NONE:
        # xl_prev is unsigned: bits read as a negative int64 are past any LSN.
        if xl_prev < 0 or xl_prev >= lsn:
            return _stop(st, C.PREV_NOT_BEFORE, lsn, xl_prev, 0, 0)
    elif xl_prev != expect_prev:
        return _stop(st, C.PREV_MISMATCH, lsn, xl_prev, expect_prev, 0)
    return OK


@helper
def _record_crc(b: np.ndarray, i: int, tot_len: int) -> int:
    """xl_crc as PostgreSQL computes it for the whole record at b[i:]: the body, then the header up to xl_crc."""
    return crc32c(crc32c(0, b, i + SizeOfXLogRecord, i + tot_len), b, i, i + _CRC_HEAD)


# ----- decoding a record's header fragments (decode_record) -----


@helper
def _decode_error(st: np.ndarray, code: int, a: int, b: int, c: int) -> tuple[int, int, int, int]:
    st[S_DECODE] = code
    st[S_DA] = a
    st[S_DB] = b
    st[S_DC] = c
    return STOPPED, 0, 0, 0


@helper
def _check_image(st: np.ndarray, bimg_len: int, hole_offset: int, hole_length: int, bimg_info: int) -> int:
    """decode._check_image: STOPPED (decode error in st) or OK."""
    has_hole = bimg_info & BKPIMAGE_HAS_HOLE
    compressed = bimg_info & BKPIMAGE_COMPRESSED
    if has_hole and (hole_offset == 0 or hole_length == 0 or bimg_len == BLCKSZ):
        return _decode_error(st, C.D_HOLE, hole_offset, hole_length, bimg_len)[0]
    if not has_hole and (hole_offset != 0 or hole_length != 0):
        return _decode_error(st, C.D_NO_HOLE, hole_offset, hole_length, 0)[0]
    if compressed and bimg_len == BLCKSZ:
        return _decode_error(st, C.D_COMPRESSED_FULL, bimg_len, 0, 0)[0]
    if not has_hole and not compressed and bimg_len != BLCKSZ:
        return _decode_error(st, C.D_IMAGE_LENGTH, bimg_len, 0, 0)[0]
    return OK


@helper
def _fragment_size(block_id: int) -> int:
    """Bytes after the id of a fixed-size header fragment (main data length, origin, top-level xid); 0 if invalid."""
    if block_id == XLR_BLOCK_ID_DATA_SHORT:
        return 1
    if block_id == XLR_BLOCK_ID_DATA_LONG or block_id == XLR_BLOCK_ID_TOPLEVEL_XID:
        return 4
    if block_id == XLR_BLOCK_ID_ORIGIN:
        return 2
    return 0


@helper
def _room(st: np.ndarray, pos: int, size: int, end: int, have: int) -> int:
    """OK if size bytes at pos lie within the record and its bytes at hand; else STOPPED (the record is short,
    a decode error) or FULL."""
    if pos + size > end:
        return _decode_error(st, C.D_SHORT, 0, 0, 0)[0]
    if pos + size > have:
        return FULL
    return OK


@helper
def _decode(b: np.ndarray, i: int, tot_len: int, have: int, blks: np.ndarray, nblk: int,
            st: np.ndarray) -> tuple[int, int, int, int]:
    """(OK, block count, main data length, FPI bytes) for the record at b[i:i+tot_len] of which `have` bytes are
    at hand, its block references written to blks from column nblk on; STOPPED with the decode error in st, or
    FULL when it needs more of the record."""
    end = i + tot_len
    have += i
    pos = i + SizeOfXLogRecord
    datatotal = 0
    max_block_id = -1
    main_len = 0
    n = 0
    has_rel = False
    spc = db = rel = 0
    while end - pos > datatotal:
        if pos >= have:
            return FULL, 0, 0, 0
        block_id = np.int64(b[pos])
        pos += 1
        if block_id > XLR_MAX_BLOCK_ID:
            size = _fragment_size(block_id)
            if size == 0:
                return _decode_error(st, C.D_BLOCK_ID, block_id, 0, 0)
            room = _room(st, pos, size, end, have)
            if room != OK:
                return room, 0, 0, 0
            value = np.int64(b[pos]) if size == 1 else (_u16(b, pos) if size == 2 else _u32(b, pos))
            pos += size
            if block_id == XLR_BLOCK_ID_DATA_SHORT or block_id == XLR_BLOCK_ID_DATA_LONG:
                main_len = value
                datatotal += main_len
                break  # the main data fragment is always last
            continue
        if block_id <= max_block_id:
            return _decode_error(st, C.D_BLOCK_ORDER, block_id, 0, 0)
        max_block_id = block_id
        room = _room(st, pos, 3, end, have)
        if room != OK:
            return room, 0, 0, 0
        fork_flags = np.int64(b[pos])
        data_len = _u16(b, pos + 1)
        pos += 3
        if fork_flags & BKPBLOCK_HAS_DATA and data_len == 0:
            return _decode_error(st, C.D_NO_DATA, 0, 0, 0)
        if not fork_flags & BKPBLOCK_HAS_DATA and data_len != 0:
            return _decode_error(st, C.D_DATA_LENGTH, data_len, 0, 0)
        datatotal += data_len
        bimg_len = hole_offset = hole_length = bimg_info = 0
        if fork_flags & BKPBLOCK_HAS_IMAGE:
            room = _room(st, pos, 5, end, have)
            if room != OK:
                return room, 0, 0, 0
            bimg_len = _u16(b, pos)
            hole_offset = _u16(b, pos + 2)
            bimg_info = np.int64(b[pos + 4])
            pos += 5
            if not bimg_info & BKPIMAGE_COMPRESSED:
                hole_length = BLCKSZ - bimg_len
            elif bimg_info & BKPIMAGE_HAS_HOLE:
                room = _room(st, pos, 2, end, have)
                if room != OK:
                    return room, 0, 0, 0
                hole_length = _u16(b, pos)
                pos += 2
            datatotal += bimg_len
            if _check_image(st, bimg_len, hole_offset, hole_length, bimg_info) != OK:
                return STOPPED, 0, 0, 0
        if fork_flags & BKPBLOCK_SAME_REL:
            if not has_rel:
                return _decode_error(st, C.D_SAME_REL, 0, 0, 0)
            room = _room(st, pos, 4, end, have)
            if room != OK:
                return room, 0, 0, 0
            blkno = _u32(b, pos)
            pos += 4
        else:
            room = _room(st, pos, 16, end, have)
            if room != OK:
                return room, 0, 0, 0
            spc, db, rel, blkno = _u32(b, pos), _u32(b, pos + 4), _u32(b, pos + 8), _u32(b, pos + 12)
            has_rel = True
            pos += 16
        k = nblk + n
        blks[B_BLOCK_ID, k] = block_id
        blks[B_FORK_FLAGS, k] = fork_flags
        blks[B_SPC, k] = spc
        blks[B_DB, k] = db
        blks[B_REL, k] = rel
        blks[B_BLKNO, k] = blkno
        blks[B_DATA_LEN, k] = data_len
        blks[B_BIMG_LEN, k] = bimg_len
        blks[B_HOLE_OFFSET, k] = hole_offset
        blks[B_HOLE_LENGTH, k] = hole_length
        blks[B_BIMG_INFO, k] = bimg_info
        n += 1
    if end - pos != datatotal:
        return _decode_error(st, C.D_SHORT, 0, 0, 0)
    return OK, n, main_len, _place_data(blks, nblk, n, pos - i)


@helper
def _place_data(blks: np.ndarray, first: int, n: int, pos: int) -> int:
    """Fill in where each block's image and data lie (the data area follows the headers); return the FPI bytes."""
    fpi = 0
    for k in range(first, first + n):
        blks[B_IMAGE_OFFSET, k] = -1
        if blks[B_FORK_FLAGS, k] & BKPBLOCK_HAS_IMAGE:
            blks[B_IMAGE_OFFSET, k] = pos
            pos += blks[B_BIMG_LEN, k]
        blks[B_DATA_OFFSET, k] = pos
        pos += blks[B_DATA_LEN, k]
        fpi += blks[B_BIMG_LEN, k]
    return fpi


@helper
def _is_timed_xact(rmid: int, info: int) -> bool:
    """A commit or abort record, which begins its main data with the transaction's timestamp."""
    op = info & XLOG_XACT_OPMASK
    return rmid == RM_XACT_ID and (op == XLOG_XACT_COMMIT or op == XLOG_XACT_COMMIT_PREPARED
                                   or op == XLOG_XACT_ABORT or op == XLOG_XACT_ABORT_PREPARED)


# ----- one record, as scan_segment takes it from the reader -----


@helper
def _take(b: np.ndarray, i: int, have: int, lsn: int, end_lsn: int, end: int, keep: bool, st: np.ndarray,
          recs: np.ndarray, blks: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """Decode and count the record at b[i:] (`have` of its bytes at hand) that the reader yields;
    (OK to go on, STOPPED or FULL; recs; blks)."""
    st[S_STOP_LSN] = end_lsn
    if lsn >= end:
        # scan_segment stops at a record starting in the next segment, leaving the reader unfinished.
        _stop(st, C.NOT_FINISHED, 0, 0, 0, 0)
        return STOPPED, recs, blks
    tot_len = _u32(b, i)
    rmid = np.int64(b[i + 17])
    info = np.int64(b[i + 16])
    nrec = st[S_NREC]
    nblk = st[S_NBLK]
    if keep:
        recs = _grow(recs, nrec + 1)
        blks = _grow(blks, nblk + XLR_MAX_BLOCK_ID + 1)
    got, nblocks, main_len, fpi = _decode(b, i, tot_len, have, blks, nblk if keep else 0, st)
    if got == FULL or (_is_timed_xact(rmid, info) and main_len >= 8 and tot_len - main_len + 8 > have):
        return FULL, recs, blks
    if got != OK:
        st[S_DLSN] = lsn
        return STOPPED, recs, blks
    if st[S_FIRST_LSN] == NONE:
        st[S_FIRST_LSN] = lsn
        st[S_FIRST_PREV] = _u64(b, i + 8)
    st[S_LAST_LSN] = lsn
    st[S_LAST_END] = end_lsn
    st[S_RECORDS] += 1
    st[S_RECORD_BYTES] += tot_len
    st[S_FPI_BYTES] += fpi
    if keep:
        _put_record(b, i, lsn, end_lsn, fpi, main_len, nblocks, recs, nrec)
        st[S_NREC] = nrec + 1
        st[S_NBLK] = nblk + nblocks
    if end_lsn >= end:
        st[S_REACHED_END] = 1
        st[S_LAST_IS_SWITCH] = rmid == RM_XLOG_ID and info & 0xF0 == XLOG_SWITCH
        return STOPPED, recs, blks
    return OK, recs, blks


@helper
def _put_record(b: np.ndarray, i: int, lsn: int, end_lsn: int, fpi: int, main_len: int, nblocks: int,
                recs: np.ndarray, k: int) -> None:
    tot_len = _u32(b, i)
    rmid = np.int64(b[i + 17])
    info = np.int64(b[i + 16])
    recs[R_LSN, k] = lsn
    recs[R_END, k] = end_lsn
    recs[R_PREV, k] = _u64(b, i + 8)
    recs[R_XID, k] = _u32(b, i + 4)
    recs[R_RMID, k] = rmid
    recs[R_INFO, k] = info
    recs[R_TOT_LEN, k] = tot_len
    recs[R_FPI_LEN, k] = fpi
    recs[R_MAIN_LEN, k] = main_len
    recs[R_CRC, k] = _u32(b, i + 20)
    recs[R_BLOCK_COUNT, k] = nblocks
    timed = _is_timed_xact(rmid, info) and main_len >= 8
    recs[R_XACT_VALID, k] = timed
    # The main data ends the record; commit and abort records begin it with their timestamp.
    recs[R_XACT_TIME, k] = _u64(b, i + tot_len - main_len) if timed else 0


# ----- records crossing pages -----


@helper
def _ensure(scratch: np.ndarray, size: int) -> np.ndarray:
    if scratch.shape[0] >= size:
        return scratch
    bigger = np.empty(max(size, 2 * scratch.shape[0]), dtype=np.uint8)
    bigger[: scratch.shape[0]] = scratch
    return bigger


@helper
def _copy(scratch: np.ndarray, got: int, src: np.ndarray, j: int, n: int, limit: int) -> None:
    """Copy the fragment src[j:j+n], which continues the record after got bytes, into scratch below limit."""
    n = min(n, limit - got)
    if n > 0:
        scratch[got : got + n] = src[j : j + n]


@helper
def _body_crc(crc: int, got: int, src: np.ndarray, j: int, n: int) -> int:
    """crc extended with the fragment src[j:j+n] (continuing the record after got bytes) but for header bytes."""
    skip = min(n, max(0, SizeOfXLogRecord - got))
    return crc32c(crc, src, j + skip, j + n)


@helper
def _begin_assembly(data: np.ndarray, tail: np.ndarray, start: int, end: int, lsn: int, st: np.ndarray,
                    scratch: np.ndarray) -> None:
    """Take the part of the record at lsn on its first page, and note what is left."""
    page = lsn - lsn % PAGE
    b, j = _where(data, tail, start, end, lsn)
    got = page + PAGE - lsn
    _copy(scratch, 0, b, j, got, _KEEP)
    st[S_ASM_GOT] = got
    st[S_ASM_CRC] = _body_crc(0, 0, b, j, got)
    st[S_ASM_PAGE] = page + PAGE


@helper
def _assemble(data: np.ndarray, tail: np.ndarray, tail_final: bool, start: int, end: int, seg_size: int,
              expect_prev: int, st: np.ndarray, scratch: np.ndarray) -> tuple[int, int]:
    """Go on with the record begun by _begin_assembly (WalReader._assemble): (OK, its EndRecPtr), (ABORTED, the
    page that aborted it), STOPPED or MORE; its first bytes end up in scratch."""
    lsn = st[S_ASM_LSN]
    tot_len = st[S_ASM_TOT_LEN]
    got = st[S_ASM_GOT]
    page = st[S_ASM_PAGE]
    hsz = rem = 0
    while got < tot_len:
        status, info, rem = _page_header(data, tail, tail_final, start, end, seg_size, page, st)
        if status == MORE:
            return MORE, 0
        if status != OK:
            if st[S_STOP] == C.END_AT_PAGE:
                _stop(st, C.END_IN_RECORD, lsn, 0, 0, 0)
            return STOPPED, 0
        if info & XLP_FIRST_IS_OVERWRITE_CONTRECORD:
            return ABORTED, page
        if not info & XLP_FIRST_IS_CONTRECORD:
            return _stop(st, C.CONT_MISSING_IN_RECORD, page, lsn, 0, 0), 0
        if rem == 0 or rem != tot_len - got:
            return _stop(st, C.CONT_REM_IN_RECORD, page, rem, tot_len - got, lsn), 0
        hsz = page_header_size(info)
        n = min(rem, PAGE - hsz)
        if _stored(data, tail, start, end, page) < hsz + n:
            return _stop(st, C.END_IN_RECORD, lsn, 0, 0, 0), 0
        b, j = _where(data, tail, start, end, page + hsz)
        _copy(scratch, got, b, j, n, _KEEP)
        # A header split across pages is complete only now: check it before going further.
        if got < SizeOfXLogRecord <= got + n and _header_problem(
                st, lsn, _u32(scratch, 0), np.int64(scratch[17]), _u64(scratch, 8), expect_prev) != OK:
            return STOPPED, 0
        st[S_ASM_CRC] = _body_crc(st[S_ASM_CRC], got, b, j, n)
        got += n
        page += PAGE
        st[S_ASM_GOT] = got
        st[S_ASM_PAGE] = page
    if crc32c(st[S_ASM_CRC], scratch, 0, _CRC_HEAD) != _u32(scratch, 20):
        return _stop(st, C.CRC, lsn, 0, 0, 0), 0
    return OK, page - PAGE + hsz + maxalign(rem)


@helper
def _gather(data: np.ndarray, tail: np.ndarray, start: int, end: int, lsn: int, tot_len: int,
            scratch: np.ndarray) -> np.ndarray:
    """The whole record at lsn, which crosses pages already checked, copied into scratch."""
    scratch = _ensure(scratch, tot_len)
    b, j = _where(data, tail, start, end, lsn)
    got = min(tot_len, PAGE - lsn % PAGE)
    _copy(scratch, 0, b, j, got, tot_len)
    page = lsn - lsn % PAGE + PAGE
    while got < tot_len:
        b, j = _where(data, tail, start, end, page)
        hsz = page_header_size(_u16(b, j + 2))
        _copy(scratch, got, b, j + hsz, PAGE - hsz, tot_len)
        got += PAGE - hsz
        page += PAGE
    return scratch


@helper
def _overwrite_problem(st: np.ndarray, b: np.ndarray, i: int, have: int, lsn: int, overwritten: int) -> int:
    """STOPPED unless the record at b[i:] (`have` bytes at hand, else FULL) is the XLOG_OVERWRITE_CONTRECORD naming
    the aborted record at overwritten."""
    rmid = np.int64(b[i + 17])
    info = np.int64(b[i + 16])
    if rmid != RM_XLOG_ID or info & 0xF0 != XLOG_OVERWRITE_CONTRECORD:
        return _stop(st, C.OVERWRITE_KIND, lsn, overwritten, rmid, info)
    # Only a record of main data alone has a readable xl_overwrite_contrecord (format.main_data).
    probe = np.empty((len(BLOCK_COLUMNS), XLR_MAX_BLOCK_ID + 1), dtype=np.int64)
    saved = st[S_DECODE]
    tot_len = _u32(b, i)
    got, nblocks, main_len, _ = _decode(b, i, tot_len, have, probe, 0, st)
    st[S_DECODE] = saved
    if got == FULL or (got == OK and nblocks == 0 and main_len >= 8 and tot_len - main_len + 8 > have):
        return FULL
    if got != OK or nblocks != 0 or main_len < 8:
        return _stop(st, C.OVERWRITE_UNREADABLE, lsn, 0, 0, 0)
    lost = _u64(b, i + tot_len - main_len)
    if lost != overwritten:
        return _stop(st, C.OVERWRITE_LSN, lsn, lost, overwritten, 0)
    return OK


# ----- the record loop (WalReader._records) -----


@helper
def _finish_special(b: np.ndarray, i: int, have: int, lsn: int, end_lsn: int, seg_size: int,
                    st: np.ndarray) -> tuple[int, int]:
    """After a record needing attention (one of XLOG, or the one after an aborted record): (OK, EndRecPtr),
    STOPPED or FULL."""
    overwritten = st[S_OVERWRITTEN]
    if overwritten != NONE:
        status = _overwrite_problem(st, b, i, have, lsn, overwritten)
        if status != OK:
            return status, 0
        st[S_OVERWRITTEN] = NONE
    if b[i + 17] == RM_XLOG_ID and b[i + 16] & 0xF0 == XLOG_SWITCH:
        # The rest of the segment is padding; XLogDecodeNextRecord pretends the record covers it.
        end_lsn = (end_lsn + seg_size - 1) // seg_size * seg_size
    return OK, end_lsn


@helper
def _records(data: np.ndarray, tail: np.ndarray, tail_final: bool, start: int, end: int, seg_size: int,
             keep: bool, st: np.ndarray, recs: np.ndarray, blks: np.ndarray,
             scratch: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Read records from st[S_POS] until the scan is done or needs more bytes."""
    pos = st[S_POS]
    while True:
        st[S_POS] = pos
        if st[S_PHASE] == PHASE_ASSEMBLE:
            status, pos, recs, blks, scratch = _crossing(data, tail, tail_final, start, end, seg_size, keep, st,
                                                         recs, blks, scratch)
            if status != OK:
                return status, recs, blks, scratch
            continue
        off = pos % PAGE
        if off == 0:
            status, info, _ = _page_header(data, tail, tail_final, start, end, seg_size, pos, st)
            if status != OK:
                return status, recs, blks, scratch
            if info & XLP_FIRST_IS_CONTRECORD:
                _stop(st, C.CONT_REQUESTED, pos + page_header_size(info), 0, 0, 0)
                return STOPPED, recs, blks, scratch
            pos += page_header_size(info)
        status, pos, recs, blks = _page_records(data, tail, start, end, seg_size, keep, pos, st, recs, blks)
        if status != OK:
            return status, recs, blks, scratch


@helper
def _page_records(data: np.ndarray, tail: np.ndarray, start: int, end: int, seg_size: int, keep: bool, pos: int,
                  st: np.ndarray, recs: np.ndarray, blks: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray]:
    """The records lying within the page at pos, from pos on; (OK, where to go on) at the page's end, at a
    record continuing on later pages (PHASE_ASSEMBLE set) or after a record needing special treatment."""
    b, i = _where(data, tail, start, end, pos)
    avail_end = i + _stored(data, tail, start, end, pos)
    while True:
        room = PAGE - pos % PAGE
        avail = avail_end - i
        if avail < 4:
            return _stop(st, C.END_AT, pos, 0, 0, 0), pos, recs, blks
        if room < SizeOfXLogRecord:
            tot_len = _u32(b, i)
            if tot_len < SizeOfXLogRecord or tot_len > MAX_RECORD_LENGTH:
                return _header_problem(st, pos, tot_len, 0, 0, 0), pos, recs, blks
            return _cross(st, pos, tot_len), pos, recs, blks
        if avail < SizeOfXLogRecord:
            return _stop(st, C.ZERO_LENGTH if _u32(b, i) == 0 else C.END_AT, pos, 0, 0, 0), pos, recs, blks
        tot_len = _u32(b, i)
        rmid = np.int64(b[i + 17])
        if (tot_len < SizeOfXLogRecord or tot_len > MAX_RECORD_LENGTH or not rmid_is_valid(rmid)
                or _prev_wrong(_u64(b, i + 8), pos, st[S_PREV])):
            return _header_problem(st, pos, tot_len, rmid, _u64(b, i + 8), st[S_PREV]), pos, recs, blks
        if tot_len > room:
            return _cross(st, pos, tot_len), pos, recs, blks
        if avail < tot_len:
            return _stop(st, C.END_IN_RECORD, pos, 0, 0, 0), pos, recs, blks
        if _record_crc(b, i, tot_len) != _u32(b, i + 20):
            return _stop(st, C.CRC, pos, 0, 0, 0), pos, recs, blks
        end_lsn = pos + maxalign(tot_len)
        if rmid == RM_XLOG_ID or st[S_OVERWRITTEN] != NONE:
            status, end_lsn = _finish_special(b, i, tot_len, pos, end_lsn, seg_size, st)
            if status != OK:
                return status, pos, recs, blks
        status, recs, blks = _take(b, i, tot_len, pos, end_lsn, end, keep, st, recs, blks)
        if status != OK:
            return DONE, pos, recs, blks
        st[S_PREV] = pos
        if end_lsn - pos != maxalign(tot_len) or end_lsn % PAGE == 0:
            return OK, end_lsn, recs, blks
        i += end_lsn - pos
        pos = end_lsn


@helper
def _prev_wrong(xl_prev: int, lsn: int, expect_prev: int) -> bool:
    if expect_prev == NONE:
        return xl_prev < 0 or xl_prev >= lsn
    return xl_prev != expect_prev


@helper
def _cross(st: np.ndarray, pos: int, tot_len: int) -> int:
    """Hand the record at pos, which continues on later pages, to the assembly phase."""
    st[S_PHASE] = PHASE_ASSEMBLE
    st[S_ASM_LSN] = pos
    st[S_ASM_TOT_LEN] = tot_len
    st[S_ASM_GOT] = 0
    return OK


@helper
def _crossing(data: np.ndarray, tail: np.ndarray, tail_final: bool, start: int, end: int, seg_size: int, keep: bool,
              st: np.ndarray, recs: np.ndarray, blks: np.ndarray,
              scratch: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    """Put together (or go on with) the record crossing pages and take it: (OK, where to go on, ...) or the
    status that ends this call."""
    lsn = st[S_ASM_LSN]
    tot_len = st[S_ASM_TOT_LEN]
    if st[S_ASM_GOT] == 0:
        if _stored(data, tail, start, end, lsn - lsn % PAGE) < PAGE:
            st[S_PHASE] = PHASE_RECORDS
            return _stop(st, C.END_IN_RECORD, lsn, 0, 0, 0), lsn, recs, blks, scratch
        _begin_assembly(data, tail, start, end, lsn, st, scratch)
    status, end_lsn = _assemble(data, tail, tail_final, start, end, seg_size, st[S_PREV], st, scratch)
    if status == MORE:
        return MORE, lsn, recs, blks, scratch
    st[S_PHASE] = PHASE_RECORDS
    if status == ABORTED:
        # PostgreSQL restarts at the flagged page; xl_prev stays the last complete record.
        st[S_OVERWRITTEN] = lsn
        return OK, end_lsn, recs, blks, scratch
    if status != OK:
        return STOPPED, lsn, recs, blks, scratch
    have = min(tot_len, _KEEP)
    status, record_end = _finish_special(scratch, 0, have, lsn, end_lsn, seg_size, st)
    if status == FULL:
        scratch = _gather(data, tail, start, end, lsn, tot_len, scratch)
        have = tot_len
        status, record_end = _finish_special(scratch, 0, have, lsn, end_lsn, seg_size, st)
    if status != OK:
        return STOPPED, lsn, recs, blks, scratch
    status, recs, blks = _take(scratch, 0, have, lsn, record_end, end, keep, st, recs, blks)
    if status == FULL:
        scratch = _gather(data, tail, start, end, lsn, tot_len, scratch)
        status, recs, blks = _take(scratch, 0, tot_len, lsn, record_end, end, keep, st, recs, blks)
    if status != OK:
        return DONE, lsn, recs, blks, scratch
    st[S_PREV] = lsn
    return OK, record_end, recs, blks, scratch


# ----- the entry point -----


@compiled
def scan(data: np.ndarray, tail: np.ndarray, tail_final: bool, start: int, seg_size: int, keep: bool,
         st: np.ndarray, recs: np.ndarray, blks: np.ndarray,
         scratch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scan the segment starting at start (data: its bytes, tail: the following segments' heads) from where st
    says, until done (st[S_STATUS] == DONE) or more tail bytes are needed (NEED_MORE); returns the arrays,
    which may have been replaced by larger ones."""
    end = start + seg_size
    st[S_STATUS] = RUNNING
    if st[S_PHASE] == PHASE_START:
        status, info, rem = _page_header(data, tail, tail_final, start, end, seg_size, start, st)
        pos = start + page_header_size(info)
        if status == OK and info & XLP_FIRST_IS_CONTRECORD:
            status, pos = _skip_continuation(data, tail, tail_final, start, end, seg_size, start, info, rem, st)
        if status != OK:
            st[S_STATUS] = DONE
            return recs, blks, scratch
        st[S_POS] = pos
        st[S_PHASE] = PHASE_RECORDS
    status, recs, blks, scratch = _records(data, tail, tail_final, start, end, seg_size, keep, st, recs, blks,
                                           scratch)
    st[S_STATUS] = NEED_MORE if status == MORE else DONE
    return recs, blks, scratch


# ----- page headers of a whole segment (archive._check_pages) -----


@helper
def _zero_page(data: np.ndarray, off: int) -> bool:
    if off + PAGE > data.shape[0]:
        return False
    for k in range(off, off + PAGE):
        if data[k] != 0:
            return False
    return True


@compiled
def check_pages(data: np.ndarray, start: int, seg_size: int, seg_tli: int, limit: int,
                padding_from: int) -> tuple[int, int, int, int, int, int]:
    """(problem code, page LSN, a, b, lowest page timeline, highest) over the page headers below limit; code 0 when
    all are sound, timelines -1 when no page was checked. padding_from (or NONE): where zero pages may follow a
    switch."""
    prev_tli = 0
    tli_min = tli_max = -1
    stop = max(0, min(limit, data.shape[0]) - SizeOfXLogShortPHD + 1)
    for off in range(0, stop, PAGE):
        page = start + off
        if padding_from != NONE and page >= padding_from and _zero_page(data, off):
            continue
        magic, info, tli, pageaddr = _u16(data, off), _u16(data, off + 2), _u32(data, off + 4), _u64(data, off + 8)
        if magic != XLOG_PAGE_MAGIC:
            return C.P_MAGIC, page, magic, 0, tli_min, tli_max
        if info & ~XLP_ALL_FLAGS:
            return C.P_INFO, page, info, 0, tli_min, tli_max
        if (info & XLP_LONG_HEADER != 0) != (off == 0):
            return C.P_LONG, page, off, 0, tli_min, tli_max
        if pageaddr != page:
            return C.P_ADDR, page, pageaddr, 0, tli_min, tli_max
        if off == 0 and data.shape[0] >= SizeOfXLogLongPHD and (
                _u32(data, 32) != seg_size or _u32(data, 36) != XLOG_BLCKSZ):
            return C.P_SIZES, page, _u32(data, 32), _u32(data, 36), tli_min, tli_max
        if tli > seg_tli or tli < prev_tli:
            return C.P_TIMELINE, page, tli, prev_tli, tli_min, tli_max
        prev_tli = tli
        tli_min = tli if tli_min == -1 else min(tli_min, tli)
        tli_max = max(tli_max, tli)
    return 0, 0, 0, 0, tli_min, tli_max

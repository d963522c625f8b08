"""The compiled scan's reasons for stopping, decode errors and page problems: codes, and their text as the Python
reader (WalReader), decode_record and archive._check_pages word them."""

from __future__ import annotations

from collections.abc import Callable

from sidecar.lsn import format_lsn
from sidecar.wal.format import SizeOfXLogRecord


def _lsn(bits: int) -> str:
    """An LSN carried in an int64 (a uint64 above 2**63 comes back negative)."""
    return format_lsn(bits & 0xFFFF_FFFF_FFFF_FFFF)


# Reader stop reasons (WalReader.stop_reason).
(END_AT_PAGE, BAD_MAGIC, BAD_INFO, SEG_SIZE, PAGE_SIZE, NO_LONG_HEADER, PAGEADDR, TIMELINE, ZERO_LENGTH,
 SHORT_LENGTH, LONG_LENGTH, BAD_RMID, PREV_NOT_BEFORE, PREV_MISMATCH, CONT_ZERO_REM, CONT_MISSING, CONT_REM,
 END_IN_RECORD, CONT_MISSING_IN_RECORD, CONT_REM_IN_RECORD, CRC, CONT_REQUESTED, END_AT, OVERWRITE_KIND,
 OVERWRITE_UNREADABLE, OVERWRITE_LSN, NOT_FINISHED) = range(1, 28)

# decode_record's errors; d is the record's LSN.
(D_BLOCK_ID, D_BLOCK_ORDER, D_NO_DATA, D_DATA_LENGTH, D_HOLE, D_NO_HOLE, D_COMPRESSED_FULL, D_IMAGE_LENGTH,
 D_SAME_REL, D_SHORT) = range(101, 111)

# Page header problems of a whole segment (archive._check_pages); c is the file's timeline, d the page's LSN.
(P_MAGIC, P_INFO, P_LONG, P_ADDR, P_SIZES, P_TIMELINE) = range(201, 207)

_TEXT: dict[int, Callable[[int, int, int, int], str]] = {
    END_AT_PAGE: lambda a, b, c, d: f"end of stored WAL at page {_lsn(a)}",
    BAD_MAGIC: lambda a, b, c, d: f"invalid magic number {a:04X} in page header at {_lsn(b)} (page {_lsn(c)})",
    BAD_INFO: lambda a, b, c, d: f"invalid info bits {a:04X} in page header at {_lsn(b)} (page {_lsn(c)})",
    SEG_SIZE: lambda a, b, c, d: f"incorrect segment size {a} in page header at {_lsn(b)}",
    PAGE_SIZE: lambda a, b, c, d: f"incorrect XLOG_BLCKSZ {a} in page header at {_lsn(b)}",
    NO_LONG_HEADER: lambda a, b, c, d: f"invalid info bits {a:04X} at {_lsn(b)}: segment start without a long header",
    PAGEADDR: lambda a, b, c, d: f"page address mismatch: pageaddr {_lsn(a)} at {_lsn(b)}",
    TIMELINE: lambda a, b, c, d: f"out-of-sequence timeline ID {a} (after {b}) at {_lsn(c)}",
    ZERO_LENGTH: lambda a, b, c, d: f"zero record length at {_lsn(a)}",
    SHORT_LENGTH: lambda a, b, c, d: f"invalid record length at {_lsn(a)}: wanted {SizeOfXLogRecord}, got {b}",
    LONG_LENGTH: lambda a, b, c, d: f"record length {b} at {_lsn(a)} too long",
    BAD_RMID: lambda a, b, c, d: f"invalid resource manager ID {b} at {_lsn(a)}",
    PREV_NOT_BEFORE: lambda a, b, c, d: f"xl_prev mismatch at {_lsn(a)}: prev-link {_lsn(b)} is not before the record",
    PREV_MISMATCH: lambda a, b, c, d: f"xl_prev mismatch at {_lsn(a)}: prev-link {_lsn(b)}, expected {_lsn(c)}",
    CONT_ZERO_REM: lambda a, b, c, d: f"contrecord length mismatch at {_lsn(a)}: contrecord flag with zero xlp_rem_len",
    CONT_MISSING: lambda a, b, c, d: f"missing contrecord flag at {_lsn(a)}",
    CONT_REM: lambda a, b, c, d: f"contrecord length mismatch at {_lsn(a)}: xlp_rem_len {b}, expected {c}",
    END_IN_RECORD: lambda a, b, c, d: f"end of stored WAL in record at {_lsn(a)}",
    CONT_MISSING_IN_RECORD: lambda a, b, c, d: f"missing contrecord flag at {_lsn(a)} for record at {_lsn(b)}",
    CONT_REM_IN_RECORD: lambda a, b, c, d: (f"contrecord length mismatch at {_lsn(a)}: xlp_rem_len {b},"
                                            f" expected {c} for record at {_lsn(d)}"),
    CRC: lambda a, b, c, d: f"CRC mismatch at {_lsn(a)}",
    CONT_REQUESTED: lambda a, b, c, d: f"contrecord is requested by {_lsn(a)}",
    END_AT: lambda a, b, c, d: f"end of stored WAL at {_lsn(a)}",
    OVERWRITE_KIND: lambda a, b, c, d: (f"overwrite contrecord mismatch at {_lsn(a)}: expected an OVERWRITE_CONTRECORD"
                                        f" record for the aborted record at {_lsn(b)}, found rmid {c} info {d:02X}"),
    OVERWRITE_UNREADABLE: lambda a, b, c, d: (f"overwrite contrecord mismatch at {_lsn(a)}:"
                                              " unreadable xl_overwrite_contrecord"),
    OVERWRITE_LSN: lambda a, b, c, d: (f"overwrite contrecord mismatch at {_lsn(a)}: overwritten LSN {_lsn(b)},"
                                       f" expected {_lsn(c)}"),
    NOT_FINISHED: lambda a, b, c, d: "not finished",
    D_BLOCK_ID: lambda a, b, c, d: f"invalid block_id {a} at {_lsn(d)}",
    D_BLOCK_ORDER: lambda a, b, c, d: f"out-of-order block_id {a} at {_lsn(d)}",
    D_NO_DATA: lambda a, b, c, d: f"BKPBLOCK_HAS_DATA set, but no data included at {_lsn(d)}",
    D_DATA_LENGTH: lambda a, b, c, d: f"BKPBLOCK_HAS_DATA not set, but data length is {a} at {_lsn(d)}",
    D_HOLE: lambda a, b, c, d: (f"BKPIMAGE_HAS_HOLE set, but hole offset {a} length {b}"
                                f" block image length {c} at {_lsn(d)}"),
    D_NO_HOLE: lambda a, b, c, d: f"BKPIMAGE_HAS_HOLE not set, but hole offset {a} length {b} at {_lsn(d)}",
    D_COMPRESSED_FULL: lambda a, b, c, d: f"BKPIMAGE_COMPRESSED set, but block image length {a} at {_lsn(d)}",
    D_IMAGE_LENGTH: lambda a, b, c, d: (f"neither BKPIMAGE_HAS_HOLE nor BKPIMAGE_COMPRESSED set,"
                                        f" but block image length is {a} at {_lsn(d)}"),
    D_SAME_REL: lambda a, b, c, d: f"BKPBLOCK_SAME_REL set but no previous rel at {_lsn(d)}",
    D_SHORT: lambda a, b, c, d: f"record with invalid length at {_lsn(d)}",
    P_MAGIC: lambda a, b, c, d: f"invalid magic number {a:04X} in page header at {_lsn(d)}",
    P_INFO: lambda a, b, c, d: f"invalid info bits {a:04X} in page header at {_lsn(d)}",
    P_LONG: lambda a, b, c, d: f"{'missing' if a == 0 else 'unexpected'} long page header at {_lsn(d)}",
    P_ADDR: lambda a, b, c, d: f"page address mismatch: pageaddr {_lsn(a)} at {_lsn(d)}",
    P_SIZES: lambda a, b, c, d: f"segment size {a} / page size {b} in the long header at {_lsn(d)}",
    P_TIMELINE: lambda a, b, c, d: f"page timeline {a} after {b} in a timeline {c} file",
}


def describe(code: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> str:
    """The text of a code with its numbers, as WalReader, decode_record or archive._check_pages words it."""
    return _TEXT[code](a, b, c, d)

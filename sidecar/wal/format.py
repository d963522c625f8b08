"""PostgreSQL 15 WAL on-disk layout: page headers, record headers and the record CRC."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import google_crc32c

from sidecar.lsn import WAL_PAGE_SIZE, format_lsn

XLOG_PAGE_MAGIC = 0xD110  # PostgreSQL 15; every major version has its own value

XLP_FIRST_IS_CONTRECORD = 0x0001
XLP_LONG_HEADER = 0x0002
XLP_BKP_REMOVABLE = 0x0004
XLP_FIRST_IS_OVERWRITE_CONTRECORD = 0x0008
XLP_ALL_FLAGS = 0x000F

SizeOfXLogShortPHD = 24
SizeOfXLogLongPHD = 40
SizeOfXLogRecord = 24
XLOG_BLCKSZ = WAL_PAGE_SIZE
BLCKSZ = 8192

XLR_INFO_MASK = 0x0F
RM_XLOG_ID = 0
RM_MAX_BUILTIN_ID = 21
RM_MIN_CUSTOM_ID = 128
RM_MAX_CUSTOM_ID = 255

XLOG_SWITCH = 0x40
XLOG_OVERWRITE_CONTRECORD = 0xD0

XLR_BLOCK_ID_DATA_SHORT = 255
XLR_BLOCK_ID_DATA_LONG = 254
XLR_BLOCK_ID_ORIGIN = 253
XLR_BLOCK_ID_TOPLEVEL_XID = 252

# PostgreSQL's MaxAllocSize: a record this long could never have been decoded.
MAX_RECORD_LENGTH = 0x3FFFFFFF

# xlp_magic, xlp_info, xlp_tli, xlp_pageaddr, xlp_rem_len (+4 pad bytes)
SHORT_PAGE_HEADER = struct.Struct("<HHIQI4x")
# the short header followed by xlp_sysid, xlp_seg_size, xlp_xlog_blcksz
LONG_PAGE_HEADER = struct.Struct("<HHIQI4xQII")
# xl_tot_len, xl_xid, xl_prev, xl_info, xl_rmid, (2 pad bytes), xl_crc
RECORD_HEADER = struct.Struct("<IIQBB2xI")

assert SHORT_PAGE_HEADER.size == SizeOfXLogShortPHD
assert LONG_PAGE_HEADER.size == SizeOfXLogLongPHD
assert RECORD_HEADER.size == SizeOfXLogRecord


class WalFormatError(ValueError):
    """Bytes that are not valid PostgreSQL 15 WAL."""


@dataclass(frozen=True)
class PageHeader:
    """XLogPageHeaderData, plus the XLogLongPageHeaderData fields when XLP_LONG_HEADER is set."""

    magic: int
    info: int
    tli: int
    pageaddr: int
    rem_len: int
    sysid: int | None = None
    seg_size: int | None = None
    blcksz: int | None = None

    @property
    def is_long(self) -> bool:
        return bool(self.info & XLP_LONG_HEADER)

    @property
    def size(self) -> int:
        """Bytes the header occupies at the start of its page."""
        return SizeOfXLogLongPHD if self.info & XLP_LONG_HEADER else SizeOfXLogShortPHD

    @property
    def is_contrecord(self) -> bool:
        return bool(self.info & XLP_FIRST_IS_CONTRECORD)

    @property
    def is_overwrite_contrecord(self) -> bool:
        return bool(self.info & XLP_FIRST_IS_OVERWRITE_CONTRECORD)


@dataclass(frozen=True)
class RecordHeader:
    """XLogRecord: the fixed 24-byte header every WAL record starts with."""

    tot_len: int
    xid: int
    prev: int
    info: int
    rmid: int
    crc: int

    @property
    def is_switch(self) -> bool:
        return self.rmid == RM_XLOG_ID and (self.info & ~XLR_INFO_MASK) == XLOG_SWITCH

    @property
    def is_overwrite_contrecord(self) -> bool:
        return self.rmid == RM_XLOG_ID and (self.info & ~XLR_INFO_MASK) == XLOG_OVERWRITE_CONTRECORD


def rmid_is_valid(rmid: int) -> bool:
    """PostgreSQL's RmgrIdIsValid: a builtin or a custom resource manager id."""
    return 0 <= rmid <= RM_MAX_BUILTIN_ID or RM_MIN_CUSTOM_ID <= rmid <= RM_MAX_CUSTOM_ID


def page_header_size(info: int) -> int:
    """XLogPageHeaderSize for a page whose xlp_info is info."""
    return SizeOfXLogLongPHD if info & XLP_LONG_HEADER else SizeOfXLogShortPHD


def parse_page_header(buf: bytes, offset: int = 0) -> PageHeader:
    """Decode the page header at buf[offset:], checking only magic, info bits and length."""
    if len(buf) - offset < SizeOfXLogShortPHD:
        raise WalFormatError(f"page header needs {SizeOfXLogShortPHD} bytes, got {max(0, len(buf) - offset)}")
    magic, info, tli, pageaddr, rem_len = SHORT_PAGE_HEADER.unpack_from(buf, offset)
    if magic != XLOG_PAGE_MAGIC:
        raise WalFormatError(f"invalid magic number {magic:04X} in page header at {format_lsn(pageaddr)}")
    if info & ~XLP_ALL_FLAGS:
        raise WalFormatError(f"invalid info bits {info:04X} in page header at {format_lsn(pageaddr)}")
    if not info & XLP_LONG_HEADER:
        return PageHeader(magic, info, tli, pageaddr, rem_len)
    if len(buf) - offset < SizeOfXLogLongPHD:
        raise WalFormatError(f"long page header needs {SizeOfXLogLongPHD} bytes, got {len(buf) - offset}")
    _, _, _, _, _, sysid, seg_size, blcksz = LONG_PAGE_HEADER.unpack_from(buf, offset)
    return PageHeader(magic, info, tli, pageaddr, rem_len, sysid, seg_size, blcksz)


def validate_page_header(
    hdr: PageHeader,
    page_lsn: int,
    seg_size: int,
    *,
    system_id: int | None = None,
) -> None:
    """XLogReaderValidatePageHeader without the timeline check; raises WalFormatError."""
    where = format_lsn(page_lsn)
    if page_lsn % XLOG_BLCKSZ:
        raise WalFormatError(f"{where} is not a page boundary")
    if hdr.magic != XLOG_PAGE_MAGIC:
        raise WalFormatError(f"invalid magic number {hdr.magic:04X} at {where}")
    if hdr.info & ~XLP_ALL_FLAGS:
        raise WalFormatError(f"invalid info bits {hdr.info:04X} at {where}")
    if hdr.info & XLP_LONG_HEADER:
        if system_id is not None and hdr.sysid != system_id:
            raise WalFormatError(
                f"WAL at {where} is from a different database system: system identifier {hdr.sysid}, expected {system_id}"
            )
        if hdr.seg_size != seg_size:
            raise WalFormatError(f"incorrect segment size {hdr.seg_size} in page header at {where}")
        if hdr.blcksz != XLOG_BLCKSZ:
            raise WalFormatError(f"incorrect XLOG_BLCKSZ {hdr.blcksz} in page header at {where}")
    elif page_lsn % seg_size == 0:
        raise WalFormatError(f"invalid info bits {hdr.info:04X} at {where}: segment start without a long header")
    if hdr.pageaddr != page_lsn:
        raise WalFormatError(f"page address mismatch: pageaddr {format_lsn(hdr.pageaddr)} at {where}")


def parse_record_header(buf: bytes, offset: int = 0) -> RecordHeader:
    """Decode the 24-byte record header at buf[offset:], checking tot_len and rmid."""
    if len(buf) - offset < SizeOfXLogRecord:
        raise WalFormatError(f"record header needs {SizeOfXLogRecord} bytes, got {max(0, len(buf) - offset)}")
    hdr = RecordHeader(*RECORD_HEADER.unpack_from(buf, offset))
    if hdr.tot_len < SizeOfXLogRecord:
        raise WalFormatError(f"invalid record length: wanted {SizeOfXLogRecord}, got {hdr.tot_len}")
    if hdr.tot_len > MAX_RECORD_LENGTH:
        raise WalFormatError(f"record length {hdr.tot_len} too long")
    if not rmid_is_valid(hdr.rmid):
        raise WalFormatError(f"invalid resource manager ID {hdr.rmid}")
    return hdr


def record_crc(record_bytes: bytes) -> int:
    """CRC-32C of a whole record as PostgreSQL computes xl_crc: the body first, then the header up to xl_crc."""
    if len(record_bytes) < SizeOfXLogRecord:
        raise WalFormatError(f"record needs at least {SizeOfXLogRecord} bytes, got {len(record_bytes)}")
    data = bytes(record_bytes)
    tot_len = struct.unpack_from("<I", data, 0)[0]
    if tot_len > len(data):
        raise WalFormatError(f"record says {tot_len} bytes but only {len(data)} given")
    crc = google_crc32c.value(data[SizeOfXLogRecord:tot_len])
    return google_crc32c.extend(crc, data[:20])


def main_data(record_bytes: bytes) -> bytes | None:
    """The main data of a record without block references, or None when blocks are present or the layout is bad."""
    data = bytes(record_bytes)
    tot_len = min(len(data), struct.unpack_from("<I", data, 0)[0])
    pos = SizeOfXLogRecord
    while pos < tot_len:
        block_id = data[pos]
        if block_id == XLR_BLOCK_ID_DATA_SHORT:
            if pos + 2 > tot_len:
                return None
            length = data[pos + 1]
            pos += 2
        elif block_id == XLR_BLOCK_ID_DATA_LONG:
            if pos + 5 > tot_len:
                return None
            length = struct.unpack_from("<I", data, pos + 1)[0]
            pos += 5
        elif block_id == XLR_BLOCK_ID_ORIGIN:
            pos += 3
            continue
        elif block_id == XLR_BLOCK_ID_TOPLEVEL_XID:
            pos += 5
            continue
        else:
            return None
        # The main data is always last, right after the header fragments.
        if pos + length != tot_len:
            return None
        return data[pos:tot_len]
    return b""

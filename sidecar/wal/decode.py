"""Decoding of a PostgreSQL 15 WAL record's body (DecodeXLogRecord): block references, full-page images, main data.

Also the commit/abort timestamp of transaction records and the restore of full-page images
(uncompressed, pglz, lz4 or zstd) into 8 KiB pages.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from sidecar.lsn import format_lsn
from sidecar.wal.format import (
    BLCKSZ,
    XLR_BLOCK_ID_DATA_LONG,
    XLR_BLOCK_ID_DATA_SHORT,
    XLR_BLOCK_ID_ORIGIN,
    XLR_BLOCK_ID_TOPLEVEL_XID,
    SizeOfXLogRecord,
    WalFormatError,
)
from sidecar.wal.rmgrdesc import RM_XACT_ID, XLOG_XACT_OPMASK

XLR_MAX_BLOCK_ID = 32

BKPBLOCK_FORK_MASK = 0x0F
BKPBLOCK_HAS_IMAGE = 0x10
BKPBLOCK_HAS_DATA = 0x20
BKPBLOCK_WILL_INIT = 0x40
BKPBLOCK_SAME_REL = 0x80

# PostgreSQL 15 values; 14 and earlier used other bits (IS_COMPRESSED 0x02, APPLY 0x04).
BKPIMAGE_HAS_HOLE = 0x01
BKPIMAGE_APPLY = 0x02
BKPIMAGE_COMPRESS_PGLZ = 0x04
BKPIMAGE_COMPRESS_LZ4 = 0x08
BKPIMAGE_COMPRESS_ZSTD = 0x10
BKPIMAGE_COMPRESSED = BKPIMAGE_COMPRESS_PGLZ | BKPIMAGE_COMPRESS_LZ4 | BKPIMAGE_COMPRESS_ZSTD

FORK_NAMES = ("main", "fsm", "vm", "init")

XLOG_XACT_COMMIT = 0x00
XLOG_XACT_ABORT = 0x20
XLOG_XACT_COMMIT_PREPARED = 0x30
XLOG_XACT_ABORT_PREPARED = 0x40
XACT_COMMITS = frozenset((XLOG_XACT_COMMIT, XLOG_XACT_COMMIT_PREPARED))
XACT_ABORTS = frozenset((XLOG_XACT_ABORT, XLOG_XACT_ABORT_PREPARED))
_XACT_TIMED = XACT_COMMITS | XACT_ABORTS

# PostgreSQL timestamps count microseconds from 2000-01-01 00:00:00 UTC.
POSTGRES_EPOCH_UNIX_US = 946_684_800_000_000

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_BLOCK_HEADER = struct.Struct("<BH")  # fork_flags, data_length (after the block id byte)
_IMAGE_HEADER = struct.Struct("<HHB")  # length, hole_offset, bimg_info
_RELFILENODE_BLKNO = struct.Struct("<IIII")  # spcNode, dbNode, relNode, block number
_BLKNO = struct.Struct("<I")
_U8 = struct.Struct("<B")
_FRAGMENTS = {
    XLR_BLOCK_ID_DATA_SHORT: _U8,
    XLR_BLOCK_ID_DATA_LONG: _U32,
    XLR_BLOCK_ID_ORIGIN: _U16,
    XLR_BLOCK_ID_TOPLEVEL_XID: _U32,
}


class BlockRef(NamedTuple):
    """One block reference of a record (DecodedBkpBlock); offsets point into the record's bytes."""

    block_id: int
    fork_flags: int
    spc: int
    db: int
    rel: int
    blkno: int
    data_len: int
    bimg_len: int  # stored image bytes (hole removed, maybe compressed); 0 without an image
    hole_offset: int
    hole_length: int
    bimg_info: int
    image_offset: int  # where the stored image starts in the record, -1 without one
    data_offset: int  # where the block data starts in the record

    @property
    def fork(self) -> int:
        return self.fork_flags & BKPBLOCK_FORK_MASK

    @property
    def has_image(self) -> bool:
        return bool(self.fork_flags & BKPBLOCK_HAS_IMAGE)

    @property
    def compression(self) -> str | None:
        """pglz, lz4 or zstd for a compressed image, None otherwise."""
        return compression_name(self.bimg_info) if self.has_image else None


class DecodedRecord(NamedTuple):
    """The header fragments of a record: its block references and where its main data lies."""

    blocks: tuple[BlockRef, ...]
    main_offset: int
    main_len: int
    origin: int | None
    toplevel_xid: int | None

    @property
    def fpi_len(self) -> int:
        """Bytes of full-page images stored in the record (pg_waldump's "FPI size")."""
        return sum(b.bimg_len for b in self.blocks)


def compression_name(bimg_info: int) -> str | None:
    """The image compression method named by bimg_info, or None for an uncompressed image."""
    if bimg_info & BKPIMAGE_COMPRESS_PGLZ:
        return "pglz"
    if bimg_info & BKPIMAGE_COMPRESS_LZ4:
        return "lz4"
    if bimg_info & BKPIMAGE_COMPRESS_ZSTD:
        return "zstd"
    return None


def decode_record(data: bytes, lsn: int = 0) -> DecodedRecord:
    """Decode the header fragments after the 24-byte record header, with DecodeXLogRecord's checks.

    data holds the whole record (xl_tot_len bytes); lsn only names the record in errors.
    """
    end = len(data)
    pos = SizeOfXLogRecord
    datatotal = 0
    blocks: list[BlockRef] = []
    max_block_id = -1
    main_len = 0
    origin: int | None = None
    toplevel: int | None = None
    rel: tuple[int, int, int] | None = None
    # Parsed (block, fork_flags, data_len, bimg_len, hole_offset, hole_length, bimg_info, spc, db, rel, blkno).
    raw: list[tuple[int, int, int, int, int, int, int, int, int, int, int]] = []
    # data is exactly the record: a header field running past its end fails to unpack (PostgreSQL's
    # "remaining < size" checks).
    try:
        while end - pos > datatotal:
            block_id = data[pos]
            pos += 1
            if block_id > XLR_MAX_BLOCK_ID:
                # A fixed-size fragment: main data length (which ends the headers), origin or top-level xid.
                field = _FRAGMENTS.get(block_id)
                if field is None:
                    raise WalFormatError(f"invalid block_id {block_id} at {format_lsn(lsn)}")
                value = field.unpack_from(data, pos)[0]
                pos += field.size
                if block_id == XLR_BLOCK_ID_ORIGIN:
                    origin = value
                elif block_id == XLR_BLOCK_ID_TOPLEVEL_XID:
                    toplevel = value
                else:
                    main_len = value
                    datatotal += main_len
                    break  # the main data fragment is always last
                continue
            if block_id <= max_block_id:
                raise WalFormatError(f"out-of-order block_id {block_id} at {format_lsn(lsn)}")
            max_block_id = block_id
            fork_flags, data_len = _BLOCK_HEADER.unpack_from(data, pos)
            pos += 3
            has_data = fork_flags & BKPBLOCK_HAS_DATA
            if has_data and data_len == 0:
                raise WalFormatError(f"BKPBLOCK_HAS_DATA set, but no data included at {format_lsn(lsn)}")
            if not has_data and data_len != 0:
                raise WalFormatError(
                    f"BKPBLOCK_HAS_DATA not set, but data length is {data_len} at {format_lsn(lsn)}"
                )
            datatotal += data_len
            bimg_len = hole_offset = hole_length = bimg_info = 0
            if fork_flags & BKPBLOCK_HAS_IMAGE:
                bimg_len, hole_offset, bimg_info = _IMAGE_HEADER.unpack_from(data, pos)
                pos += 5
                if not bimg_info & BKPIMAGE_COMPRESSED:
                    hole_length = BLCKSZ - bimg_len
                elif bimg_info & BKPIMAGE_HAS_HOLE:
                    hole_length = _U16.unpack_from(data, pos)[0]
                    pos += 2
                datatotal += bimg_len
                _check_image(bimg_len, hole_offset, hole_length, bimg_info, lsn)
            if fork_flags & BKPBLOCK_SAME_REL:
                if rel is None:
                    raise WalFormatError(f"BKPBLOCK_SAME_REL set but no previous rel at {format_lsn(lsn)}")
                blkno = _BLKNO.unpack_from(data, pos)[0]
                pos += 4
            else:
                spc, db, relnode, blkno = _RELFILENODE_BLKNO.unpack_from(data, pos)
                rel = (spc, db, relnode)
                pos += 16
            raw.append((block_id, fork_flags, data_len, bimg_len, hole_offset, hole_length, bimg_info, *rel, blkno))
    except (IndexError, struct.error):
        raise _short(lsn) from None
    if end - pos != datatotal:
        raise _short(lsn)
    # The data area follows the headers: per block its image then its data, then the main data.
    for block_id, fork_flags, data_len, bimg_len, hole_offset, hole_length, bimg_info, spc, db, relnode, blkno in raw:
        image_offset = -1
        if fork_flags & BKPBLOCK_HAS_IMAGE:
            image_offset = pos
            pos += bimg_len
        blocks.append(
            BlockRef(block_id, fork_flags, spc, db, relnode, blkno, data_len, bimg_len, hole_offset, hole_length,
                     bimg_info, image_offset, pos)
        )
        pos += data_len
    return DecodedRecord(tuple(blocks), pos, main_len, origin, toplevel)


def _short(lsn: int) -> WalFormatError:
    return WalFormatError(f"record with invalid length at {format_lsn(lsn)}")


def _check_image(bimg_len: int, hole_offset: int, hole_length: int, bimg_info: int, lsn: int) -> None:
    """DecodeXLogRecord's cross-checks of an image header."""
    where = format_lsn(lsn)
    has_hole = bimg_info & BKPIMAGE_HAS_HOLE
    compressed = bimg_info & BKPIMAGE_COMPRESSED
    if has_hole and (hole_offset == 0 or hole_length == 0 or bimg_len == BLCKSZ):
        raise WalFormatError(
            f"BKPIMAGE_HAS_HOLE set, but hole offset {hole_offset} length {hole_length}"
            f" block image length {bimg_len} at {where}"
        )
    if not has_hole and (hole_offset != 0 or hole_length != 0):
        raise WalFormatError(
            f"BKPIMAGE_HAS_HOLE not set, but hole offset {hole_offset} length {hole_length} at {where}"
        )
    if compressed and bimg_len == BLCKSZ:
        raise WalFormatError(f"BKPIMAGE_COMPRESSED set, but block image length {bimg_len} at {where}")
    if not has_hole and not compressed and bimg_len != BLCKSZ:
        raise WalFormatError(
            f"neither BKPIMAGE_HAS_HOLE nor BKPIMAGE_COMPRESSED set, but block image length is {bimg_len} at {where}"
        )


def xact_time(rmid: int, info: int, data: bytes, decoded: DecodedRecord) -> int | None:
    """Commit or abort time (PostgreSQL µs since 2000-01-01 UTC) of a transaction record, None for other records."""
    if rmid != RM_XACT_ID or info & XLOG_XACT_OPMASK not in _XACT_TIMED or decoded.main_len < 8:
        return None
    # xl_xact_commit and xl_xact_abort both begin with TimestampTz xact_time.
    return _I64.unpack_from(data, decoded.main_offset)[0]


def is_commit(rmid: int, info: int) -> bool:
    """A COMMIT or COMMIT_PREPARED record."""
    return rmid == RM_XACT_ID and info & XLOG_XACT_OPMASK in XACT_COMMITS


def is_abort(rmid: int, info: int) -> bool:
    """An ABORT or ABORT_PREPARED record."""
    return rmid == RM_XACT_ID and info & XLOG_XACT_OPMASK in XACT_ABORTS


def restore_block_image(data: bytes, block: BlockRef) -> bytes:
    """The 8 KiB page a full-page image restores to (RestoreBlockImage): decompress, then re-insert the hole."""
    if not block.has_image:
        raise ValueError(f"block {block.block_id} carries no image")
    stored = bytes(data[block.image_offset : block.image_offset + block.bimg_len])
    want = BLCKSZ - block.hole_length
    method = compression_name(block.bimg_info)
    if method is None:
        raw = stored
    elif method == "pglz":
        raw = pglz_decompress(stored, want)
    elif method == "lz4":
        import lz4.block

        raw = lz4.block.decompress(stored, uncompressed_size=want)
    else:
        import zstandard

        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=want)
    if len(raw) != want:
        raise WalFormatError(f"{method or 'stored'} image of block {block.block_id} gives {len(raw)} bytes, expected {want}")
    if block.hole_length == 0:
        return raw
    off = block.hole_offset
    return raw[:off] + bytes(block.hole_length) + raw[off:]


def pglz_decompress(source: bytes, rawsize: int) -> bytes:
    """PostgreSQL's pglz_decompress with check_complete: exactly rawsize bytes from all of source."""
    out = bytearray()
    sp = 0
    srcend = len(source)
    while sp < srcend and len(out) < rawsize:
        ctrl = source[sp]
        sp += 1
        for _ in range(8):
            if sp >= srcend or len(out) >= rawsize:
                break
            if ctrl & 1:
                # A match tag: 4 bits of length - 3 and 12 bits of offset back into the output;
                # length 18 means an extension byte adds up to 255 more.
                if sp + 1 >= srcend:
                    raise WalFormatError("corrupt pglz data: truncated match tag")
                length = (source[sp] & 0x0F) + 3
                off = ((source[sp] & 0xF0) << 4) | source[sp + 1]
                sp += 2
                if length == 18:
                    if sp >= srcend:
                        raise WalFormatError("corrupt pglz data: truncated match length")
                    length += source[sp]
                    sp += 1
                if off == 0 or off > len(out):
                    raise WalFormatError("corrupt pglz data: bad match offset")
                length = min(length, rawsize - len(out))
                start = len(out) - off
                # The source of a match may overlap what it produces: copy in rounds of at most off bytes.
                while length > 0:
                    n = min(length, off)
                    out += out[start : start + n]
                    start += n
                    length -= n
            else:
                out.append(source[sp])
                sp += 1
            ctrl >>= 1
    if len(out) != rawsize or sp != srcend:
        raise WalFormatError(f"corrupt pglz data: {len(out)} of {rawsize} bytes from {sp} of {srcend} input bytes")
    return bytes(out)

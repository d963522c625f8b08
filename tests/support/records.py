"""Synthesised WAL record bodies: block headers, full-page images with holes, and invalid block layouts."""

from __future__ import annotations

import struct

from sidecar.wal.decode import (
    BKPBLOCK_HAS_DATA,
    BKPBLOCK_HAS_IMAGE,
    BKPBLOCK_SAME_REL,
    BKPIMAGE_COMPRESS_LZ4,
    BKPIMAGE_COMPRESS_PGLZ,
    BKPIMAGE_COMPRESS_ZSTD,
    BKPIMAGE_HAS_HOLE,
)
from sidecar.wal.format import RECORD_HEADER, record_crc

PAGE = 8192


def page_with_hole(lower: int, upper: int, fill: int = 0x5A) -> bytes:
    """An 8 KiB heap-like page: header, line pointers up to lower, zeroes, tuples from upper."""
    head = struct.pack("<QHHHHHH", 0, 0, 0, lower, upper, PAGE, 0x2004)
    body = bytes((i * 7 + fill) & 0xFF for i in range(lower - len(head)))
    tail = bytes((i * 13 + fill) & 0xFF for i in range(PAGE - upper))
    return head + body + bytes(upper - lower) + tail


def pglz_runs(data: bytes) -> bytes:
    """A pglz stream for data: literals, and back-references of distance 1 for runs (overlapping copies)."""
    out = bytearray()
    items: list[bytes] = []
    i = 0
    while i < len(data):
        run = 1
        while i + run < len(data) and data[i + run] == data[i] and run < 274:
            run += 1
        if i > 0 and data[i - 1] == data[i] and run >= 3:
            n = min(run, 273)
            tag = bytes([min(n - 3, 15), 1]) + (bytes([n - 18]) if n >= 18 else b"")
            items.append(tag)
            i += n
        else:
            items.append(bytes([data[i]]))
            i += 1
    for start in range(0, len(items), 8):
        group = items[start : start + 8]
        ctrl = sum(1 << k for k, item in enumerate(group) if len(item) > 1)
        out.append(ctrl)
        for item in group:
            out += item
    return bytes(out)


def build_record(
    blocks: list[dict[str, object]],
    main: bytes = b"",
    *,
    rmid: int = 10,
    info: int = 0,
    origin: int | None = None,
    toplevel: int | None = None,
    prev: int = 0x1000028,
) -> bytes:
    """A record with block references as XLogRecordAssemble lays them out, with a valid CRC."""
    headers = bytearray()
    payload = bytearray()
    for b in blocks:
        image: bytes = b.get("image", b"")  # type: ignore[assignment]
        data: bytes = b.get("data", b"")  # type: ignore[assignment]
        flags = int(b.get("fork", 0)) | int(b.get("flags", 0))
        if image:
            flags |= BKPBLOCK_HAS_IMAGE
        if data:
            flags |= BKPBLOCK_HAS_DATA
        headers += struct.pack("<BBH", int(b["id"]), flags, len(data))
        if image:
            bimg_info = int(b.get("bimg_info", 0))
            headers += struct.pack("<HHB", len(image), int(b.get("hole_offset", 0)), bimg_info)
            if bimg_info & (BKPIMAGE_COMPRESS_PGLZ | BKPIMAGE_COMPRESS_LZ4 | BKPIMAGE_COMPRESS_ZSTD) and bimg_info & BKPIMAGE_HAS_HOLE:
                headers += struct.pack("<H", int(b["hole_length"]))
        if not flags & BKPBLOCK_SAME_REL:
            headers += struct.pack("<III", *b["rel"])  # type: ignore[misc]
        headers += struct.pack("<I", int(b["blkno"]))
        payload += image + data
    if origin is not None:
        headers += struct.pack("<BH", 253, origin)
    if toplevel is not None:
        headers += struct.pack("<BI", 252, toplevel)
    if main:
        headers += bytes([255, len(main)]) if len(main) <= 255 else bytes([254]) + struct.pack("<I", len(main))
    body = bytes(headers + payload + main)
    rec = bytearray(RECORD_HEADER.pack(24 + len(body), 7, prev, info, rmid, 0) + body)
    struct.pack_into("<I", rec, 20, record_crc(bytes(rec)))
    return bytes(rec)




INVALID_BLOCKS: list[tuple[list[dict[str, object]], str]] = [
    ([{"id": 2, "rel": (1, 1, 1), "blkno": 0}, {"id": 1, "rel": (1, 1, 1), "blkno": 0}], "out-of-order block_id"),
    ([{"id": 0, "flags": BKPBLOCK_SAME_REL, "blkno": 0}], "no previous rel"),
    # Uncompressed without a hole: the implied hole length (8192 - 100) trips the first check, as in PostgreSQL.
    ([{"id": 0, "rel": (1, 1, 1), "blkno": 0, "image": b"x" * 100, "bimg_info": 0}], "HAS_HOLE not set"),
    ([{"id": 0, "rel": (1, 1, 1), "blkno": 0, "image": b"x" * PAGE, "bimg_info": BKPIMAGE_COMPRESS_LZ4}],
     "COMPRESSED set, but block image length 8192"),
    ([{"id": 0, "rel": (1, 1, 1), "blkno": 0, "image": b"x" * 100, "bimg_info": BKPIMAGE_HAS_HOLE}], "HAS_HOLE set"),
    ([{"id": 0, "rel": (1, 1, 1), "blkno": 0, "image": b"x" * 100, "hole_offset": 5, "bimg_info": BKPIMAGE_COMPRESS_LZ4}],
     "HAS_HOLE not set"),
]

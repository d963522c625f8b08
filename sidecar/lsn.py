"""LSN arithmetic, text form and WAL segment naming (PostgreSQL 15 layout)."""

from __future__ import annotations

import re

Lsn = int  # a byte position in the WAL stream; 0 is InvalidXLogRecPtr

INVALID_LSN: Lsn = 0
WAL_PAGE_SIZE = 8192
DEFAULT_SEGMENT_SIZE = 16 * 1024 * 1024
MAXALIGN = 8

_LSN_RE = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")
_SEGMENT_RE = re.compile(r"^([0-9A-F]{8})([0-9A-F]{8})([0-9A-F]{8})(\.partial)?$")


def parse_lsn(text: str) -> Lsn:
    """Parse PostgreSQL's `X/Y` text form."""
    m = _LSN_RE.match(text.strip())
    if not m:
        raise ValueError(f"not an LSN: {text!r} (expected the form 0/16B3748)")
    return (int(m.group(1), 16) << 32) | int(m.group(2), 16)


def format_lsn(lsn: Lsn) -> str:
    """Format as PostgreSQL does: `%X/%X`."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def maxalign(n: int) -> int:
    return (n + MAXALIGN - 1) & ~(MAXALIGN - 1)


def segment_number(lsn: Lsn, seg_size: int = DEFAULT_SEGMENT_SIZE) -> int:
    return lsn // seg_size


def segment_start(lsn: Lsn, seg_size: int = DEFAULT_SEGMENT_SIZE) -> Lsn:
    return lsn - lsn % seg_size


def segments_per_xlogid(seg_size: int) -> int:
    return 0x100000000 // seg_size


def segment_file_name(timeline: int, segno: int, seg_size: int = DEFAULT_SEGMENT_SIZE) -> str:
    """Name of a WAL segment file, as in pg_wal (`TTTTTTTTXXXXXXXXYYYYYYYY`)."""
    per_id = segments_per_xlogid(seg_size)
    return f"{timeline:08X}{segno // per_id:08X}{segno % per_id:08X}"


def parse_segment_file_name(name: str, seg_size: int = DEFAULT_SEGMENT_SIZE) -> tuple[int, int, bool]:
    """Return (timeline, segno, is_partial) for a segment file name."""
    m = _SEGMENT_RE.match(name)
    if not m:
        raise ValueError(f"not a WAL segment file name: {name!r}")
    tli, hi, lo = (int(g, 16) for g in m.groups()[:3])
    return tli, hi * segments_per_xlogid(seg_size) + lo, m.group(4) is not None

"""Checking WAL fetched from a safekeeper before PostgreSQL is given it (sidecar/wal/verify.py)."""

from __future__ import annotations

import pytest

from support.walbuilder import DEFAULT_SYSID, WalBuilder
from sidecar.wal.format import WalFormatError
from sidecar.wal.verify import check_segment_wal

SEG = 1 << 20
START = 3 * SEG


def segment(tli: int = 1, switch: bool = False) -> WalBuilder:
    b = WalBuilder(START, seg_size=SEG, tli=tli)
    b.fill_to(START + SEG // 2, size=300)
    if switch:
        b.switch()
    else:
        b.fill_to(START + SEG, size=300)
    return b


def check(data: bytes, **kw: object) -> None:
    check_segment_wal(data, START, SEG, system_id=kw.pop("system_id", DEFAULT_SYSID),  # type: ignore[arg-type]
                      timeline=kw.pop("timeline", 1))  # type: ignore[arg-type]


def test_a_whole_segment_a_prefix_cut_anywhere_and_a_switched_one_pass() -> None:
    b = segment()
    check(b.bytes()[:SEG])
    for cut in (40, 8192 + 100, SEG // 3 + 5):
        check(b.bytes()[:cut])
    check(segment(switch=True).bytes()[:SEG])


def test_a_flipped_byte_in_a_record_is_refused_by_its_crc() -> None:
    b = segment()
    rec = b.records[len(b.records) // 2]
    b.corrupt(rec.lsn + 30, b"\xff\x00\xff")
    with pytest.raises(WalFormatError, match="CRC mismatch"):
        check(b.bytes()[:SEG])


def test_bad_page_headers_other_systems_and_later_timelines_are_refused() -> None:
    data = bytearray(segment().bytes()[:SEG])
    data[8192 * 5 + 8] ^= 0x01  # the page's own address
    with pytest.raises(WalFormatError, match="page address"):
        check(bytes(data))
    with pytest.raises(WalFormatError, match="different database system"):
        check(segment().bytes()[:SEG], system_id=DEFAULT_SYSID + 1)
    with pytest.raises(WalFormatError, match="timeline 2"):
        check(segment(tli=2).bytes()[:SEG], timeline=1)
    check(segment(tli=1).bytes()[:SEG], timeline=2)  # a new timeline's segment begins with its parent's WAL


def test_zeroed_pages_only_at_the_end_and_never_first() -> None:
    data = bytearray(segment().bytes()[:SEG])
    data[8192 * 4:8192 * 5] = bytes(8192)
    with pytest.raises(WalFormatError):
        check(bytes(data))
    with pytest.raises(WalFormatError, match="begins with a zeroed page"):
        check(bytes(SEG))
    with pytest.raises(WalFormatError, match="no WAL"):
        check(b"")
    with pytest.raises(WalFormatError, match="more than a segment"):
        check(bytes(SEG + 1))

"""Checking WAL read from elsewhere before PostgreSQL is given it: page headers and every record's CRC."""

from __future__ import annotations

from sidecar.lsn import WAL_PAGE_SIZE, format_lsn
from sidecar.wal.format import (
    SizeOfXLogLongPHD,
    SizeOfXLogShortPHD,
    WalFormatError,
    parse_page_header,
    validate_page_header,
)
from sidecar.wal.reader import BytesSource, WalReader


def check_segment_wal(data: bytes, start: int, seg_size: int, *, system_id: int | None, timeline: int) -> None:
    """WalFormatError unless `data` (WAL from `start`, a segment start) is valid as far as it goes.

    Every page header present must be right for its address (and at the segment start, for the
    system and segment size), on no later timeline than `timeline`; zeroed pages may only end a
    segment (the padding after a WAL switch). Every record that lies wholly in `data` must have
    its CRC; only the last may be cut by the end of `data`.
    """
    if start % seg_size:
        raise WalFormatError(f"WAL from {format_lsn(start)} does not begin a segment")
    if not data:
        raise WalFormatError(f"no WAL at {format_lsn(start)}")
    if len(data) > seg_size:
        raise WalFormatError(f"{len(data)} bytes of WAL is more than a segment ({seg_size})")
    zeroed_from: int | None = None
    latest_tli = 0
    for off in range(0, len(data), WAL_PAGE_SIZE):
        lsn = start + off
        raw = data[off:off + SizeOfXLogLongPHD]
        if len(raw) < (SizeOfXLogLongPHD if off == 0 else SizeOfXLogShortPHD):
            break  # the data ends inside this page's header: nothing on the page to check
        if not any(data[off:off + WAL_PAGE_SIZE]):
            if off == 0:
                raise WalFormatError(f"the segment at {format_lsn(lsn)} begins with a zeroed page")
            zeroed_from = lsn if zeroed_from is None else zeroed_from
            continue
        if zeroed_from is not None:
            raise WalFormatError(f"a written page at {format_lsn(lsn)} follows zeroed pages from "
                                 f"{format_lsn(zeroed_from)}")
        hdr = parse_page_header(raw)
        validate_page_header(hdr, lsn, seg_size, system_id=system_id)
        if not latest_tli <= hdr.tli <= timeline:
            raise WalFormatError(f"the page at {format_lsn(lsn)} is on timeline {hdr.tli}, after timeline "
                                 f"{latest_tli} and not on the segment's timeline {timeline} or before")
        latest_tli = hdr.tli
    reader = WalReader(BytesSource(start, data), start, seg_size=seg_size, system_id=system_id)
    for _ in reader.tuples():
        pass
    # The record chain must run to the end of the data (or past it, after a WAL switch).
    if not reader.stop_reason.startswith("end of stored WAL"):
        raise WalFormatError(f"the record chain breaks after {format_lsn(reader.stop_lsn)}: {reader.stop_reason}")

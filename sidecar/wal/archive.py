"""Archived WAL as segment files in a sidecar.objectstore store: which ones form the WAL, and one segment's scan.

A record belongs to the segment where it starts. Scanning a segment decodes and checks the records starting
in it and finishes the last one by reading only the head of the following segment(s); a per-segment summary
then lets the caller check that consecutive segments chain together (see check_chain).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.lsn import (
    DEFAULT_SEGMENT_SIZE,
    WAL_PAGE_SIZE,
    format_lsn,
    maxalign,
    parse_lsn,
    parse_segment_file_name,
    segment_file_name,
)
from sidecar.objectstore import LocalStorage, S3Storage, Storage, open_storage  # noqa: F401 - re-exported
from sidecar.pgrepl import parse_timeline_history
from sidecar.wal import stopcodes
from sidecar.wal.decode import BlockRef, decode_record, xact_time
from sidecar.wal.format import (
    LONG_PAGE_HEADER,
    RM_XLOG_ID,
    SHORT_PAGE_HEADER,
    XLOG_BLCKSZ,
    XLOG_PAGE_MAGIC,
    XLOG_SWITCH,
    XLP_ALL_FLAGS,
    XLP_FIRST_IS_CONTRECORD,
    XLP_LONG_HEADER,
    SizeOfXLogLongPHD,
    SizeOfXLogShortPHD,
    WalFormatError,
    page_header_size,
)
from sidecar.wal.reader import WalReader
from sidecar.wal.recordscan import (
    BLOCK_COLUMNS,
    RECORD_COLUMNS,
    RecordScan,
    empty_columns,
)
from sidecar.wal.rmgrdesc import RM_XACT_ID

_SEGMENT_NAME = re.compile(r"^[0-9A-F]{24}(\.partial)?$")
_HISTORY_NAME = re.compile(r"^([0-9A-F]{8})\.history$")
# Where a reader stop reason places the problem: "(page X)" when given, else the first "at X".
_LSN_OF_PAGE = re.compile(r"\(page ([0-9A-F]{1,8}/[0-9A-F]{1,8})\)")
_LSN_AT = re.compile(r"\bat ([0-9A-F]{1,8}/[0-9A-F]{1,8})\b")
_STALE_PAGE = re.compile(r"page address mismatch: pageaddr ([0-9A-F]{1,8}/[0-9A-F]{1,8})")
_MIN_HEAD_FETCH = 64 * 1024

# ----- problems and the archive plan -----

# Problem kinds, as verify-archive names them.
CRC = "CRC failure"
PREV = "broken xl_prev chain"
PAGE = "page header mismatch"
MISSING = "missing segment"
TIMELINE = "timeline break"
TRUNCATED = "truncated segment"
RECORD = "invalid record"
END = "WAL ends early"
MISMATCH = "object differing from a safekeeper's WAL"


@dataclass(frozen=True, order=True)
class Problem:
    """Something wrong with the archive, at an LSN inside segment `segment`."""

    lsn: int
    kind: str
    segment: str
    message: str

    def describe(self) -> str:
        """One line naming the problem, its segment and LSN."""
        return f"{self.kind} in segment {self.segment} at {format_lsn(self.lsn)}: {self.message}"


@dataclass(frozen=True)
class SegmentRef:
    """One segment file chosen to be read."""

    segno: int
    tli: int
    name: str
    size: int
    partial: bool


@dataclass
class ArchivePlan:
    """The segments forming the WAL in segno order, and problems seen from the file names alone."""

    storage: Storage
    seg_size: int
    segments: list[SegmentRef]
    problems: list[Problem] = field(default_factory=list)

    def by_segno(self) -> dict[int, SegmentRef]:
        return {s.segno: s for s in self.segments}


def parse_history(text: str) -> list[tuple[int, int]]:
    """(parent timeline, switch LSN) lines of a timeline history file, in file order."""
    return [(e.timeline, e.switch_lsn) for e in parse_timeline_history(text)]


def _segment_size_of(storage: Storage, name: str) -> int:
    """xlp_seg_size from a segment's long page header; the default when it cannot be read."""
    head = storage.read_range(name, 0, SizeOfXLogLongPHD)
    if len(head) == SizeOfXLogLongPHD:
        magic, info, _, _, _, _, seg_size, _ = LONG_PAGE_HEADER.unpack_from(head)
        if magic == XLOG_PAGE_MAGIC and info & XLP_LONG_HEADER and seg_size >= XLOG_BLCKSZ and seg_size & (seg_size - 1) == 0:
            return int(seg_size)
    return DEFAULT_SEGMENT_SIZE


def plan_archive(storage: Storage, first: str | None = None, last: str | None = None) -> ArchivePlan:
    """Choose one file per segment number (following the newest timeline's history) between first and last."""
    files = storage.list_files()
    names = sorted(n for n in files if _SEGMENT_NAME.match(n))
    if not names:
        raise FileNotFoundError(f"no WAL segment files in {storage.location}")
    seg_size = _segment_size_of(storage, names[0])
    candidates: dict[tuple[int, int], SegmentRef] = {}
    for name in names:
        tli, segno, partial = parse_segment_file_name(name, seg_size)
        key = (segno, tli)
        # A complete file wins over a .partial one of the same segment.
        if key not in candidates or candidates[key].partial:
            candidates[key] = SegmentRef(segno, tli, name, files[name], partial)
    lo = _bound(first, seg_size, min(s for s, _ in candidates))
    hi = _bound(last, seg_size, max(s for s, _ in candidates))
    if hi < lo:
        raise ValueError(f"last segment {last} is before first segment {first}")

    problems: list[Problem] = []
    tlis = sorted({t for _, t in candidates})
    target = tlis[-1]
    # begin segno of each timeline: from the newest timeline's history file when there is one.
    begins: dict[int, int] = {target: 0}
    if len(tlis) > 1:
        history_name = f"{target:08X}.history"
        if history_name in files:
            switch_lsns = parse_history(storage.read(history_name).decode("ascii", "replace"))
            begins = {tli: 0 for tli, _ in switch_lsns[:1]}
            for (_, lsn), nxt in zip(switch_lsns, [t for t, _ in switch_lsns[1:]] + [target]):
                begins[nxt] = lsn // seg_size
            begins.setdefault(target, 0)
        else:
            for tli in tlis:
                begins[tli] = min(s for s, t in candidates if t == tli) if tli != tlis[0] else 0
            first_new = min(s for s, t in candidates if t != tlis[0])
            name = segment_file_name(tlis[1], first_new, seg_size)
            problems.append(Problem(first_new * seg_size, TIMELINE, name,
                                    f"segments of timelines {', '.join(map(str, tlis))} but no {history_name}"))

    chosen: list[SegmentRef] = []
    for segno in range(lo, hi + 1):
        expected = max(t for t, b in begins.items() if b <= segno)
        ref = candidates.get((segno, expected))
        if ref is not None:
            chosen.append(ref)
            continue
        others = sorted(t for s, t in candidates if s == segno)
        name = segment_file_name(expected, segno, seg_size)
        if others:
            problems.append(Problem(segno * seg_size, TIMELINE, name,
                                    f"expected on timeline {expected}, found timeline(s) {', '.join(map(str, others))}"))
        else:
            problems.append(Problem(segno * seg_size, MISSING, name, f"{name} is not in {storage.location}"))
    return ArchivePlan(storage, seg_size, chosen, problems)


def backup_gaps(plan: ArchivePlan, backup_lsn: int, who: str) -> list[Problem]:
    """Segments from the archive's first one up to `backup_lsn` that it lacks: `who` said they were archived."""
    seg = plan.seg_size
    held = {s.segno: s.tli for s in plan.segments if not s.partial}
    if not held:
        return []
    tli = max(held.values())
    return [Problem(segno * seg, MISSING, segment_file_name(tli, segno, seg),
                    f"not in {plan.storage.location}, yet below the backup_lsn {format_lsn(backup_lsn)} of {who}")
            for segno in range(min(held), backup_lsn // seg) if segno not in held]


def reported_mismatch(name: str, backup_lsn: int, who: str) -> Problem:
    """`who` found the archived object `name` not to hold its WAL of that segment (its backup_lsn stops there)."""
    return Problem(backup_lsn, MISMATCH, name, f"{who} holds other bytes for it (its log gives both SHA-256s); "
                                               "nothing from it on is removed there")


def _bound(name: str | None, seg_size: int, default: int) -> int:
    if name is None:
        return default
    return parse_segment_file_name(Path(name).name, seg_size)[1]


# ----- scanning one segment -----


@dataclass
class SegmentSummary:
    """What a segment holds and how reading it ended; the chain fields are filled in by check_chain."""

    segno: int
    tli: int
    name: str
    size: int
    start_lsn: int
    records: int = 0
    first_lsn: int | None = None
    first_prev: int | None = None
    last_lsn: int | None = None
    last_end: int | None = None
    record_bytes: int = 0
    fpi_bytes: int = 0
    crc_failures: int = 0
    sysid: int | None = None
    page_tli_min: int | None = None
    page_tli_max: int | None = None
    reached_end: bool = False  # the last record reaches the segment end (or is an XLOG_SWITCH)
    end_reason: str = ""
    head_bytes_read: int = 0  # bytes of following segments read to finish the last record
    problems: list[Problem] = field(default_factory=list)
    chain: str = ""  # "ok", or why this segment does not continue the one before
    continues_to_next: bool | None = None


class HeadFetcher:
    """Ranged reads of the heads of the segments after one, only as far as needed.

    Reads come back shorter than asked (whole pages, starting at 64 KiB and growing): the reader asks again
    for what it has not got, so a record ending early in the next segment costs one small ranged read.
    """

    def __init__(self, storage: Storage, following: dict[int, SegmentRef], seg_size: int) -> None:
        self.storage = storage
        self.following = following
        self.seg_size = seg_size
        self.fetched = 0
        self._chunk = _MIN_HEAD_FETCH

    def fetch(self, lsn: int, size: int) -> tuple[bytes, bool]:
        """Up to size bytes at lsn (in a following segment), and whether the read gave all it asked for."""
        segno, off = divmod(lsn, self.seg_size)
        ref = self.following.get(segno)
        if ref is None or size <= 0:
            return b"", False
        n = min(size, self._chunk)
        self._chunk = min(self._chunk * 4, self.seg_size)
        got = self.storage.read_range(ref.name, off, n)
        self.fetched += len(got)
        return got, len(got) == n


class _TaskSource:
    """A WalSource over one segment held in memory, and the heads of the following ones (see HeadFetcher)."""

    def __init__(self, seg: SegmentRef, data: bytes, heads: HeadFetcher) -> None:
        self.seg = seg
        self.data = data
        self.heads = heads

    def read(self, lsn: int, size: int) -> bytes:
        segno, off = divmod(lsn, self.heads.seg_size)
        if segno == self.seg.segno:
            return self.data[off : off + size]
        return self.heads.fetch(lsn, size)[0]


# Fields of the record tuples SegmentScan.records gives, in order.
RECORD_FIELDS = ("lsn", "end_lsn", "prev", "xid", "rmid", "info", "tot_len", "fpi_len", "main_len", "crc",
                 "xact_time", "block_count")

ENGINES = ("kernel", "python")


@dataclass
class SegmentScan:
    """Records starting in one segment and their block references, column by column (see recordscan), and the summary."""

    summary: SegmentSummary
    record_columns: dict[str, np.ndarray] = field(default_factory=lambda: empty_columns(RECORD_COLUMNS))
    block_columns: dict[str, np.ndarray] = field(default_factory=lambda: empty_columns(BLOCK_COLUMNS))

    def __len__(self) -> int:
        return len(self.record_columns["lsn"])

    @property
    def records(self) -> list[tuple[Any, ...]]:
        """The records as tuples of RECORD_FIELDS; xact_time is None but for commit and abort records."""
        return list(zip(*self.columns().values()))

    @property
    def blocks(self) -> list[BlockRef]:
        """The block references as BlockRefs, in the records' order."""
        return [BlockRef(*row) for row in zip(*(self.block_columns[n].tolist() for n in BLOCK_COLUMNS))]

    def columns(self) -> dict[str, tuple[Any, ...]]:
        """The records column by column, as tuples of Python values."""
        cols = {name: tuple(self.record_columns[name].tolist()) for name in RECORD_FIELDS}
        valid = self.record_columns["xact_valid"].tolist()
        cols["xact_time"] = tuple(t if v else None for t, v in zip(cols["xact_time"], valid))
        return cols


def scan_segment(
    storage: Storage,
    seg: SegmentRef,
    following: dict[int, SegmentRef],
    seg_size: int,
    *,
    keep_records: bool = True,
    engine: str = "kernel",
) -> SegmentScan:
    """Decode and check every record starting in seg, finishing the last one from the following segments.

    engine "kernel" reads the records with compiled code (sidecar/wal/kernel.py); "python" with WalReader and
    decode_record, the reference the kernel must agree with.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown scan engine {engine!r}; choose one of {', '.join(ENGINES)}")
    start = seg.segno * seg_size
    summary = SegmentSummary(seg.segno, seg.tli, seg.name, seg.size, start)
    try:
        data = storage.read(seg.name)
    except FileNotFoundError:
        summary.problems.append(Problem(start, MISSING, seg.name, f"{seg.name} disappeared while reading"))
        summary.end_reason = "segment file missing"
        return SegmentScan(summary)
    summary.size = len(data)
    if len(data) < seg_size and not seg.partial:
        summary.problems.append(Problem(start + len(data), TRUNCATED, seg.name,
                                        f"{seg.name} holds {len(data)} of {seg_size} bytes"))
    _read_long_header(data, summary)
    if start == 0:
        summary.end_reason = "segment 0 holds no records"
        return SegmentScan(summary)
    check_pages = _check_pages if engine == "python" else _check_pages_compiled
    if _continuation_fills(data, seg_size):
        # XLogFindNextRecord would look for the first record in later segments; this one holds none.
        summary.reached_end = True
        summary.end_reason = "a record from an earlier segment runs through this one"
        check_pages(data, summary, seg, seg_size, len(data), None)
        summary.problems.sort()
        return SegmentScan(summary)
    heads = HeadFetcher(storage, following, seg_size)
    if engine == "python":
        got = _read_records(seg, data, heads, seg_size, keep_records)
    else:
        from sidecar.wal.kernel import read_records

        got = read_records(data, heads.fetch, start, seg_size, keep_records)
        got.fetched = heads.fetched
    _sum_up(summary, got, following, seg_size)
    # The reader checked every page it read; after an XLOG_SWITCH the rest of the segment is padding pages.
    checked_to = len(data) if got.reached_end else min(len(data), got.stop_lsn - start)
    check_pages(data, summary, seg, seg_size, checked_to, got.last_lsn if got.last_is_switch else None)
    summary.problems.sort()
    return SegmentScan(summary, got.records, got.blocks)


def _read_records(seg: SegmentRef, data: bytes, heads: HeadFetcher, seg_size: int, keep: bool) -> RecordScan:
    """The records starting in seg, read with WalReader and decode_record."""
    start = seg.segno * seg_size
    end = start + seg_size
    reader = WalReader(_TaskSource(seg, data, heads), start, seg_size=seg_size, keep_data=True)
    got = RecordScan()
    rows: list[tuple[Any, ...]] = []
    blocks: list[BlockRef] = []
    for lsn, end_lsn, tot_len, xid, prev, info, rmid, crc, rec_data in reader.tuples():
        if lsn >= end:
            break
        assert rec_data is not None
        try:
            dec = decode_record(rec_data, lsn)
        except WalFormatError as exc:
            got.decode_error = str(exc)
            break
        fpi = 0
        for b in dec.blocks:
            fpi += b.bimg_len
        if got.first_lsn is None:
            got.first_lsn, got.first_prev = lsn, prev
        got.last_lsn, got.last_end = lsn, end_lsn
        got.count += 1
        got.record_bytes += tot_len
        got.fpi_bytes += fpi
        if keep:
            timed = xact_time(rmid, info, rec_data, dec) if rmid == RM_XACT_ID else None
            rows.append((lsn, end_lsn, prev, xid, rmid, info, tot_len, fpi, dec.main_len, crc, timed or 0,
                         timed is not None, len(dec.blocks)))
            blocks.extend(dec.blocks)
        if end_lsn >= end:
            got.reached_end = True
            got.last_is_switch = rmid == RM_XLOG_ID and info & 0xF0 == XLOG_SWITCH
            break
    got.stop_reason = reader.stop_reason
    got.stop_lsn = reader.stop_lsn
    got.fetched = heads.fetched
    if rows:
        got.records = dict(zip(RECORD_COLUMNS, np.array(rows, dtype=np.int64).T))
    if blocks:
        got.blocks = dict(zip(BLOCK_COLUMNS, np.array(blocks, dtype=np.int64).T))
    return got


def _sum_up(summary: SegmentSummary, got: RecordScan, following: dict[int, SegmentRef], seg_size: int) -> None:
    """Fill in the summary from what reading the records gave, and the problem that ended it."""
    start = summary.start_lsn
    summary.records = got.count
    summary.record_bytes = got.record_bytes
    summary.fpi_bytes = got.fpi_bytes
    summary.head_bytes_read = got.fetched
    summary.first_lsn, summary.first_prev = got.first_lsn, got.first_prev
    summary.last_lsn, summary.last_end = got.last_lsn, got.last_end
    summary.reached_end = got.reached_end
    if got.reached_end:
        summary.end_reason = "XLOG_SWITCH" if got.last_is_switch else "continues in the next segment"
    elif got.decode_error is not None:
        summary.end_reason = got.decode_error
        summary.problems.append(Problem(got.last_end or start, RECORD, summary.name, got.decode_error))
    else:
        summary.end_reason = got.stop_reason
        problem = classify_stop(got.stop_reason, got.stop_lsn, summary.name)
        if problem is not None and problem.lsn >= start + seg_size:
            # Found while finishing the last record: the page or record lies in a following segment.
            ref = following.get(problem.lsn // seg_size)
            problem = Problem(problem.lsn, problem.kind, ref.name if ref else summary.name, problem.message)
        if problem is not None:
            summary.problems.append(problem)
            if problem.kind == CRC:
                summary.crc_failures = 1


def _continuation_fills(data: bytes, seg_size: int) -> bool:
    """Whether a record continued from earlier segments covers all of this one (walking xlp_rem_len page by page).

    Inconsistent headers give False: the reader then reports them.
    """
    page = 0
    if len(data) < SizeOfXLogLongPHD:
        return False
    magic, info, _, _, rem = SHORT_PAGE_HEADER.unpack_from(data, 0)
    if magic != XLOG_PAGE_MAGIC or not info & XLP_FIRST_IS_CONTRECORD:
        return False
    while True:
        space = XLOG_BLCKSZ - page_header_size(info)
        if maxalign(rem) < space:
            return False
        page += XLOG_BLCKSZ
        expected = rem - space
        if page >= seg_size:
            return True
        if expected <= 0 or page + SizeOfXLogShortPHD > len(data):
            return False
        magic, info, _, _, rem = SHORT_PAGE_HEADER.unpack_from(data, page)
        if magic != XLOG_PAGE_MAGIC or not info & XLP_FIRST_IS_CONTRECORD or rem != expected:
            return False


def _read_long_header(data: bytes, summary: SegmentSummary) -> None:
    if len(data) >= SizeOfXLogLongPHD:
        magic, info, _, _, _, sysid, _, _ = LONG_PAGE_HEADER.unpack_from(data)
        if magic == XLOG_PAGE_MAGIC and info & XLP_LONG_HEADER:
            summary.sysid = sysid


def _check_pages(
    data: bytes, summary: SegmentSummary, seg: SegmentRef, seg_size: int, limit: int, padding_from: int | None
) -> None:
    """Check the header of every page below limit and record the page timelines seen.

    Pages wholly after an XLOG_SWITCH (padding_from on) carry an empty page header or are all zeroes.
    """
    start = seg.segno * seg_size
    tlis: list[int] = []
    unpack = SHORT_PAGE_HEADER.unpack_from
    prev_tli = 0
    zero_page = bytes(XLOG_BLCKSZ)
    for off in range(0, max(0, min(limit, len(data)) - SizeOfXLogShortPHD + 1), XLOG_BLCKSZ):
        magic, info, tli, pageaddr, _ = unpack(data, off)
        page = start + off
        if padding_from is not None and page >= padding_from and data[off : off + XLOG_BLCKSZ] == zero_page:
            continue
        code, a, b = 0, 0, 0
        if magic != XLOG_PAGE_MAGIC:
            code, a = stopcodes.P_MAGIC, magic
        elif info & ~XLP_ALL_FLAGS:
            code, a = stopcodes.P_INFO, info
        elif bool(info & XLP_LONG_HEADER) != (off == 0):
            code, a = stopcodes.P_LONG, off
        elif pageaddr != page:
            code, a = stopcodes.P_ADDR, pageaddr
        elif off == 0 and len(data) >= SizeOfXLogLongPHD:
            _, _, _, _, _, _, size, blcksz = LONG_PAGE_HEADER.unpack_from(data)
            if size != seg_size or blcksz != XLOG_BLCKSZ:
                code, a, b = stopcodes.P_SIZES, size, blcksz
        if code == 0 and (tli > seg.tli or tli < prev_tli):
            code, a, b = stopcodes.P_TIMELINE, tli, prev_tli
        if code:
            _page_problem(summary, seg, code, page, a, b)
            break
        prev_tli = tli
        tlis.append(tli)
    if tlis:
        summary.page_tli_min, summary.page_tli_max = min(tlis), max(tlis)


def _check_pages_compiled(
    data: bytes, summary: SegmentSummary, seg: SegmentRef, seg_size: int, limit: int, padding_from: int | None
) -> None:
    """_check_pages in compiled code."""
    from sidecar.wal.kernel import NONE, check_pages

    code, page, a, b, tli_min, tli_max = check_pages(np.frombuffer(data, dtype=np.uint8), seg.segno * seg_size,
                                                     seg_size, seg.tli, limit,
                                                     NONE if padding_from is None else padding_from)
    if code:
        _page_problem(summary, seg, code, page, a, b)
    if tli_min >= 0:
        summary.page_tli_min, summary.page_tli_max = tli_min, tli_max


def _page_problem(summary: SegmentSummary, seg: SegmentRef, code: int, page: int, a: int, b: int) -> None:
    kind = TIMELINE if code == stopcodes.P_TIMELINE else PAGE
    summary.problems.append(Problem(page, kind, seg.name, stopcodes.describe(code, a, b, seg.tli, page)))


# Reader stop reasons (WalReader.stop_reason) by how they start, and the problem they mean.
_STOP_KINDS: tuple[tuple[str, str | None], ...] = (
    ("CRC mismatch", CRC),
    ("xl_prev mismatch", PREV),
    ("out-of-sequence timeline", TIMELINE),
    ("invalid magic", PAGE),
    ("invalid info bits", PAGE),
    ("page address mismatch", PAGE),
    ("incorrect segment size", PAGE),
    ("incorrect XLOG_BLCKSZ", PAGE),
    ("WAL at", PAGE),
    ("missing contrecord flag", PAGE),
    ("contrecord length mismatch", PAGE),
    ("contrecord is requested", PAGE),
    ("overwrite contrecord mismatch", RECORD),
    ("invalid resource manager", RECORD),
    ("record length", RECORD),
    ("invalid record offset", RECORD),
    # Running out of stored bytes is explained by a truncated or missing file, or the archive's end.
    ("end of stored WAL", None),
    # Zeroes where a record should start: the end of the WAL written so far.
    ("zero record length", END),
    ("invalid record length", END),
)


def classify_stop(reason: str, stop_lsn: int, segment: str) -> Problem | None:
    """The problem a reader stop reason reports; None for running out of stored bytes."""
    for prefix, kind in _STOP_KINDS:
        if reason.startswith(prefix):
            if kind is None:
                return None
            m = _LSN_OF_PAGE.search(reason) or _LSN_AT.search(reason)
            lsn = parse_lsn(m.group(1)) if m else stop_lsn
            stale = _STALE_PAGE.match(reason)
            if stale and parse_lsn(stale.group(1)) < lsn:
                # A page left over from a recycled segment file: where a live segment's WAL ends.
                kind = END
            return Problem(lsn, kind, segment, reason)
    return Problem(stop_lsn, RECORD, segment, reason)


# ----- across segments -----


def record_start_after(end_lsn: int, seg_size: int) -> int:
    """Where the record following one that ends at end_lsn (its EndRecPtr) starts: past any page header there."""
    if end_lsn % WAL_PAGE_SIZE:
        return end_lsn
    return end_lsn + (SizeOfXLogLongPHD if end_lsn % seg_size == 0 else SizeOfXLogShortPHD)


@dataclass
class ChainResult:
    """The outcome of linking the segment summaries: problems by LSN, and where the unbroken WAL ends."""

    summaries: list[SegmentSummary]
    problems: list[Problem]
    valid_start: int | None  # the first record's LSN
    valid_end: int | None  # EndRecPtr of the last record of the unbroken WAL from the first segment
    last_valid_lsn: int | None
    records: int  # records in the unbroken WAL


def check_chain(plan: ArchivePlan, summaries: Iterable[SegmentSummary]) -> ChainResult:
    """Link consecutive segments: each one's first record must follow the previous one's last, by position and xl_prev.

    Problems found by the scans are kept when they matter: a WAL that stops early in the last segment is its
    normal end, anywhere else it is not.
    """
    seg_size = plan.seg_size
    ordered = sorted(summaries, key=lambda s: s.segno)
    last_segno = plan.segments[-1].segno if plan.segments else -1
    problems: list[Problem] = list(plan.problems)
    exp_next: int | None = None  # EndRecPtr of the last record so far
    exp_prev: int | None = None
    broken = False
    valid_start = valid_end = last_valid = None
    records = 0
    prev_segno: int | None = None
    prev_tli = 0
    sysid: int | None = None
    for s in ordered:
        if s.segno == last_segno:
            # Zeroes after the last record of the last segment are where the WAL written so far ends.
            s.problems = [p for p in s.problems if p.kind != END]
        problems.extend(s.problems)
        if s.sysid is not None:
            if sysid is None:
                sysid = s.sysid
            elif s.sysid != sysid:
                problems.append(Problem(s.start_lsn, PAGE, s.name,
                                        f"system identifier {s.sysid} differs from {sysid} of earlier segments"))
        if s.page_tli_min is not None:
            if s.page_tli_min < prev_tli:
                problems.append(Problem(s.start_lsn, TIMELINE, s.name,
                                        f"page timeline {s.page_tli_min} after timeline {prev_tli}"))
            prev_tli = max(prev_tli, s.page_tli_max or 0)
        seg_end = s.start_lsn + seg_size
        gap = prev_segno is not None and s.segno != prev_segno + 1
        prev_segno = s.segno
        if gap:
            broken = True  # the missing segment is already a problem of the plan
        if broken:
            s.chain = "after a break"
            continue
        if exp_next is None:
            s.chain = "ok" if s.records else "no record starts here"
            if not s.records:
                # Like XLogFindNextRecord, look for the first record in the next segment when a record
                # from before the first segment runs through it; otherwise there is no WAL here.
                broken = not s.reached_end
                continue
            valid_start = s.first_lsn
        elif exp_next >= seg_end:
            # A record from an earlier segment runs through this whole one.
            if s.records:
                problems.append(Problem(s.first_lsn or s.start_lsn, RECORD, s.name,
                                        f"record starts at {format_lsn(s.first_lsn or 0)} inside the record before,"
                                        f" which ends at {format_lsn(exp_next)}"))
                s.chain = "record inside the previous one"
                broken = True
                continue
            s.chain = "ok"
            continue
        else:
            want = record_start_after(exp_next, seg_size)
            if not s.records:
                s.chain = f"no record at {format_lsn(want)}"
                broken = True
                quiet_end = s.segno == last_segno and not s.problems
                if not quiet_end and not any(p.segment == s.name for p in problems):
                    problems.append(Problem(want, END, s.name, f"no valid record at {format_lsn(want)}: {s.end_reason}"))
                continue
            if s.first_lsn != want:
                problems.append(Problem(want, PREV, s.name,
                                        f"first record at {format_lsn(s.first_lsn or 0)}, expected at {format_lsn(want)}"))
                s.chain = "first record misplaced"
                broken = True
                continue
            if s.first_prev != exp_prev:
                problems.append(Problem(s.first_lsn, PREV, s.name,
                                        f"xl_prev {format_lsn(s.first_prev or 0)} of the first record,"
                                        f" expected {format_lsn(exp_prev or 0)}"))
                s.chain = "xl_prev mismatch"
                broken = True
                continue
            s.chain = "ok"
        records += s.records
        exp_next, exp_prev = s.last_end, s.last_lsn
        valid_end, last_valid = s.last_end, s.last_lsn
        if not s.reached_end:
            broken = True
            # Running out of stored bytes is reported as the truncated or missing file that caused it.
            if s.segno != last_segno and not s.problems and not s.end_reason.startswith("end of stored WAL"):
                problems.append(Problem(exp_next or s.start_lsn, END, s.name,
                                        f"WAL stops before the segment ends: {s.end_reason}"))
    by_segno = {s.segno: s for s in ordered}
    for s in ordered:
        nxt = by_segno.get(s.segno + 1)
        s.continues_to_next = None if nxt is None else nxt.chain == "ok"
    # The same page or record may be reported by the segment's own scan and by the one finishing into it.
    unique: dict[tuple[int, str], Problem] = {}
    for p in sorted(problems):
        unique.setdefault((p.lsn, p.kind), p)
    problems = list(unique.values())
    return ChainResult(ordered, problems, valid_start, valid_end, last_valid, records)

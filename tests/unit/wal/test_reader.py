"""WAL record reader: synthesised WAL with known layout, then real PostgreSQL 15 WAL checked against pg_waldump."""

from __future__ import annotations

import os
import random
import re
import shutil
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import google_crc32c
import psycopg
import pytest

from support.backends import BackendUnavailable, LocalPgServer, PgServer, make_backend
from sidecar.lsn import format_lsn, parse_lsn, segment_file_name
from sidecar.wal.format import (
    SHORT_PAGE_HEADER,
    XLOG_PAGE_MAGIC,
    XLP_BKP_REMOVABLE,
    SizeOfXLogLongPHD,
    SizeOfXLogShortPHD,
    WalFormatError,
    main_data,
    parse_page_header,
    parse_record_header,
    record_crc,
)
from sidecar.wal.reader import BytesSource, SegmentDirSource, WalReader, WalRecord, find_end_of_wal
from support.walbuilder import Placed, WalBuilder, make_record

SEG = 1024 * 1024  # small segments keep synthesised streams short while still crossing segment boundaries
PAGE = 8192


def read_all(
    source: BytesSource, start: int, *, seg_size: int = SEG, keep_data: bool = False, expect_prev: int | None = None
) -> tuple[list[WalRecord], WalReader]:
    reader = WalReader(source, start, seg_size=seg_size, keep_data=keep_data, expect_prev=expect_prev)
    return list(reader), reader


def expected_end(records: list[Placed], stored_end: int, start: int) -> tuple[int, int | None]:
    """What find_end_of_wal must say when the stored WAL stops at stored_end."""
    end, last = start, None
    for r in records:
        if r.data_end > stored_end:
            break
        end, last = r.end_lsn, r.lsn
    return end, last


def assert_matches(got: list[WalRecord], want: list[Placed]) -> None:
    assert [(r.lsn, r.end_lsn, r.header.tot_len) for r in got] == [(p.lsn, p.end_lsn, p.tot_len) for p in want]


# ----- format -----


def test_record_crc_matches_postgres_rule() -> None:
    rec = make_record(b"hello", prev=0x1000028)
    tot_len = struct.unpack_from("<I", rec)[0]
    assert record_crc(rec) == google_crc32c.value(rec[24:tot_len] + rec[:20]) == struct.unpack_from("<I", rec, 20)[0]
    assert google_crc32c.value(b"123456789") == 0xE3069283


def test_parse_headers_reject_invalid_input() -> None:
    good = SHORT_PAGE_HEADER.pack(XLOG_PAGE_MAGIC, XLP_BKP_REMOVABLE, 1, 0x2000, 0)
    hdr = parse_page_header(good)
    assert (hdr.magic, hdr.tli, hdr.pageaddr, hdr.size, hdr.sysid) == (XLOG_PAGE_MAGIC, 1, 0x2000, SizeOfXLogShortPHD, None)
    with pytest.raises(WalFormatError, match="magic"):
        parse_page_header(SHORT_PAGE_HEADER.pack(0xD10D, 0, 1, 0x2000, 0))
    with pytest.raises(WalFormatError, match="info bits"):
        parse_page_header(SHORT_PAGE_HEADER.pack(XLOG_PAGE_MAGIC, 0x10, 1, 0x2000, 0))
    with pytest.raises(WalFormatError):
        parse_page_header(good[:20])
    rec = make_record(b"x" * 10, prev=5)
    assert parse_record_header(rec).tot_len == len(rec)
    with pytest.raises(WalFormatError, match="length"):
        parse_record_header(bytes(24))
    bad_rmid = bytearray(rec)
    bad_rmid[17] = 50
    with pytest.raises(WalFormatError, match="resource manager"):
        parse_record_header(bytes(bad_rmid))
    assert main_data(rec) == b"x" * 10


# ----- synthesised WAL -----


def test_reads_records_across_pages_and_segments() -> None:
    rng = random.Random(7)
    b = WalBuilder(SEG, seg_size=SEG)
    while b.insert < SEG + PAGE * 5:
        b.add(rng.randint(26, 700))
    b.add(3 * PAGE + 100)  # spans four pages
    b.add_ending_at(2 * SEG - 16)  # the next record's header is split over a segment boundary
    b.add(100)
    b.fill_to(2 * SEG + 3 * PAGE, 1000)
    b.add_ending_at(3 * SEG - PAGE - 8)
    b.add(PAGE + 50)  # begins 8 bytes before a page end: only xl_tot_len is on the first page
    b.add(60)
    records, reader = read_all(b.source(), SEG, keep_data=True)
    assert_matches(records, b.records)
    for r in records:
        assert r.data is not None and len(r.data) == r.header.tot_len
        assert record_crc(r.data) == r.header.crc
    assert reader.stop_lsn == b.records[-1].end_lsn
    assert reader.stop_reason.startswith("end of stored WAL")
    assert find_end_of_wal(b.source(), SEG, seg_size=SEG) == (b.records[-1].end_lsn, b.records[-1].lsn)


def test_small_read_windows_give_the_same_records() -> None:
    b = WalBuilder(SEG, seg_size=SEG)
    b.fill_to(SEG + 40 * PAGE, 333)
    b.add(5 * PAGE)
    b.fill_to(SEG + 50 * PAGE, 77)
    whole = [(r.lsn, r.end_lsn) for r in WalReader(b.source(), SEG, seg_size=SEG)]
    small = [(r.lsn, r.end_lsn) for r in WalReader(b.source(), SEG, seg_size=SEG, read_size=PAGE)]
    assert whole == small == [(p.lsn, p.end_lsn) for p in b.records]


def test_record_ending_exactly_at_page_end() -> None:
    b = WalBuilder(SEG, seg_size=SEG)
    b.fill_to(SEG + PAGE, 150)
    boundary = b.page_end_after(b.insert)
    ending = b.add_ending_at(boundary)
    assert ending.end_lsn == boundary
    # Stored WAL that stops right at the boundary ends with that record; EndRecPtr is the boundary itself.
    assert find_end_of_wal(b.source(), SEG, seg_size=SEG) == (boundary, ending.lsn)
    nxt = b.add(40)
    assert nxt.lsn == boundary + SizeOfXLogShortPHD
    records, _ = read_all(b.source(), SEG)
    assert_matches(records, b.records)
    # Starting at the boundary (a record end) finds the record after the page header.
    records, _ = read_all(b.source(), boundary, expect_prev=ending.lsn)
    assert [r.lsn for r in records] == [nxt.lsn]


def test_record_ending_at_segment_end() -> None:
    b = WalBuilder(SEG, seg_size=SEG)
    b.fill_to(SEG + 3 * PAGE, 400)
    ending = b.add_ending_at(2 * SEG)
    after = b.add(30)
    assert after.lsn == 2 * SEG + SizeOfXLogLongPHD
    assert find_end_of_wal(b.source(end=2 * SEG), SEG, seg_size=SEG) == (2 * SEG, ending.lsn)
    assert find_end_of_wal(b.source(), SEG, seg_size=SEG) == (after.end_lsn, after.lsn)


def test_xlog_switch_jumps_to_next_segment() -> None:
    b = WalBuilder(SEG, seg_size=SEG)
    b.fill_to(SEG + 2 * PAGE + 100, 120)
    sw = b.switch()
    assert sw.end_lsn == 2 * SEG
    assert find_end_of_wal(b.source(), SEG, seg_size=SEG) == (2 * SEG, sw.lsn)
    more = [b.add(90) for _ in range(5)]
    assert more[0].lsn == 2 * SEG + SizeOfXLogLongPHD
    records, _ = read_all(b.source(), SEG)
    assert_matches(records, b.records)
    assert records[len(records) - 6].header.is_switch
    assert find_end_of_wal(b.source(), SEG, seg_size=SEG) == (more[-1].end_lsn, more[-1].lsn)


def _tail_builder() -> WalBuilder:
    b = WalBuilder(SEG, seg_size=SEG)
    b.fill_to(SEG + 3 * PAGE, 200)
    b.add(2 * PAGE)
    b.fill_to(SEG + 6 * PAGE + 1000, 300)
    return b


def test_torn_tails_end_at_the_last_valid_record() -> None:
    b = _tail_builder()
    good = b.records[-1]
    last = b.add(500)
    full = b.bytes()

    def end_with(data: bytes) -> tuple[int, int | None]:
        return find_end_of_wal(BytesSource(SEG, data), SEG, seg_size=SEG)

    base = last.lsn - SEG
    assert end_with(full) == (last.end_lsn, last.lsn)
    # truncated last record
    assert end_with(full[: base + 300]) == (good.end_lsn, good.lsn)
    # garbage after the last good record
    garbage = bytes(random.Random(3).getrandbits(8) for _ in range(700))
    assert end_with(full[:base] + garbage) == (good.end_lsn, good.lsn)
    # zeroes
    assert end_with(full[:base] + bytes(PAGE)) == (good.end_lsn, good.lsn)
    # a bad CRC in the last record
    flipped = bytearray(full)
    flipped[base + 100] ^= 0x40
    reader = WalReader(BytesSource(SEG, bytes(flipped)), SEG, seg_size=SEG)
    assert [r.lsn for r in reader][-1] == good.lsn
    assert reader.stop_lsn == good.end_lsn and reader.stop_reason == f"CRC mismatch at {format_lsn(last.lsn)}"


def test_wrong_pageaddr_on_last_page() -> None:
    b = _tail_builder()
    boundary = b.page_end_after(b.insert)
    before = b.add_ending_at(boundary)
    b.add(100)
    b.add(100)
    b.corrupt(boundary + 8, struct.pack("<Q", boundary - SEG))  # a recycled segment's old page
    reader = WalReader(b.source(), SEG, seg_size=SEG)
    assert [r.lsn for r in reader][-1] == before.lsn
    assert reader.stop_lsn == boundary and reader.stop_reason.startswith("page address mismatch")
    # The same on a page that continues a record: that record is not valid.
    b = _tail_builder()
    spanning = b.add(PAGE)
    b.corrupt(b.page_end_after(spanning.lsn) + 8, struct.pack("<Q", 1))
    assert find_end_of_wal(b.source(), SEG, seg_size=SEG) == (b.records[-2].end_lsn, b.records[-2].lsn)


def test_every_truncation_point() -> None:
    rng = random.Random(11)
    b = WalBuilder(SEG, seg_size=SEG)
    while b.insert < 2 * SEG + 4 * PAGE:
        b.add(rng.choice([26, 40, 90, 300, 2000, PAGE - 30, 3 * PAGE]))
        if rng.random() < 0.05:
            b.add_ending_at(b.page_end_after(b.insert))
    b.switch()
    b.fill_to(3 * SEG + 2 * PAGE, 700)
    full = b.bytes()
    cuts = sorted({rng.randrange(0, len(full)) for _ in range(300)} | {p.data_end - SEG for p in b.records})
    for cut in cuts:
        stored_end = SEG + cut
        got = find_end_of_wal(BytesSource(SEG, full[:cut]), SEG, seg_size=SEG)
        assert got == expected_end(b.records, stored_end, SEG), format_lsn(stored_end)


def test_start_at_segment_start_skips_a_continuation() -> None:
    b = WalBuilder(SEG, seg_size=SEG)
    b.fill_to(2 * SEG - 3000, 500)
    big = b.add(5 * PAGE)  # runs several pages into the next segment
    after = [b.add(64) for _ in range(3)]
    src = b.source(start=2 * SEG)  # nothing before the segment start is stored
    records, reader = read_all(src, 2 * SEG)
    assert [r.lsn for r in records] == [a.lsn for a in after]
    assert big.lsn < 2 * SEG < big.end_lsn
    assert find_end_of_wal(src, 2 * SEG, seg_size=SEG) == (after[-1].end_lsn, after[-1].lsn)
    # The prev-link of the first record must match when the caller knows it.
    records, _ = read_all(src, 2 * SEG, expect_prev=big.lsn)
    assert len(records) == 3
    records, reader = read_all(src, 2 * SEG, expect_prev=big.lsn - 8)
    assert records == [] and reader.stop_reason.startswith("xl_prev mismatch")
    # With nothing valid after the continuation, the end is the start position itself.
    assert find_end_of_wal(b.source(start=2 * SEG, end=after[0].lsn + 10), 2 * SEG, seg_size=SEG) == (2 * SEG, None)


def test_continuation_filling_whole_pages() -> None:
    b = WalBuilder(SEG, seg_size=SEG)
    b.fill_to(SEG + PAGE, 200)
    whole = b.add_ending_at(SEG + 5 * PAGE, single=True)  # its tail covers several whole pages and ends at a boundary
    assert whole.lsn < SEG + 4 * PAGE
    nxt = b.add(100)
    for start in (SEG + 2 * PAGE, SEG + 3 * PAGE, SEG + 4 * PAGE):
        if start > whole.lsn:
            records, _ = read_all(b.source(start=start), start)
            assert [r.lsn for r in records] == [nxt.lsn]
    records, _ = read_all(b.source(start=SEG + 5 * PAGE), SEG + 5 * PAGE)
    assert [r.lsn for r in records] == [nxt.lsn]


def test_start_mid_page_validates_header_and_prev() -> None:
    b = WalBuilder(SEG, seg_size=SEG)
    b.fill_to(SEG + 3 * PAGE, 100)
    mid = b.records[len(b.records) // 2]
    records, _ = read_all(b.source(), mid.lsn, expect_prev=b.records[len(b.records) // 2 - 1].lsn)
    assert_matches(records, b.records[len(b.records) // 2 :])
    records, reader = read_all(b.source(), mid.lsn, expect_prev=mid.lsn - 8)
    assert records == [] and reader.stop_reason.startswith("xl_prev mismatch")
    assert reader.stop_lsn == mid.lsn
    _, reader = read_all(b.source(), SEG + PAGE + 8)
    assert reader.stop_reason.startswith("invalid record offset")
    with pytest.raises(ValueError):
        WalReader(b.source(), mid.lsn + 4, seg_size=SEG)


def test_prev_link_and_contrecord_length_checked() -> None:
    b = _tail_builder()
    good = b.records[-1]
    bad = make_record(b"y" * 50, prev=good.lsn - 8)
    b.add_raw(bad)
    reader = WalReader(b.source(), SEG, seg_size=SEG)
    assert [r.lsn for r in reader][-1] == good.lsn
    assert reader.stop_reason.startswith("xl_prev mismatch")

    b = _tail_builder()
    good = b.records[-1]
    spanning = b.add(3 * PAGE)
    b.corrupt(b.page_end_after(spanning.lsn) + 16, struct.pack("<I", 3 * PAGE))
    reader = WalReader(b.source(), SEG, seg_size=SEG)
    assert [r.lsn for r in reader][-1] == good.lsn
    assert reader.stop_reason.startswith("contrecord length mismatch")


def test_timeline_must_not_decrease_and_sysid_checked() -> None:
    b = WalBuilder(SEG, seg_size=SEG, tli=3)
    b.fill_to(SEG + 2 * PAGE, 100)
    boundary = b.page_end_after(b.insert)
    last = b.add_ending_at(boundary)
    b.add(50)
    b.corrupt(boundary + 4, struct.pack("<I", 2))
    reader = WalReader(b.source(), SEG, seg_size=SEG)
    assert [r.lsn for r in reader][-1] == last.lsn
    assert reader.stop_reason.startswith("out-of-sequence timeline ID")
    assert find_end_of_wal(b.source(), SEG, seg_size=SEG, system_id=b.sysid)[0] == boundary
    assert find_end_of_wal(b.source(), SEG, seg_size=SEG, system_id=b.sysid + 1) == (SEG, None)


def test_overwrite_contrecord_restarts_at_the_flagged_page() -> None:
    b = _tail_builder()
    good = b.records[-1]
    aborted = b.abort_record(3 * PAGE)
    flagged_page = b.insert
    over = b.overwrite_contrecord(aborted)
    after = [b.add(70) for _ in range(3)]
    assert over.lsn == flagged_page + SizeOfXLogShortPHD
    records, reader = read_all(b.source(), SEG)
    assert_matches(records, b.records)
    assert aborted not in [r.lsn for r in records]
    assert records[-4].header.is_overwrite_contrecord and records[-4].header.prev == good.lsn
    assert reader.stop_lsn == after[-1].end_lsn
    # Without the page that overwrote it, the aborted record is simply a torn tail.
    assert find_end_of_wal(b.source(end=flagged_page), SEG, seg_size=SEG) == (good.end_lsn, good.lsn)
    # The record on the flagged page must name the aborted record.
    b2 = _tail_builder()
    aborted2 = b2.abort_record(3 * PAGE)
    b2.overwrite_contrecord(aborted2 - 8)
    reader = WalReader(b2.source(), SEG, seg_size=SEG)
    assert [r.lsn for r in reader][-1] == b2.records[-2].lsn
    assert reader.stop_lsn == aborted2 and reader.stop_reason.startswith("overwrite contrecord mismatch")


def test_large_record_over_several_segments() -> None:
    seg = 16 * 1024 * 1024
    b = WalBuilder(seg)
    b.fill_to(seg + PAGE, 300)
    big = b.add(40 * 1024 * 1024)
    tail = b.add(100)
    records, _ = read_all(b.source(), seg, seg_size=seg)
    assert_matches(records, b.records)
    assert find_end_of_wal(b.source(), seg) == (tail.end_lsn, tail.lsn)
    assert find_end_of_wal(b.source(end=big.data_end - 1), seg) == (b.records[-3].end_lsn, b.records[-3].lsn)
    # From a segment start fully covered by the record, the continuation is skipped over all its pages.
    assert find_end_of_wal(b.source(start=2 * seg), 2 * seg) == (tail.end_lsn, tail.lsn)
    with_data = [r for r in WalReader(b.source(), big.lsn, seg_size=seg, keep_data=True)]
    assert with_data[0].data is not None and record_crc(with_data[0].data) == with_data[0].header.crc


def test_segment_dir_source_reads_across_files(tmp_path: Path) -> None:
    b = WalBuilder(SEG, seg_size=SEG)
    b.fill_to(2 * SEG + 5 * PAGE, 900)
    data = b.bytes()
    (tmp_path / segment_file_name(1, 1, SEG)).write_bytes(data[:SEG])
    (tmp_path / (segment_file_name(1, 2, SEG) + ".partial")).write_bytes(data[SEG:])
    src = SegmentDirSource(tmp_path, 1, SEG)
    assert src.read(2 * SEG - 10, 20) == data[SEG - 10 : SEG + 10]
    assert find_end_of_wal(src, SEG, seg_size=SEG) == (b.records[-1].end_lsn, b.records[-1].lsn)


# ----- real PostgreSQL 15 WAL -----

WALDUMP_LINE = re.compile(
    r"^rmgr: (\S+)\s+len \(rec/tot\):\s*(\d+)/\s*(\d+), tx:\s*(\d+), lsn: ([0-9A-F]+/[0-9A-F]+), prev ([0-9A-F]+/[0-9A-F]+), desc: (.*)$"
)
WALDUMP_ERROR = re.compile(r"error in WAL record at ([0-9A-F]+/[0-9A-F]+): (.*)$", re.M)


@dataclass(frozen=True)
class DumpedRecord:
    rmgr: str
    tot_len: int
    lsn: int
    prev: int
    desc: str


@dataclass(frozen=True)
class WalDump:
    records: list[DumpedRecord]
    error: str


def waldump(server: PgServer, wal_dir: Path, start: int, end: int | None = None) -> WalDump:
    """pg_waldump over copied segments; it reads until the end of valid WAL when end is None."""
    args = ["--path", str(wal_dir), "--start", format_lsn(start)]
    if end is not None:
        args += ["--end", format_lsn(end)]
    proc = server.run_bin("pg_waldump", *args, check=False)
    records = []
    for line in proc.stdout.splitlines():
        m = WALDUMP_LINE.match(line)
        assert m, f"unparsed pg_waldump line: {line!r}"
        records.append(DumpedRecord(m.group(1), int(m.group(3)), parse_lsn(m.group(5)), parse_lsn(m.group(6)), m.group(7)))
    return WalDump(records, proc.stderr)


def copy_segments(src_dir: Path, dst_dir: Path, first_segno: int, last_segno: int) -> None:
    dst_dir.mkdir(mode=0o755, exist_ok=True)
    for segno in range(first_segno, last_segno + 1):
        name = segment_file_name(1, segno)
        shutil.copyfile(src_dir / name, dst_dir / name)
        os.chmod(dst_dir / name, 0o644)


def control_value(server: PgServer, key: str) -> str:
    out = server.run_bin("pg_controldata", "-D", str(server.data_dir)).stdout
    for line in out.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    raise AssertionError(f"{key!r} not in pg_controldata output")


class LimitedSource:
    """A WalSource that hides everything at or after limit."""

    def __init__(self, inner: SegmentDirSource, limit: int) -> None:
        self.inner = inner
        self.limit = limit

    def read(self, lsn: int, size: int) -> bytes:
        return self.inner.read(lsn, max(0, min(size, self.limit - lsn)))


@dataclass(frozen=True)
class RealWal:
    server: PgServer
    wal_dir: Path
    start: int  # a segment start
    live_segno: int
    flush_after_commit: int
    big_message_lsn: int  # as returned by pg_logical_emit_message
    sysid: int
    last_checkpoint: int


@contextmanager
def server_maker(request: pytest.FixtureRequest, base: Path) -> Iterator[Callable[[dict[str, str]], PgServer]]:
    """Makes started servers under base; every one is torn down on exit, even after a failure."""
    try:
        backend = make_backend(request.config.getoption("--pg-backend"), base)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    servers: list[LocalPgServer] = []

    def make(settings: dict[str, str]) -> PgServer:
        server = backend.create(f"pg{len(servers)}", settings)
        servers.append(server)
        server.start()
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.teardown()


@pytest.fixture(scope="module")
def real_wal(request: pytest.FixtureRequest, test_root: Path) -> Iterator[RealWal]:
    """pgbench, a 20 MB logical message, a WAL switch and commits on a real server, then copies of its segments."""
    base = test_root / "wal_reader"
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    with server_maker(request, base) as make:
        server = make({"autovacuum": "off", "wal_keep_size": "4GB", "max_wal_size": "4GB"})
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            start_lsn = parse_lsn(conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
            start = start_lsn - start_lsn % (16 * 1024 * 1024)
            server.run_bin("pgbench", "-i", "-s", "5", "-q", "-h", "127.0.0.1", "-p", str(server.port), "postgres")
            server.run_bin("pgbench", "-n", "-t", "200", "-c", "2", "-h", "127.0.0.1", "-p", str(server.port), "postgres")
            big = conn.execute("SELECT pg_logical_emit_message(false, 'p', repeat('x', 20*1024*1024))::text").fetchone()[0]
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CREATE TABLE t (id int primary key, v text)")
            for i in range(5):
                conn.execute("INSERT INTO t VALUES (%s, repeat('v', %s))", (i, 100 * i))
            flush = parse_lsn(conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
        server.stop()
        sysid = int(control_value(server, "Database system identifier"))
        checkpoint = parse_lsn(control_value(server, "Latest checkpoint location"))
        live = checkpoint // (16 * 1024 * 1024)
        wal_dir = base / "copied_wal"
        copy_segments(server.pg_wal_dir, wal_dir, start // (16 * 1024 * 1024), live)
        yield RealWal(server, wal_dir, start, live, flush, parse_lsn(big), sysid, checkpoint)


def test_real_wal_matches_pg_waldump(real_wal: RealWal) -> None:
    dump = waldump(real_wal.server, real_wal.wal_dir, real_wal.start)
    err = WALDUMP_ERROR.search(dump.error)
    assert err, dump.error
    reader = WalReader(SegmentDirSource(real_wal.wal_dir), real_wal.start, keep_data=True, system_id=real_wal.sysid)
    records = []
    previous: WalRecord | None = None
    for r in reader:
        assert r.data is not None and record_crc(r.data) == r.header.crc
        records.append((r.lsn, r.header.prev, r.header.tot_len))
        if previous is not None:
            # EndRecPtr stops at a page boundary; the next record starts after that page's header.
            skip = 0 if previous.end_lsn % PAGE else SizeOfXLogLongPHD if previous.end_lsn % (16 << 20) == 0 else SizeOfXLogShortPHD
            assert r.lsn == previous.end_lsn + skip
        previous = r
    assert len(records) > 10_000
    assert reader.stop_reason.startswith("zero record length")
    assert records == [(d.lsn, d.prev, d.tot_len) for d in dump.records]
    # pg_waldump reports where it failed to read the next record: the last record's EndRecPtr.
    assert parse_lsn(err.group(1)) == records[-1][0]
    stop_at = re.search(r"at ([0-9A-F]+/[0-9A-F]+)", err.group(2))
    assert stop_at and parse_lsn(stop_at.group(1)) == reader.stop_lsn
    assert reader.last_record_lsn == real_wal.last_checkpoint  # the shutdown checkpoint is the last record


def test_real_wal_end_of_live_segment(real_wal: RealWal) -> None:
    src = SegmentDirSource(real_wal.wal_dir)
    live_start = real_wal.live_segno * 16 * 1024 * 1024
    end, last = find_end_of_wal(src, live_start, system_id=real_wal.sysid)
    assert last == real_wal.last_checkpoint
    dump = waldump(real_wal.server, real_wal.wal_dir, live_start)
    assert last == dump.records[-1].lsn
    ends = [r.end_lsn for r in WalReader(src, real_wal.start)]
    assert ends[-1] == end
    # The flush position the server reported after a commit is a record's EndRecPtr.
    assert real_wal.flush_after_commit in ends
    assert find_end_of_wal(LimitedSource(src, real_wal.flush_after_commit), live_start)[0] == real_wal.flush_after_commit


def test_real_wal_truncated_segment(real_wal: RealWal, test_dir: Path) -> None:
    name = segment_file_name(1, real_wal.live_segno)
    shutil.copyfile(real_wal.wal_dir / name, test_dir / name)
    live_start = real_wal.live_segno * 16 * 1024 * 1024
    records = list(WalReader(SegmentDirSource(real_wal.wal_dir), live_start))
    last, before = records[-1], records[-2]
    os.truncate(test_dir / name, last.lsn - live_start + last.header.tot_len // 2)
    assert find_end_of_wal(SegmentDirSource(test_dir), live_start) == (before.end_lsn, before.lsn)
    # Cutting the 20 MB message in the middle leaves the WAL ending just before it.
    src = SegmentDirSource(real_wal.wal_dir)
    all_records = list(WalReader(src, real_wal.start))
    big_index = next(i for i, r in enumerate(all_records) if r.header.tot_len > 20 * 1024 * 1024)
    big = all_records[big_index]
    cut = LimitedSource(src, big.lsn + big.header.tot_len // 2)
    prior = all_records[big_index - 1]
    assert find_end_of_wal(cut, real_wal.start) == (prior.end_lsn, prior.lsn)


def test_real_wal_segment_starting_with_continuation(real_wal: RealWal) -> None:
    src = SegmentDirSource(real_wal.wal_dir)
    all_records = list(WalReader(src, real_wal.start))
    big = next(r for r in all_records if r.header.tot_len > 20 * 1024 * 1024)
    # pg_logical_emit_message returns what XLogInsert did: the record's EndRecPtr.
    assert big.end_lsn == real_wal.big_message_lsn
    seg = 16 * 1024 * 1024
    inside = big.lsn - big.lsn % seg + seg  # a segment start the message runs through
    assert inside < big.end_lsn
    records = list(WalReader(src, inside))
    assert records[0].lsn == next(r.lsn for r in all_records if r.lsn > big.lsn)
    assert [r.lsn for r in records] == [r.lsn for r in all_records if r.lsn > big.lsn]
    dump = waldump(real_wal.server, real_wal.wal_dir, inside)
    assert dump.records[0].lsn == records[0].lsn


def test_real_overwrite_contrecord_after_crash(pg_factory: Callable[..., PgServer], test_dir: Path) -> None:
    """A crash while a record spans into a segment that is then lost: recovery writes OVERWRITE_CONTRECORD."""
    seg = 16 * 1024 * 1024
    server = pg_factory(settings={"autovacuum": "off", "wal_keep_size": "1GB"})
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("CREATE TABLE filler (a int, b text)")
        # Fill the segment until less than two pages remain (as PostgreSQL's 026_overwrite_contrecord test).
        while True:
            conn.execute(
                "INSERT INTO filler SELECT g, repeat(md5(g::text), (random() * 60 + 1)::int) FROM generate_series(1, 10) g"
            )
            insert = parse_lsn(conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
            if seg - insert % seg < 2 * PAGE:
                break
        first_segno = insert // seg
        conn.execute("SELECT pg_logical_emit_message(true, 'test 026', repeat('xyzxz', 123456))")
        end_segno = parse_lsn(conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]) // seg
    assert end_segno == first_segno + 1
    server.crash()
    (server.pg_wal_dir / segment_file_name(1, end_segno)).unlink()
    server.start()
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("CREATE TABLE after_crash (a int)")
    server.stop()
    wal_dir = test_dir / "wal"
    copy_segments(server.pg_wal_dir, wal_dir, first_segno, end_segno)
    src = SegmentDirSource(wal_dir)
    reader = WalReader(src, first_segno * seg)
    records = list(reader)
    over = [r for r in records if r.header.is_overwrite_contrecord]
    assert len(over) == 1 and over[0].lsn == end_segno * seg + SizeOfXLogLongPHD
    dump = waldump(server, wal_dir, first_segno * seg)
    assert [(r.lsn, r.header.prev) for r in records] == [(d.lsn, d.prev) for d in dump.records]
    assert over[0].header.prev == records[records.index(over[0]) - 1].lsn
    # Without the segment holding the overwrite, the WAL ends before the aborted record.
    first_only = LimitedSource(src, end_segno * seg)
    end, last = find_end_of_wal(first_only, first_segno * seg)
    assert last == records[records.index(over[0]) - 1].lsn and end == records[records.index(over[0]) - 1].end_lsn

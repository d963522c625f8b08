"""Archive planning, per-segment scans and the cross-segment chain check, on synthesised segment files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.walbuilder import WalBuilder

from sidecar.lsn import format_lsn, segment_file_name
from sidecar.wal.archive import (
    CRC,
    END,
    MISSING,
    PAGE,
    PREV,
    TIMELINE,
    TRUNCATED,
    ChainResult,
    LocalStorage,
    SegmentScan,
    check_chain,
    open_storage,
    plan_archive,
    scan_segment,
)
from sidecar.wal.format import SHORT_PAGE_HEADER, XLOG_PAGE_MAGIC
from sidecar.wal.reader import WalReader

SEG = 1024 * 1024  # small segments: quick to build, and the scan takes the size from the long page header
PAGE_SIZE = 8192


def build_stream() -> WalBuilder:
    """Segments 1..5: small records, a record running through all of segment 3, a switch in 4, a partial 5."""
    b = WalBuilder(SEG, seg_size=SEG, prev=SEG - 200)
    b.fill_to(2 * SEG + SEG // 2, size=300)
    b.add(2 * SEG)  # from the middle of segment 2, through 3, into 4
    b.fill_to(4 * SEG + SEG // 3, size=500)
    b.switch()
    b.fill_to(5 * SEG + 3 * PAGE_SIZE, size=200)
    return b


def write_segments(b: WalBuilder, directory: Path, tli: int = 1) -> list[str]:
    """The stream as segment files; the last one is zero-filled past the written WAL, like a live segment."""
    directory.mkdir(parents=True, exist_ok=True)
    data = b.bytes()
    names = []
    for off in range(0, len(data), SEG):
        chunk = data[off : off + SEG]
        name = segment_file_name(tli, (b.base + off) // SEG, SEG)
        (directory / name).write_bytes(chunk + bytes(SEG - len(chunk)))
        names.append(name)
    return names


def scan_all(directory: Path, first: str | None = None, last: str | None = None) -> tuple[list[SegmentScan], ChainResult]:
    storage = LocalStorage(directory)
    plan = plan_archive(storage, first, last)
    scans = [scan_segment(storage, s, plan.by_segno(), plan.seg_size) for s in plan.segments]
    return scans, check_chain(plan, [s.summary for s in scans])


@pytest.fixture(scope="module")
def stream() -> WalBuilder:
    return build_stream()


def test_records_belong_to_their_start_segment(stream: WalBuilder, tmp_path: Path) -> None:
    write_segments(stream, tmp_path)
    (tmp_path / "00000001.history.not-wal").write_text("ignored")
    scans, chain = scan_all(tmp_path)
    assert chain.problems == []
    got = [lsn for s in scans for lsn in s.columns()["lsn"]]
    assert got == [r.lsn for r in stream.records]
    for s in scans:
        assert all(lsn // SEG == s.summary.segno for lsn in s.columns()["lsn"])
    by_seg = {s.summary.segno: s.summary for s in scans}
    assert by_seg[3].records == 0 and by_seg[3].reached_end and by_seg[3].head_bytes_read == 0
    assert by_seg[4].end_reason == "XLOG_SWITCH"
    assert by_seg[5].end_reason.startswith("zero record length")
    # A record ending early in the next segment costs one small ranged read of its head.
    assert by_seg[1].head_bytes_read == 64 * 1024
    assert by_seg[2].head_bytes_read > SEG  # finishing the big record reads through segment 3 into 4
    assert [s.chain for s in chain.summaries] == ["ok"] * 5
    assert chain.records == len(stream.records)
    assert chain.valid_end == stream.records[-1].end_lsn
    # Scans agree with reading the whole stream sequentially.
    seq = list(WalReader(stream.source(), SEG, seg_size=SEG))
    assert [r.lsn for r in seq] == got


def test_short_page_aligned_reads_give_the_same_records(stream: WalBuilder) -> None:
    class Stingy:
        """Answers at most two pages per read, as a ranged fetch of a segment head may."""

        def __init__(self) -> None:
            self.inner = stream.source()

        def read(self, lsn: int, size: int) -> bytes:
            return self.inner.read(lsn, min(size, 2 * PAGE_SIZE - lsn % PAGE_SIZE))

    want = [(r.lsn, r.end_lsn) for r in WalReader(stream.source(), SEG, seg_size=SEG)]
    assert [(r[0], r[1]) for r in WalReader(Stingy(), SEG, seg_size=SEG).tuples()] == want


def test_range_leaves_out_records_crossing_the_last_segment(stream: WalBuilder, tmp_path: Path) -> None:
    names = write_segments(stream, tmp_path)
    scans, chain = scan_all(tmp_path, names[0], names[1])
    assert chain.problems == []
    big = next(r for r in stream.records if r.tot_len == 2 * SEG)
    assert [lsn for s in scans for lsn in s.columns()["lsn"]] == [r.lsn for r in stream.records if r.lsn < big.lsn]
    scans, chain = scan_all(tmp_path, names[2], names[2])
    assert chain.valid_start is None and scans[0].records == []
    # Starting where no record starts, the first record is looked for in the next segment.
    _, chain = scan_all(tmp_path, names[2], names[3])
    assert chain.problems == []
    assert chain.valid_start == next(r.lsn for r in stream.records if r.lsn > big.lsn)


def test_flipped_byte_is_a_crc_failure(stream: WalBuilder, tmp_path: Path) -> None:
    names = write_segments(stream, tmp_path)
    victim = next(r for r in stream.records if r.lsn > SEG + SEG // 2 and r.tot_len == 300 and r.lsn % PAGE_SIZE < 7000)
    path = tmp_path / names[0]
    data = bytearray(path.read_bytes())
    data[victim.lsn - SEG + 100] ^= 0x01
    path.write_bytes(bytes(data))
    scans, chain = scan_all(tmp_path)
    first = chain.problems[0]
    assert (first.kind, first.lsn, first.segment) == (CRC, victim.lsn, names[0])
    assert scans[0].summary.crc_failures == 1
    assert format_lsn(victim.lsn) in first.describe() and names[0] in first.describe()


def test_missing_truncated_and_bad_page(stream: WalBuilder, tmp_path: Path) -> None:
    names = write_segments(stream, tmp_path)
    (tmp_path / names[1]).unlink()
    _, chain = scan_all(tmp_path)
    assert (chain.problems[0].kind, chain.problems[0].lsn, chain.problems[0].segment) == (MISSING, 2 * SEG, names[1])

    write_segments(stream, tmp_path)
    os.truncate(tmp_path / names[0], SEG // 2 + 100)
    _, chain = scan_all(tmp_path)
    p = chain.problems[0]
    assert (p.kind, p.lsn, p.segment) == (TRUNCATED, SEG + SEG // 2 + 100, names[0])

    write_segments(stream, tmp_path)
    path = tmp_path / names[3]
    data = bytearray(path.read_bytes())
    bad_page = 4 * SEG + 5 * PAGE_SIZE
    data[bad_page - 4 * SEG + 8] ^= 0xFF  # xlp_pageaddr
    path.write_bytes(bytes(data))
    _, chain = scan_all(tmp_path)
    p = chain.problems[0]
    assert (p.kind, p.lsn, p.segment) == (PAGE, bad_page, names[3])


def test_broken_prev_chain_between_segments(tmp_path: Path) -> None:
    a = WalBuilder(SEG, seg_size=SEG, prev=SEG - 200)
    a.fill_to(SEG + SEG // 2, size=300)
    a.add_ending_at(2 * SEG)
    a.fill_to(2 * SEG + 4 * PAGE_SIZE, size=300)
    names = write_segments(a, tmp_path)
    # Segment 2 from another stream: its first record points back to a record that is not segment 1's last.
    other = WalBuilder(2 * SEG, seg_size=SEG, prev=SEG + 1000)
    other.fill_to(2 * SEG + 4 * PAGE_SIZE, size=300)
    (tmp_path / names[1]).write_bytes(other.bytes() + bytes(SEG - len(other.bytes())))
    _, chain = scan_all(tmp_path)
    p = chain.problems[0]
    assert (p.kind, p.lsn, p.segment) == (PREV, 2 * SEG + 40, names[1])
    assert chain.valid_end == 2 * SEG


def test_wal_ending_before_a_later_segment(stream: WalBuilder, tmp_path: Path) -> None:
    names = write_segments(stream, tmp_path)
    path = tmp_path / names[0]
    data = bytearray(path.read_bytes())
    cut = next(r for r in stream.records if r.lsn > SEG + SEG // 4)
    data[cut.lsn - SEG :] = bytes(SEG - (cut.lsn - SEG))  # zeroes from a record on, as if never written
    path.write_bytes(bytes(data))
    _, chain = scan_all(tmp_path)
    assert chain.problems[0].kind in (END, PAGE) and chain.problems[0].segment == names[0]
    assert chain.valid_end == cut.lsn


def test_live_segment_ending_at_a_recycled_page(tmp_path: Path) -> None:
    b = WalBuilder(SEG, seg_size=SEG, prev=SEG - 200)
    b.fill_to(SEG + SEG // 2, size=300)
    b.fill_to(2 * SEG + 3 * PAGE_SIZE, size=300)
    end = b.add_ending_at(b.page_end_after(b.insert)).end_lsn
    names = write_segments(b, tmp_path)
    # The page after the last record still holds a header from the file's previous use as an older segment.
    path = tmp_path / names[-1]
    data = bytearray(path.read_bytes())
    data[end - 2 * SEG : end - 2 * SEG + 24] = SHORT_PAGE_HEADER.pack(XLOG_PAGE_MAGIC, 0, 1, end - SEG, 0)
    path.write_bytes(bytes(data))
    scans, chain = scan_all(tmp_path)
    assert chain.problems == [] and chain.valid_end == end
    assert scans[-1].summary.end_reason.startswith("page address mismatch")
    # The same page in a segment that is not the last: the WAL ends before the archive does.
    (tmp_path / segment_file_name(1, 3, SEG)).write_bytes(b.bytes()[: PAGE_SIZE] + bytes(SEG - PAGE_SIZE))
    _, chain = scan_all(tmp_path)
    assert [(p.kind, p.segment) for p in chain.problems][:1] == [(END, names[-1])]


def test_timelines(stream: WalBuilder, tmp_path: Path) -> None:
    write_segments(stream, tmp_path)
    # A copy of segment 4 on timeline 2 and no history file: a timeline break.
    name4_tli2 = segment_file_name(2, 4, SEG)
    (tmp_path / name4_tli2).write_bytes((tmp_path / segment_file_name(1, 4, SEG)).read_bytes())
    _, chain = scan_all(tmp_path)
    assert chain.problems[0].kind == TIMELINE and chain.problems[0].segment == name4_tli2
    # With the history file saying timeline 2 began in segment 4, that file is the one read; its pages
    # still say timeline 1, which a timeline 2 file may hold.
    (tmp_path / "00000002.history").write_text(f"1\t{format_lsn(4 * SEG + 100)}\tno recovery target specified\n")
    storage = LocalStorage(tmp_path)
    plan = plan_archive(storage)
    assert [(s.segno, s.tli) for s in plan.segments] == [(1, 1), (2, 1), (3, 1), (4, 2)]
    # Segment 5 exists only on timeline 1, which had ended before it.
    assert [(p.kind, p.segment) for p in plan.problems] == [(TIMELINE, segment_file_name(2, 5, SEG))]


def test_partial_file_and_storage_urls(stream: WalBuilder, tmp_path: Path) -> None:
    names = write_segments(stream, tmp_path)
    os.rename(tmp_path / names[-1], tmp_path / f"{names[-1]}.partial")
    scans, chain = scan_all(tmp_path)
    assert chain.problems == [] and scans[-1].summary.name.endswith(".partial")
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert open_storage("s3://bucket/some/prefix").location == "s3://bucket/some/prefix"
    with pytest.raises(ValueError):
        open_storage("gs://bucket/x")
    with pytest.raises(FileNotFoundError):
        plan_archive(LocalStorage(tmp_path / "nothing"))

"""The compiled segment scan against its reference, WalReader with decode_record: the same records, block
references and segment summaries on real PostgreSQL 15 WAL, on damaged archives and on synthesised WAL."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
from support.realwal import GeneratedWal, wal_fixture
from support.records import INVALID_BLOCKS, build_record, page_with_hole
from support.walbuilder import WalBuilder

from sidecar.lsn import DEFAULT_SEGMENT_SIZE, segment_file_name
from sidecar.wal import jit
from sidecar.wal.archive import (
    ChainResult,
    LocalStorage,
    SegmentScan,
    check_chain,
    plan_archive,
    scan_segment,
)
from sidecar.wal.crc32c import TABLES, crc32c_extend
from sidecar.wal.decode import (
    BKPBLOCK_SAME_REL,
    BKPIMAGE_COMPRESS_PGLZ,
    BKPIMAGE_HAS_HOLE,
)
from sidecar.wal.format import XLOG_BLCKSZ

PAGE = XLOG_BLCKSZ
SEG = 128 * 1024  # small segments: records of a few pages cross into the next ones


# ----- CRC-32C -----


def test_slice_by_8_tables() -> None:
    """Table k holds the CRC register after a byte and k zero bytes, starting from zero (no pre/post inversion)."""
    for k in range(8):
        for byte in range(256):
            want = google_crc32c.value(bytes([byte]) + bytes(k)) ^ google_crc32c.value(bytes(k + 1))
            assert TABLES[k, byte] == want, (k, byte)


def test_crc32c_matches_google_crc32c() -> None:
    data = np.frombuffer(random.Random(7).randbytes(70_000), dtype=np.uint8)
    for start, stop in [(0, 0), (0, 1), (3, 11), (5, 70_000), (8, 64), (1, 69_999), (9, 4)]:
        for seed in (0, 0x12345678):
            want = google_crc32c.extend(seed, data[start:max(start, stop)].tobytes())
            assert crc32c_extend(seed, data, start, stop) == want, (start, stop, seed)


# ----- comparing the engines -----


def scan_both(directory: Path, first: str | None = None, last: str | None = None,
              keep: bool = True) -> dict[str, tuple[list[SegmentScan], ChainResult]]:
    """Each engine's scans of the archive in directory, and the chain check over them."""
    out = {}
    for engine in ("kernel", "python"):
        storage = LocalStorage(directory)
        plan = plan_archive(storage, first, last)
        scans = [scan_segment(storage, s, plan.by_segno(), plan.seg_size, keep_records=keep, engine=engine)
                 for s in plan.segments]
        out[engine] = (scans, check_chain(plan, [s.summary for s in scans]))
    return out


def assert_same(directory: Path, first: str | None = None, last: str | None = None, keep: bool = True) -> ChainResult:
    """The kernel finds what the reference finds: records, block references, summaries and the chain's problems."""
    both = scan_both(directory, first, last, keep)
    (kscans, kchain), (pscans, pchain) = both["kernel"], both["python"]
    for k, p in zip(kscans, pscans, strict=True):
        assert dataclasses.asdict(k.summary) == dataclasses.asdict(p.summary), k.summary.name
        for name, column in p.record_columns.items():
            assert np.array_equal(k.record_columns[name], column), (k.summary.name, name)
        for name, column in p.block_columns.items():
            assert np.array_equal(k.block_columns[name], column), (k.summary.name, name)
    assert dataclasses.astuple(kchain) == dataclasses.astuple(pchain)
    return pchain


def link_copy(src: Path, dst: Path, copy: tuple[str, ...] = ()) -> Path:
    """A copy of an archive: hard links, but real copies of the files named in copy."""
    dst.mkdir()
    for f in src.iterdir():
        (shutil.copyfile if f.name in copy else os.link)(f, dst / f.name)
    return dst


def flip(path: Path, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


# ----- real WAL -----


wal = wal_fixture("kernel")


def test_real_wal_scans_equal_the_reference(wal: GeneratedWal) -> None:
    chain = assert_same(wal.archive)
    assert chain.problems == [] and chain.records > 10_000
    assert_same(wal.archive, keep=False)
    for name in wal.names:
        assert_same(wal.archive, name, name)


def test_damaged_real_archives_equal_the_reference(wal: GeneratedWal, test_dir: Path) -> None:
    names = wal.names
    python = scan_both(wal.archive)["python"][0]
    seg1 = python[1].record_columns
    victim = next(int(lsn) for lsn, n in zip(seg1["lsn"], seg1["tot_len"])
                  if n >= 200 and lsn % PAGE + n < PAGE and lsn % DEFAULT_SEGMENT_SIZE > DEFAULT_SEGMENT_SIZE // 2)
    big_segment = next(i for i, s in enumerate(python) if s.summary.records == 0)
    damages = {
        "flipped byte": (names[1], lambda p: flip(p, victim % DEFAULT_SEGMENT_SIZE + 100)),
        "truncated segment": (names[1], lambda p: os.truncate(p, 5 * 1024 * 1024 + 123)),
        "missing segment": (names[2], lambda p: p.unlink()),
        # Inside the record that runs through a whole segment: a page header, the record's bytes, the file's end.
        "bad page address": (names[big_segment], lambda p: flip(p, 5 * PAGE + 8, 0x01)),
        "flipped byte in a huge record": (names[big_segment], lambda p: flip(p, 3 * PAGE + 100)),
        "huge record cut short": (names[big_segment], lambda p: os.truncate(p, 7 * PAGE + 5)),
        "missing contrecord flag": (names[big_segment], lambda p: flip(p, 2 * PAGE + 2, 0x01)),
    }
    for i, (what, (name, damage)) in enumerate(damages.items()):
        archive = link_copy(wal.archive, test_dir / f"archive{i}", copy=(name,))
        damage(archive / name)
        chain = assert_same(archive)
        assert chain.problems, what


# ----- synthesised WAL -----


def commit_record(prev: int, data_before_main: int) -> bytes:
    """A commit record whose timestamp lies data_before_main bytes of block data into the record."""
    blocks = [{"id": 0, "rel": (1663, 5, 16384), "blkno": 1, "data": bytes(range(256)) * (data_before_main // 256)}]
    return build_record(blocks, main=struct.pack("<q", 777_000_000) + b"\0" * 8, rmid=1, info=0x00, prev=prev)


def image_record(prev: int) -> bytes:
    """A heap record with a full-page image with a hole, a second block of the same relation and main data."""
    page = page_with_hole(200, 6000)
    blocks = [{"id": 0, "rel": (1663, 5, 16390), "blkno": 9, "image": page[:200] + page[6000:], "hole_offset": 200,
               "bimg_info": BKPIMAGE_HAS_HOLE | BKPIMAGE_COMPRESS_PGLZ, "hole_length": 5800, "data": b"d" * 30},
              {"id": 1, "flags": BKPBLOCK_SAME_REL, "blkno": 10, "data": b"e" * 12}]
    return build_record(blocks, main=b"m" * 40, rmid=10, info=0x00, origin=3, toplevel=77, prev=prev)


def build_stream() -> WalBuilder:
    """Segments 1..6: records with block references across pages and segments, a record header split across a
    page boundary, commit timestamps far into their records, an aborted record and an XLOG_SWITCH."""
    b = WalBuilder(SEG, seg_size=SEG, prev=SEG - 200)
    b.fill_to(SEG + 3 * PAGE, size=300)
    for _ in range(12):
        b.add_raw(image_record(b.prev))
        b.add_raw(commit_record(b.prev, 5000))
        b.add(1500)
    b.add_ending_at(b.page_end_after(b.insert) - 16)  # the next record's header starts 16 bytes before a page end
    b.add_raw(commit_record(b.prev, 0))
    b.fill_to(2 * SEG - 3 * PAGE, size=250)
    b.add(SEG + 5 * PAGE)  # through the whole of segment 2
    b.fill_to(4 * SEG - PAGE - 100, size=333)
    b.add_ending_at(4 * SEG - 200)
    aborted = b.abort_record(5000)  # crosses into segment 5, which begins by overwriting it
    b.overwrite_contrecord(aborted)
    b.fill_to(5 * SEG + SEG // 2, size=280)
    b.switch()
    b.fill_to(6 * SEG + 5 * PAGE, size=260)
    return b


def write_segments(b: WalBuilder, directory: Path, stream: bytes | None = None) -> list[str]:
    """The stream as segment files; the last one zero-filled past the written WAL, like a live segment."""
    directory.mkdir(parents=True, exist_ok=True)
    data = b.bytes() if stream is None else stream
    names = []
    for off in range(0, len(data), SEG):
        name = segment_file_name(1, (b.base + off) // SEG, SEG)
        (directory / name).write_bytes(data[off : off + SEG].ljust(SEG, b"\0"))
        names.append(name)
    return names


@pytest.fixture(scope="module")
def stream() -> WalBuilder:
    return build_stream()


def test_synthesised_wal_equals_the_reference(stream: WalBuilder, tmp_path: Path) -> None:
    write_segments(stream, tmp_path)
    chain = assert_same(tmp_path)
    scans = scan_both(tmp_path)["kernel"][0]
    times = np.concatenate([s.record_columns["xact_time"][s.record_columns["xact_valid"] == 1] for s in scans])
    assert list(times) == [777_000_000] * 13
    assert sum(len(s.block_columns["block_id"]) for s in scans) == 12 * 3 + 1
    # The aborted record is left out and reading goes on after it; the segment it began in reports that as
    # the reference does (see scan_segment).
    assert any("not finished" in p.message for p in chain.problems)


def test_invalid_block_references_equal_the_reference(stream: WalBuilder, tmp_path: Path) -> None:
    for i, (blocks, message) in enumerate(INVALID_BLOCKS):
        b = WalBuilder(SEG, seg_size=SEG, prev=SEG - 200)
        b.fill_to(SEG + PAGE - 2000, size=300)
        b.add_raw(build_record(blocks, main=b"x" * 20, prev=b.prev))
        b.fill_to(SEG + 3 * PAGE, size=300)
        directory = tmp_path / str(i)
        write_segments(b, directory)
        chain = assert_same(directory)
        assert message in chain.problems[0].message


def damaged(stream: bytes, rng: random.Random, landmarks: list[int]) -> bytes:
    """stream with a few bytes changed: near a landmark (page or record start), or anywhere."""
    data = bytearray(stream)
    for _ in range(rng.randint(1, 3)):
        at = rng.choice(landmarks) + rng.randint(0, 40) if rng.random() < 0.8 else rng.randrange(len(data))
        at = min(at, len(data) - 1)
        data[at] = rng.choice((0, 0xFF, data[at] ^ (1 << rng.randrange(8))))
    return bytes(data)


def test_randomly_damaged_wal_equals_the_reference(stream: WalBuilder, tmp_path: Path) -> None:
    rng = random.Random(20240615)
    base = stream.base
    landmarks = [r.lsn - base for r in stream.records] + list(range(0, len(stream.bytes()), PAGE))
    for i in range(120):
        directory = tmp_path / str(i)
        names = write_segments(stream, directory, damaged(stream.bytes(), rng, landmarks))
        if i % 4 == 0:
            victim = directory / rng.choice(names)
            if rng.random() < 0.3:
                victim.unlink()
            else:
                os.truncate(victim, rng.randrange(SEG))
        assert_same(directory)
        shutil.rmtree(directory)


# ----- the compile cache -----


def test_cache_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit.cache_dir() is None  # the sources' __pycache__ is writable here
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(jit, "_SOURCES", tmp_path / "file" / "sidecar")  # no __pycache__ can be made there
    assert jit.cache_dir() == str(tmp_path / "xdg" / "walsidecar" / "numba")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert jit.cache_dir() == str(tmp_path / "mine")


def test_cache_is_emptied_when_a_source_changes(tmp_path: Path) -> None:
    class Cache:
        cache_path = str(tmp_path)
        flushed = 0

        def flush(self) -> None:
            self.flushed += 1

    cache = Cache()
    jit.drop_stale(cache, "f")
    jit.drop_stale(cache, "f")
    assert cache.flushed == 1  # once: the stamp then names these sources
    (tmp_path / "f.sources").write_text("other sources")
    jit.drop_stale(cache, "f")
    assert cache.flushed == 2
    package = tmp_path / "sidecar" / "wal"
    package.mkdir(parents=True)
    (tmp_path / "sidecar" / "lsn.py").write_text("MAXALIGN = 8\n")
    (package / "format.py").write_text("XLOG_PAGE_MAGIC = 0xD110\n")
    before = jit.sources_digest.__wrapped__(package)
    (package / "format.py").write_text("XLOG_PAGE_MAGIC = 0xD113\n")
    assert jit.sources_digest.__wrapped__(package) != before


def test_another_process_loads_the_compiled_scan_from_the_cache(stream: WalBuilder, tmp_path: Path) -> None:
    names = write_segments(stream, tmp_path)
    assert_same(tmp_path, names[0], names[0])  # compiles, or loads, and caches the kernel here
    probe = (
        "import sys; from sidecar.wal import kernel; from sidecar.wal.archive import *; "
        "plan = plan_archive(LocalStorage(sys.argv[1])); "
        "scan_segment(plan.storage, plan.segments[0], plan.by_segno(), plan.seg_size); "
        "print(sum(kernel.scan.stats.cache_hits.values()), sum(kernel.scan.stats.cache_misses.values()))"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=True,
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)}).stdout
    assert out.split() == ["1", "0"]

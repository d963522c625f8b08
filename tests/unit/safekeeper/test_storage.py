"""WalStorage on real files: layout, durability ordering, truncation, restart, concurrency."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sidecar.lsn import DEFAULT_SEGMENT_SIZE, segment_file_name
from sidecar.safekeeper.storage import DiskFull, StorageError, WalInDoubt, WalStorage

MIB = 1024 * 1024
SEG = MIB


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def names(wal_dir: Path) -> list[str]:
    return sorted(p.name for p in wal_dir.iterdir())


def seg_name(segno: int, tli: int = 1, seg_size: int = SEG, partial: bool = False) -> str:
    return segment_file_name(tli, segno, seg_size) + (".partial" if partial else "")


@pytest.fixture
def wal_dir(tmp_path: Path) -> Path:
    return tmp_path / "wal"


@pytest.fixture
def store(wal_dir: Path):
    s = WalStorage(wal_dir, SEG, 1)
    yield s
    s.close()


def test_fresh_storage_is_empty(store: WalStorage, wal_dir: Path) -> None:
    assert wal_dir.is_dir()
    assert (store.write_lsn, store.segments(), store.first_lsn()) == (0, [], None)


def test_write_requires_open_at(store: WalStorage) -> None:
    with pytest.raises(StorageError, match="open_at"):
        store.write(0, b"x")


@pytest.mark.parametrize("seg_size", [SEG, DEFAULT_SEGMENT_SIZE])
def test_writes_across_segments_use_postgres_names_and_rename_on_flush(tmp_path: Path, seg_size: int) -> None:
    start = 5 * seg_size
    data = payload(2 * seg_size + 1000)
    with WalStorage(tmp_path, seg_size, 3) as s:
        s.open_at(start)
        for off in range(0, len(data), 300_000):
            s.write(start + off, data[off:off + 300_000])
        assert s.write_lsn == start + len(data)
        assert s.flush_lsn == start
        # Filled segments keep their .partial names until their bytes are durable.
        assert names(tmp_path) == [seg_name(n, 3, seg_size, partial=True) for n in (5, 6, 7)]
        assert s.flush() == start + len(data)
        assert names(tmp_path) == [seg_name(5, 3, seg_size), seg_name(6, 3, seg_size),
                                   seg_name(7, 3, seg_size, partial=True)]
        assert s.segments() == [(3, 5, False), (3, 6, False), (3, 7, True)]
        for name in names(tmp_path):
            assert (tmp_path / name).stat().st_size == seg_size
        assert (tmp_path / seg_name(6, 3, seg_size)).read_bytes() == data[seg_size:2 * seg_size]
        assert s.read(start, len(data)) == data


def test_names_past_the_first_xlogid(store: WalStorage, wal_dir: Path) -> None:
    lsn = 0x1_0000_0000 + 3 * SEG
    store.open_at(lsn)
    store.write(lsn, b"abc")
    assert names(wal_dir) == ["000000010000000100000003.partial"]


def test_read_is_exact_and_stops_at_write_lsn(store: WalStorage) -> None:
    data = payload(SEG + 12345, seed=1)
    store.open_at(0)
    store.write(0, memoryview(bytearray(data)))
    assert store.read(0, len(data)) == data
    assert store.read(SEG - 7, 20) == data[SEG - 7:SEG + 13]
    assert store.read(len(data) - 5, 100) == data[-5:]
    assert store.read(len(data), 100) == b""
    assert store.read(10 * SEG, 1) == b""


def test_read_below_stored_wal_is_an_error(store: WalStorage) -> None:
    store.open_at(4 * SEG)
    store.write(4 * SEG, b"abc")
    with pytest.raises(StorageError, match="not stored"):
        store.read(2 * SEG, 10)


def test_non_contiguous_write_rejected(store: WalStorage) -> None:
    store.open_at(0)
    store.write(0, b"abcd")
    with pytest.raises(StorageError, match="non-contiguous write"):
        store.write(10, b"x")
    with pytest.raises(StorageError, match="non-contiguous write"):
        store.write(2, b"x")
    assert store.write_lsn == 4


def test_segment_filled_exactly_is_renamed_on_flush(store: WalStorage, wal_dir: Path) -> None:
    store.open_at(0)
    store.write(0, payload(SEG))
    assert names(wal_dir) == [seg_name(0, partial=True)]
    store.flush()
    assert names(wal_dir) == [seg_name(0)]
    store.write(SEG, b"next")
    assert names(wal_dir) == [seg_name(0), seg_name(1, partial=True)]


def test_new_timeline_names_new_and_completed_segments(store: WalStorage, wal_dir: Path) -> None:
    store.open_at(0)
    store.write(0, payload(SEG // 2))
    store.timeline = 2
    store.write(SEG // 2, payload(SEG, seed=2))
    store.flush()
    # Like PostgreSQL, the segment holding the switch point carries the new timeline.
    assert names(wal_dir) == [seg_name(0, tli=2), seg_name(1, tli=2, partial=True)]


def test_truncate_mid_segment(store: WalStorage, wal_dir: Path) -> None:
    data = payload(SEG // 2, seed=3)
    store.open_at(0)
    store.write(0, data)
    store.flush()
    store.truncate(1000)
    assert (store.write_lsn, store.flush_lsn) == (1000, 1000)
    raw = (wal_dir / seg_name(0, partial=True)).read_bytes()
    assert len(raw) == SEG
    assert raw[:1000] == data[:1000] and raw[1000:] == bytes(SEG - 1000)
    store.write(1000, b"new")
    assert store.read(0, 2000) == data[:1000] + b"new"


def test_truncate_unflushed_bytes_are_zeroed(store: WalStorage, wal_dir: Path) -> None:
    store.open_at(0)
    store.write(0, b"a" * 5000)
    store.truncate(100)
    raw = (wal_dir / seg_name(0, partial=True)).read_bytes()
    assert raw[:100] == b"a" * 100 and raw[100:] == bytes(SEG - 100)


def test_truncate_across_segments(store: WalStorage, wal_dir: Path) -> None:
    data = payload(3 * SEG + 10, seed=4)
    store.open_at(0)
    store.write(0, data)
    store.flush()
    cut = SEG + 777
    store.truncate(cut)
    # Segment 1 was complete: it goes back to .partial with its tail zeroed.
    assert names(wal_dir) == [seg_name(0), seg_name(1, partial=True)]
    raw = (wal_dir / seg_name(1, partial=True)).read_bytes()
    assert raw == data[SEG:cut] + bytes(2 * SEG - cut)
    assert store.read(0, 4 * SEG) == data[:cut]
    store.write(cut, data[cut:])
    store.flush()
    assert store.read(0, len(data)) == data


def test_truncate_at_segment_boundary_deletes_that_segment(store: WalStorage, wal_dir: Path) -> None:
    store.open_at(0)
    store.write(0, payload(2 * SEG + 5))
    store.truncate(SEG)
    # Segment 0 was filled but never flushed: the cut makes it durable and final.
    assert names(wal_dir) == [seg_name(0)]
    assert store.flush_lsn == SEG
    store.write(SEG, b"x")
    assert names(wal_dir) == [seg_name(0), seg_name(1, partial=True)]


def test_truncate_everything(store: WalStorage, wal_dir: Path) -> None:
    store.open_at(2 * SEG)
    store.write(2 * SEG, payload(SEG + 1))
    store.truncate(0)
    assert names(wal_dir) == [] and store.write_lsn == 0
    store.open_at(7 * SEG)
    store.write(7 * SEG, b"y")
    assert store.segments() == [(1, 7, True)]


def test_truncate_beyond_end_rejected(store: WalStorage) -> None:
    store.open_at(0)
    store.write(0, b"abc")
    with pytest.raises(StorageError, match="gap"):
        store.truncate(100)


def test_reopen_after_crash_finds_files(wal_dir: Path) -> None:
    data = payload(2 * SEG + 300, seed=5)
    s = WalStorage(wal_dir, SEG, 1)
    s.open_at(0)
    s.write(0, data[:SEG + 100])
    s.flush()
    s.write(SEG + 100, data[SEG + 100:])
    s.close()  # no flush: segment 1 filled but never renamed
    s = WalStorage(wal_dir, SEG, 1)
    assert s.segments() == [(1, 0, False), (1, 1, True), (1, 2, True)]
    assert s.first_lsn() == 0
    assert s.write_lsn == 3 * SEG  # raw extent, for the startup scan
    assert s.read(0, len(data)) == data
    s.open_at(len(data))
    assert s.segments() == [(1, 0, False), (1, 1, False), (1, 2, True)]
    assert (s.write_lsn, s.flush_lsn) == (len(data), len(data))
    s.write(len(data), b"more")
    s.flush()
    assert s.read(0, 3 * SEG) == data + b"more"
    s.close()


def test_open_at_discards_torn_tail(wal_dir: Path) -> None:
    s = WalStorage(wal_dir, SEG, 1)
    s.open_at(0)
    s.write(0, b"good" * 100 + b"torn garbage")
    s.write(412, payload(2 * SEG))
    s.close()
    s = WalStorage(wal_dir, SEG, 1)
    s.open_at(400)
    assert names(wal_dir) == [seg_name(0, partial=True)]
    raw = (wal_dir / seg_name(0, partial=True)).read_bytes()
    assert raw == b"good" * 100 + bytes(SEG - 400)
    s.close()


def test_open_at_completes_a_short_partial(wal_dir: Path) -> None:
    wal_dir.mkdir()
    (wal_dir / seg_name(0, partial=True)).write_bytes(b"z" * 1000)
    with WalStorage(wal_dir, SEG, 1) as s:
        assert s.read(900, 200) == b"z" * 100 + bytes(100)
        s.open_at(500)
        assert (wal_dir / seg_name(0, partial=True)).stat().st_size == SEG


def test_startup_keeps_final_over_partial(wal_dir: Path) -> None:
    wal_dir.mkdir()
    (wal_dir / seg_name(4, tli=1)).write_bytes(b"F" * SEG)
    (wal_dir / seg_name(4, tli=2, partial=True)).write_bytes(b"P" * SEG)
    (wal_dir / "00000002.history").write_text("1\t0/4000000\tno recovery target specified\n")
    with WalStorage(wal_dir, SEG, 2) as s:
        assert s.segments() == [(1, 4, False)]
        assert s.read(4 * SEG, 3) == b"FFF"
    assert names(wal_dir) == sorted(["00000002.history", seg_name(4, tli=1)])


def test_read_finds_segment_of_another_timeline(wal_dir: Path) -> None:
    wal_dir.mkdir()
    (wal_dir / seg_name(2, tli=1)).write_bytes(b"A" * SEG)
    with WalStorage(wal_dir, SEG, 5) as s:
        s.open_at(3 * SEG)
        s.write(3 * SEG, b"B" * 10)
        assert s.read(3 * SEG - 2, 5) == b"AABBB"
        assert names(wal_dir) == [seg_name(2, tli=1), seg_name(3, tli=5, partial=True)]


def test_seg_size_must_be_a_power_of_two(tmp_path: Path) -> None:
    for bad in (3 * MIB, 32 * 1024):
        with pytest.raises(ValueError):
            WalStorage(tmp_path, bad, 1)
    WalStorage(tmp_path, 64 * 1024, 1).close()


def test_closed_storage_refuses_work(store: WalStorage) -> None:
    store.close()
    with pytest.raises(StorageError, match="closed"):
        store.read(0, 1)


def test_flush_concurrent_with_writes(store: WalStorage) -> None:
    chunk, count = 7000, 600
    data = payload(chunk * count, seed=6)
    start = 3 * SEG
    store.open_at(start)
    errors: list[BaseException] = []
    results: list[tuple[int, int, int]] = []
    done = threading.Event()

    def writer() -> None:
        try:
            for i in range(count):
                store.write(start + i * chunk, data[i * chunk:(i + 1) * chunk])
                if i % 100 == 99:  # let the flusher catch up so the two really interleave
                    seen = len(results)
                    while len(results) == seen and not errors:
                        time.sleep(0.001)
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)
        finally:
            done.set()

    def flusher() -> None:
        try:
            while not done.is_set():
                before = store.write_lsn
                got = store.flush()
                results.append((before, got, store.write_lsn))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer), threading.Thread(target=flusher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) >= count // 100
    flushed = [got for _, got, _ in results]
    assert flushed == sorted(flushed)
    for before, got, after in results:
        # Never claims bytes written after the fdatasync began, never misses ones before.
        assert before <= got <= after
    assert store.flush() == start + len(data)
    assert store.read(start, len(data)) == data
    assert all(not p for _, segno, p in store.segments() if segno < (start + len(data)) // SEG)
    assert len(store.segments()) == (len(data) + SEG - 1) // SEG


def test_files_are_private(store: WalStorage, wal_dir: Path) -> None:
    store.open_at(0)
    store.write(0, b"x")
    assert os.stat(wal_dir / seg_name(0, partial=True)).st_mode & 0o777 == 0o600


def spare_of(wal_dir: Path) -> Path:
    return wal_dir.with_name(wal_dir.name + ".spare")


def test_new_segments_take_the_zero_filled_spare(wal_dir: Path) -> None:
    from support.helpers import wait_for

    with WalStorage(wal_dir, SEG, 1) as s:
        s.open_at(3 * SEG)
        spare = spare_of(wal_dir)
        wait_for(lambda: spare.exists() and spare.stat().st_size == SEG)
        inode = spare.stat().st_ino
        s.write(3 * SEG, b"a" * 100)
        s.flush()
        segment = wal_dir / seg_name(3, partial=True)
        assert segment.stat().st_ino == inode  # the spare became the segment
        assert segment.read_bytes() == b"a" * 100 + bytes(SEG - 100)
        wait_for(lambda: spare.exists() and spare.stat().st_ino != inode)  # and the next one is made
    assert names(wal_dir) == [seg_name(3, partial=True)]


def test_leftover_spares_are_checked_at_start(wal_dir: Path) -> None:
    wal_dir.mkdir()
    spare = spare_of(wal_dir)
    tmp = spare.with_name(spare.name + ".tmp")
    tmp.write_bytes(b"half made")
    spare.write_bytes(bytes(SEG // 2))  # not a whole segment: not trusted
    s = WalStorage(wal_dir, SEG, 1)
    try:
        assert not tmp.exists() and not spare.exists()
    finally:
        s.close()


# ---- a failed fdatasync, a full disk --------------------------------------------------------

def eio(fd: int) -> None:
    raise OSError(errno.EIO, "Input/output error (injected)")


def test_failed_fdatasync_leaves_a_durable_marker_and_the_restart_cuts_back(
        wal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = payload(SEG + 5000, seed=7)
    s = WalStorage(wal_dir, SEG, 1)
    s.open_at(SEG)
    s.write(SEG, data[:3000])
    assert s.flush() == SEG + 3000
    s.write(SEG + 3000, data[3000:])
    with monkeypatch.context() as m:
        m.setattr(os, "fdatasync", eio)
        with pytest.raises(WalInDoubt, match=r"WAL from 0/100BB8 to 0/201388 is in doubt"):
            s.flush()
    # Never again in this process, even though fdatasync now "works".
    with pytest.raises(StorageError, match="in doubt"):
        s.flush()
    with pytest.raises(StorageError, match="in doubt"):
        s.write(s.write_lsn, b"more")
    s.close()
    marker = WalStorage(wal_dir, SEG, 1)
    try:
        doubt = marker.in_doubt()
        assert doubt is not None and (doubt.durable_lsn, doubt.written_lsn) == (SEG + 3000, 2 * SEG + 5000)
        assert "fdatasync of WAL segment" in doubt.reason and "Input/output error" in doubt.reason
        marker.resolve_in_doubt(doubt)
        # The bytes in doubt are gone from the files, not only from this process's view.
        assert names(wal_dir) == [seg_name(1, partial=True)]
        assert (wal_dir / seg_name(1, partial=True)).read_bytes() == data[:3000] + bytes(SEG - 3000)
        assert marker.in_doubt() is None and marker.in_doubt_path.read_bytes() == bytes(512)
    finally:
        marker.close()


def test_an_unreadable_marker_is_an_error_not_ignored(wal_dir: Path) -> None:
    with WalStorage(wal_dir, SEG, 1) as s:
        s.in_doubt_path.write_text("{not json")
        with pytest.raises(StorageError, match="unreadable"):
            s.in_doubt()


@pytest.fixture
def small_fs(tmp_path: Path):
    """A real 3 MiB tmpfs mounted for the test (the test runs as root)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_disk_fails_the_write_that_needs_a_segment_and_keeps_what_was_synced(small_fs: Path) -> None:
    full: list[str] = []
    s = WalStorage(small_fs / "wal", SEG, 1, full.append)
    try:
        s.open_at(0)
        data = payload(2 * SEG, seed=8)
        s.write(0, data[:SEG])
        assert s.flush() == SEG
        # 3 MiB hold three segments at most, spare included: the fourth finds no space.
        with pytest.raises(DiskFull, match="disk full: no space for WAL at") as err:
            s.write(SEG, data[SEG:] + payload(2 * SEG, seed=9))
        assert "WAL up to 0/100000 is durable" in str(err.value)
        assert any(m.startswith("disk full") for m in full)
        # No sparse segment was left behind: the one that did not fit is gone.
        for p in (small_fs / "wal").iterdir():
            assert os.stat(p).st_blocks * 512 >= p.stat().st_size, f"{p.name} is sparse"
        with pytest.raises(StorageError, match="disk full"):
            s.write(s.write_lsn, b"x")
    finally:
        s.close()
    with WalStorage(small_fs / "wal", SEG, 1) as again:
        assert again.read(0, SEG) == data[:SEG]


def test_no_room_for_the_spare_is_reported_but_not_fatal(small_fs: Path) -> None:
    from support.helpers import wait_for

    (small_fs / "filler").write_bytes(bytes(3 * SEG // 2))  # room for one segment, not for two
    full: list[str] = []
    with WalStorage(small_fs / "wal", SEG, 1, full.append) as s:
        s.open_at(0)
        spare = spare_of(small_fs / "wal")
        wait_for(lambda: spare.exists() and spare.stat().st_size == SEG, what="the spare")
        s.write(0, b"first")  # takes the spare; the next spare finds no room
        wait_for(lambda: full, what="the spare segment's failure to be reported")
        assert "spare" in full[0] and "disk full" in full[0]
        s.write(5, b" still writable")
        assert s.flush() == 20


def test_fallocate_falls_back_to_ftruncate_only_where_it_is_unsupported(
        wal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(fd: int, off: int, size: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with WalStorage(wal_dir, SEG, 1) as s:
        s._spare.stop()  # so the new segment is presized, not taken from a spare
        s.open_at(0)
        s.write(0, b"abc")
        assert (wal_dir / seg_name(0, partial=True)).stat().st_size == SEG


def test_a_cut_below_the_checkpoint_lowers_it_first(store: WalStorage) -> None:
    store.open_at(0)
    store.write(0, payload(3 * SEG + 10))
    store.flush()
    store.set_verified(3 * SEG)
    store.truncate(SEG + 100)
    assert store.verified_lsn() == SEG
    store.truncate(SEG + 50)
    assert store.verified_lsn() == SEG


def test_a_new_timeline_renames_the_segment_holding_its_switch_and_names_later_ones(wal_dir: Path) -> None:
    """As a promoted standby's pg_wal: segments below the switch keep the old timeline's name, the one
    holding the switch and every later one take the new timeline's, and the .history file is beside them."""
    from sidecar.timelines import TimelineEntry

    switch = 2 * SEG + 100
    with WalStorage(wal_dir, SEG, 1) as s:
        s.open_at(SEG)
        s.write(SEG, payload(SEG + 100))
        s.flush()
        assert names(wal_dir) == [seg_name(1), seg_name(2, partial=True)]
        s.adopt_timeline(2, (TimelineEntry(1, switch),))
        assert names(wal_dir) == sorted(["00000002.history", seg_name(1), seg_name(2, tli=2, partial=True)])
        assert (wal_dir / "00000002.history").read_text() == "1\t0/200064\tno recovery target specified\n"
        s.write(switch, payload(SEG, 1))
        s.flush()
        assert names(wal_dir) == sorted(["00000002.history", seg_name(1), seg_name(2, tli=2),
                                         seg_name(3, tli=2, partial=True)])
        assert s.read(SEG, SEG + 100) == payload(SEG + 100)  # the old timeline's bytes, served by position
        s.adopt_timeline(3, (TimelineEntry(1, switch), TimelineEntry(2, 4 * SEG)))  # a switch at a boundary
        assert (wal_dir / "00000003.history").read_text().splitlines()[1] == "2\t0/400000\tno recovery target specified"
        assert s.segments()[-1] == (2, 3, True)  # wholly below the switch: still timeline 2's
    # A restart with the persisted history names new segments alike.
    with WalStorage(wal_dir, SEG, 3, history=(TimelineEntry(1, switch), TimelineEntry(2, 4 * SEG))) as s:
        assert s.name_timeline(3) == 2 and s.name_timeline(4) == 3 and s.name_timeline(1) == 1


def test_a_write_in_place_is_offered_only_inside_the_open_segment_and_recorded_as_a_write(store: WalStorage,
                                                                                         wal_dir: Path) -> None:
    """The compiled stream loop's way in (streamloop.py): the open segment's descriptor and bounds, its own
    pwrite, then `wrote`, which leaves what `write` leaves; anything that is not inside that segment is refused."""
    assert store.write_span() is None  # not positioned
    store.open_at(SEG)
    assert store.write_span() is None  # no segment open yet: the first write opens it
    store.write(SEG, payload(100))
    fd, start, end = store.write_span()  # type: ignore[misc]
    assert (start, end) == (SEG, 2 * SEG)
    data = payload(5000, seed=1)
    os.pwrite(fd, data, 100)
    store.wrote(SEG + 100, SEG + 5100)
    assert store.write_lsn == SEG + 5100 and store.read(SEG + 100, 5000) == data
    assert store.flush() == SEG + 5100  # the segment was marked written: the flush syncs it and claims it
    for lsn, end_lsn in ((SEG + 5000, SEG + 6000), (SEG + 5100, 2 * SEG), (SEG + 5100, SEG + 5000)):
        with pytest.raises(StorageError, match="not inside the open segment"):
            store.wrote(lsn, end_lsn)
    store.write(SEG + 5100, payload(SEG - 5100))  # fills the segment: none is open at write_lsn
    assert store.write_span() is None

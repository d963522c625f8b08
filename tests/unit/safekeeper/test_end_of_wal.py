"""The safekeeper's end of valid WAL (`record_end`) on real segment files (restart, vote, Elected)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import google_crc32c
import pytest

from sidecar.consensus.messages import TermEntry
from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.control import ControlData, save_control
from sidecar.safekeeper.server import Safekeeper
from sidecar.lsn import WAL_PAGE_SIZE, format_lsn, segment_file_name
from sidecar.safekeeper.storage import WalStorage
from sidecar.safekeeper.walcheck import StartupError, record_end
from support.walbuilder import DEFAULT_SYSID, WalBuilder
from support.helpers import created

SEG = 1 << 20


def stored(tmp_path: Path, wal: bytes, base: int, history: tuple[TermEntry, ...], junk: bytes = b"") -> Safekeeper:
    """A safekeeper data dir holding `wal` (+ `junk` after it), opened as after a restart."""
    st = WalStorage(tmp_path / "wal", SEG, 1)
    st.open_at(base)
    st.write(base, wal + junk)
    st.flush()
    st.close()
    state = AcceptorState(system_id=DEFAULT_SYSID, wal_seg_size=SEG, pg_version=15, timeline=1,
                          term=history[-1].term, term_history=history)
    save_control(tmp_path, ControlData(1, state))
    sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 1)
    return sk


def build(records: int) -> WalBuilder:
    b = WalBuilder(SEG, seg_size=SEG)
    rng = random.Random(records)
    for _ in range(records):
        b.add(rng.randint(50, 3000))
    return b


def test_a_vote_after_a_term_without_wal_still_fingerprints_the_last_record(tmp_path: Path) -> None:
    b = build(1500)  # well past one segment, so the last record lies in a later file
    last = b.records[-1]
    e = last.end_lsn
    sk = stored(tmp_path, b.bytes(), SEG, (TermEntry(1, SEG), TermEntry(2, e)))
    end = record_end(sk.storage, sk.acceptor.state)
    assert end.flush_lsn == e
    assert end.tail_lsn == last.lsn
    assert end.tail_crc == google_crc32c.value(bytes(b.buf[last.lsn - SEG:e - SEG]))


def test_a_torn_tail_reaching_past_the_term_start_is_not_taken_for_wal(tmp_path: Path) -> None:
    # Catching up below E, the safekeeper crashed: the last record before E is torn and junk
    # lies past E. Its WAL ends at the previous record, not at the term start.
    b = build(1500)
    before, last = b.records[-2], b.records[-1]
    e = last.end_lsn
    b.corrupt(last.data_end - 40, bytes(40))
    sk = stored(tmp_path, b.bytes(), SEG, (TermEntry(1, SEG), TermEntry(2, e)), junk=random.Random(1).randbytes(300))
    assert sk.acceptor.write_lsn == before.end_lsn < e
    assert record_end(sk.storage, sk.acceptor.state).flush_lsn == before.end_lsn


def test_a_record_spanning_a_whole_segment_is_found_by_stepping_back(tmp_path: Path) -> None:
    b = build(400)
    big = b.add(SEG + 200_000)  # begins in one segment and covers the next one entirely
    sk = stored(tmp_path, b.bytes(), SEG, (TermEntry(1, SEG),))
    end = record_end(sk.storage, sk.acceptor.state)
    assert end.flush_lsn == big.end_lsn
    assert end.tail_lsn == max(big.lsn, big.end_lsn - (1 << 20))


# ---- damage found at start: the safekeeper refuses, names the file and LSN, changes nothing ----

def damaged_dir(tmp_path: Path) -> tuple[Path, WalBuilder]:
    """Five 1 MiB segments written and closed: 1-4 final-named, 5 the .partial tail."""
    b = build(1)
    b.fill_to(5 * SEG + SEG // 3, 300)
    st = WalStorage(tmp_path / "wal", SEG, 1)
    st.open_at(SEG)
    st.write(SEG, b.bytes())
    st.flush()
    st.close()
    state = AcceptorState(system_id=DEFAULT_SYSID, wal_seg_size=SEG, pg_version=15, timeline=1,
                          term=1, term_history=(TermEntry(1, SEG),))
    save_control(tmp_path, ControlData(1, state))
    return tmp_path / "wal", b


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def refused(tmp_path: Path, *words: str) -> str:
    """Open the safekeeper, which must refuse; the message holds every one of `words`."""
    before = {d: files_of(d) for d in (tmp_path, tmp_path / "wal")}
    with pytest.raises(StartupError) as err:
        Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 1)
    msg = str(err.value)
    for w in words:
        assert w in msg, (w, msg)
    assert "refuses to start" in msg
    assert {d: files_of(d) for d in before} == before, "a refused start changed the data directory"
    return msg


def seg_path(wal: Path, segno: int, partial: bool = False) -> Path:
    return wal / (segment_file_name(1, segno, SEG) + (".partial" if partial else ""))


def test_undamaged_wal_starts_and_records_the_checkpoint(tmp_path: Path) -> None:
    wal, b = damaged_dir(tmp_path)
    sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 1)
    assert sk.acceptor.write_lsn == b.records[-1].end_lsn
    assert sk.storage.verified_lsn() == 5 * SEG


def test_a_final_segment_cut_short_is_refused(tmp_path: Path) -> None:
    # The audit's case: the last final-named segment cut to a third used to be renamed to
    # .partial and the later segment deleted, rolling acknowledged WAL back.
    wal, _ = damaged_dir(tmp_path)
    path = seg_path(wal, 4)
    os.truncate(path, SEG // 3)
    refused(tmp_path, str(path), "cut short", format_lsn(4 * SEG + SEG // 3))


def test_a_segment_too_long_is_refused(tmp_path: Path) -> None:
    wal, _ = damaged_dir(tmp_path)
    path = seg_path(wal, 2)
    with path.open("ab") as f:
        f.write(b"x" * 100)
    refused(tmp_path, str(path), "too long")


def test_a_missing_middle_segment_is_refused(tmp_path: Path) -> None:
    wal, _ = damaged_dir(tmp_path)
    seg_path(wal, 3).unlink()
    refused(tmp_path, segment_file_name(1, 3, SEG), "missing", format_lsn(3 * SEG))


def test_a_missing_last_final_segment_is_refused(tmp_path: Path) -> None:
    wal, _ = damaged_dir(tmp_path)
    seg_path(wal, 4).unlink()  # the .partial after it remains
    refused(tmp_path, segment_file_name(1, 4, SEG), "missing", format_lsn(4 * SEG))


def test_a_flipped_byte_in_a_middle_page_header_is_refused(tmp_path: Path) -> None:
    wal, _ = damaged_dir(tmp_path)
    path = seg_path(wal, 2)
    page = 37 * WAL_PAGE_SIZE
    flip(path, page + 9)  # inside xlp_pageaddr
    refused(tmp_path, str(path), "page header", format_lsn(2 * SEG + page))


def test_a_flipped_byte_in_a_middle_record_is_refused(tmp_path: Path) -> None:
    wal, b = damaged_dir(tmp_path)
    path = seg_path(wal, 2)
    rec = next(r for r in b.records if r.lsn > 2 * SEG + SEG // 2)
    flip(path, rec.lsn + 30 - 2 * SEG)  # in the record's body: only its CRC can tell
    refused(tmp_path, str(path), f"CRC mismatch at {format_lsn(rec.lsn)}")


def test_a_zeroed_page_inside_a_final_segment_is_refused(tmp_path: Path) -> None:
    wal, _ = damaged_dir(tmp_path)
    path = seg_path(wal, 3)
    with path.open("r+b") as f:
        f.seek(10 * WAL_PAGE_SIZE)
        f.write(bytes(WAL_PAGE_SIZE))
    refused(tmp_path, str(path), format_lsn(3 * SEG + 11 * WAL_PAGE_SIZE))


def test_a_segment_of_another_system_is_refused(tmp_path: Path) -> None:
    wal, _ = damaged_dir(tmp_path)
    other = WalBuilder(2 * SEG, seg_size=SEG, sysid=DEFAULT_SYSID + 1)
    other.fill_to(3 * SEG, 300)
    seg_path(wal, 2).write_bytes(other.bytes()[:SEG])
    refused(tmp_path, str(seg_path(wal, 2)), "different database system")


def test_the_chain_is_walked_from_the_checkpoint_only(tmp_path: Path) -> None:
    # Below the checkpoint only page headers are read again: a record flipped there after a
    # start that verified it is not found (the price of a fast start, see walcheck.py).
    wal, b = damaged_dir(tmp_path)
    Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 1)
    rec = next(r for r in b.records if r.lsn > 2 * SEG + SEG // 2)
    flip(seg_path(wal, 2), rec.lsn + 30 - 2 * SEG)
    Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 1)
    (tmp_path / "wal.verified").unlink()  # no checkpoint: everything is walked
    refused(tmp_path, f"CRC mismatch at {format_lsn(rec.lsn)}")


def test_a_torn_partial_tail_is_not_damage(tmp_path: Path) -> None:
    wal, b = damaged_dir(tmp_path)
    last = b.records[-1]
    flip(seg_path(wal, 5, partial=True), last.lsn + 30 - 5 * SEG)  # unsynced bytes a crash tore
    sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 1)
    assert sk.acceptor.write_lsn == b.records[-2].end_lsn


def test_a_record_from_the_last_final_segment_torn_in_the_tail_is_not_damage(tmp_path: Path) -> None:
    b = build(1)
    b.fill_to(3 * SEG - 5000, 300)
    spanning = b.add(20_000)  # from segment 2, final-named, into the .partial segment 3
    b.fill_to(3 * SEG + 50_000, 300)
    st = WalStorage(tmp_path / "wal", SEG, 1)
    st.open_at(SEG)
    st.write(SEG, b.bytes())
    st.flush()
    st.close()
    save_control(tmp_path, ControlData(1, AcceptorState(system_id=DEFAULT_SYSID, wal_seg_size=SEG, pg_version=15,
                                                         timeline=1, term=1, term_history=(TermEntry(1, SEG),))))
    flip(tmp_path / "wal" / (segment_file_name(1, 3, SEG) + ".partial"), spanning.data_end - 3 * SEG - 10)
    sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 1)
    assert sk.acceptor.write_lsn == spanning.lsn


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))

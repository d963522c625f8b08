"""The safekeeper's end-of-WAL scan on real segment files (restart, vote, Elected)."""

from __future__ import annotations

import random
from pathlib import Path

import google_crc32c

from sidecar.consensus.messages import TermEntry
from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.control import ControlData, save_control
from sidecar.safekeeper.server import Safekeeper
from sidecar.safekeeper.storage import WalStorage
from walbuilder import DEFAULT_SYSID, WalBuilder

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
    sk = Safekeeper(1, tmp_path, "127.0.0.1", 1)
    sk.open()
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
    end = sk._scan(sk.acceptor.state)
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
    assert sk._scan(sk.acceptor.state).flush_lsn == before.end_lsn


def test_a_record_spanning_a_whole_segment_is_found_by_stepping_back(tmp_path: Path) -> None:
    b = build(400)
    big = b.add(SEG + 200_000)  # begins in one segment and covers the next one entirely
    sk = stored(tmp_path, b.bytes(), SEG, (TermEntry(1, SEG),))
    end = sk._scan(sk.acceptor.state)
    assert end.flush_lsn == big.end_lsn
    assert end.tail_lsn == max(big.lsn, big.end_lsn - (1 << 20))

"""The uploader's pure parts: the election without a broker, object names, the whole-segment check."""

from __future__ import annotations

from sidecar.consensus.acceptor import Acceptor, Persist
from sidecar.consensus.messages import TermEntry
from sidecar.consensus.state import AcceptorState
from sidecar.archivedwal import partial_name, wal_prefix
from sidecar.safekeeper.backup import RankElection, check_segment, first_archived_lsn
from sidecar.wal.format import LONG_PAGE_HEADER, XLOG_PAGE_MAGIC, XLP_LONG_HEADER

SEG = 16 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_lowest_id_uploads_at_once_the_others_after_a_grace_growing_with_their_id() -> None:
    clock = Clock()
    first, second, third = (RankElection(i, 10.0, clock) for i in (1, 2, 3))
    assert first.may_upload(SEG)
    assert not second.may_upload(SEG) and not third.may_upload(SEG)
    clock.now += 10
    assert second.may_upload(SEG) and not third.may_upload(SEG)
    clock.now += 10
    assert third.may_upload(SEG)
    # Having taken over, safekeeper 2 uploads the next segments at once...
    assert second.may_upload(2 * SEG) and second.may_upload(3 * SEG)
    # ...until it finds one uploaded by another (safekeeper 1 is back): then it waits again.
    second.seen_archived(4 * SEG)
    assert not second.may_upload(5 * SEG)
    clock.now += 9.9
    assert not second.may_upload(5 * SEG)
    clock.now += 0.1
    assert second.may_upload(5 * SEG)


def test_names() -> None:
    assert wal_prefix("prod", 7301) == "prod/7301/wal"
    name = partial_name("000000010000000000000005", 3, 0x5001234)
    assert name == "000000010000000000000005.term-3.end-0-5001234.partial"
    assert name != "000000010000000000000005" and not name.endswith("5.partial")


def test_only_whole_segments_from_the_first_term_start_on() -> None:
    state = AcceptorState(system_id=7, wal_seg_size=SEG, term_history=(TermEntry(1, 3 * SEG),))
    assert first_archived_lsn(state) == 3 * SEG
    assert first_archived_lsn(AcceptorState(system_id=7, wal_seg_size=SEG,
                                            term_history=(TermEntry(1, 3 * SEG + 8192),))) == 4 * SEG
    good = bytearray(SEG)
    LONG_PAGE_HEADER.pack_into(good, 0, XLOG_PAGE_MAGIC, XLP_LONG_HEADER, 1, 3 * SEG, 0, 7, SEG, 8192)
    assert check_segment(bytes(good), 3 * SEG, SEG, 7) is None
    assert "long page header" in check_segment(bytes(SEG), 3 * SEG, SEG, 7)  # zeros: joined inside it
    assert "system identifier" in check_segment(bytes(good), 3 * SEG, SEG, 8)
    assert "bytes" in check_segment(bytes(good[:100]), 3 * SEG, SEG, 7)


def test_backup_lsn_is_persisted_never_above_commit_and_never_back() -> None:
    acc = Acceptor(1, AcceptorState(system_id=7, wal_seg_size=SEG, commit_lsn=3 * SEG), 3 * SEG)
    assert acc.on_backed_up(2 * SEG) == [Persist(acc.state)] and acc.state.backup_lsn == 2 * SEG
    assert acc.on_backed_up(SEG) == []
    acc.on_backed_up(5 * SEG)
    assert acc.state.backup_lsn == 3 * SEG
    assert acc.info().backup_lsn == 3 * SEG

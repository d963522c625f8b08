"""The safekeeper acceptor state machine, one PROTOCOL.md rule per test."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.consensus import limits
from sidecar.consensus.acceptor import (
    Acceptor, AcceptorAction, AcceptorError, AdoptTimeline, PeerTerm, Persist, RecordEnd, Reply, Truncate, Write,
)
from sidecar.consensus.messages import (
    NO_DEGRADED, PROTOCOL_VERSION, Append, AppendReply, DegradedRange, DegradedRecord, DegradedRecordReply, Elected,
    ElectedReply, Greeting, GreetingReply,
    InfoReply, Message, TermEntry, TermHistory, VoteReply, VoteRequest,
)
from sidecar.timelines import TimelineEntry
from sidecar.consensus.state import AcceptorState

SYSID = 7_300_000_000_000_000_001
SEG = 16 * 1024 * 1024
PGV = 16


def h(*pairs: tuple[int, int]) -> TermHistory:
    return tuple(TermEntry(t, s) for t, s in pairs)


def greeting(**kw: int) -> Greeting:
    fields: dict[str, int] = dict(protocol_version=PROTOCOL_VERSION, system_id=SYSID, timeline=1,
                                  wal_seg_size=SEG, pg_version=PGV)
    fields.update(kw)
    return Greeting(proposer_id="p", **fields)  # type: ignore[arg-type]


def configured(term: int = 0, history: TermHistory = (), commit: int = 0) -> AcceptorState:
    return AcceptorState(system_id=SYSID, wal_seg_size=SEG, pg_version=PGV, timeline=1,
                         term=term, term_history=history, commit_lsn=commit)


def replies(actions: list[AcceptorAction]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, Reply)]


def only_reply(actions: list[AcceptorAction]) -> Message:
    msgs = replies(actions)
    assert len(msgs) == 1, actions
    return msgs[0]


def snapshot(a: Acceptor) -> tuple[object, ...]:
    """Everything a refused message must leave as it was."""
    return (a.state, a.write_lsn, a.flush_lsn, a.elected_term, a.owner, a.wal_epoch)


def elected_acceptor(term: int = 3, start: int = 1000, history: TermHistory | None = None) -> Acceptor:
    """An acceptor that voted for `term` and applied its Elected at `start` (empty store)."""
    a = Acceptor(1, configured(term=term - 1), 0)
    a.on_vote(VoteRequest(term), RecordEnd(0))
    hist = history if history is not None else h((term, start))
    acts = a.on_elected(Elected(term, start, hist), RecordEnd(0))
    assert Truncate(start) in acts
    return a


# ---- greeting -------------------------------------------------------------------------------

def test_first_greeting_adopts_the_cluster_identity_and_persists_it() -> None:
    a = Acceptor(5, AcceptorState(), 0)
    acts = a.on_greeting(greeting(timeline=3))
    assert isinstance(acts[0], Persist)
    persisted = acts[0].state
    assert (persisted.system_id, persisted.wal_seg_size, persisted.pg_version) == (SYSID, SEG, PGV)
    assert persisted.timeline == 3
    assert a.state == persisted
    assert acts.index(acts[0]) < acts.index(next(x for x in acts if isinstance(x, Reply)))
    assert only_reply(acts) == GreetingReply(5, 0)


def test_later_matching_greeting_reports_the_term_without_persisting() -> None:
    a = Acceptor(5, configured(term=9), 0)
    acts = a.on_greeting(greeting())
    assert not any(isinstance(x, Persist) for x in acts)
    assert only_reply(acts) == GreetingReply(5, 9)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("system_id", SYSID + 1, "system id"),
    ("wal_seg_size", SEG * 2, "segment size"),
    ("pg_version", PGV - 1, "version"),
    ("protocol_version", PROTOCOL_VERSION + 1, "protocol version"),
])
def test_mismatching_greeting_is_refused_and_changes_nothing(field: str, value: int, words: str) -> None:
    state = configured(term=4, history=h((4, 1000)), commit=1500)
    a = Acceptor(5, state, 2000)
    before = (a.state, a.write_lsn, a.flush_lsn, a.elected_term)
    with pytest.raises(AcceptorError, match=words):
        a.on_greeting(greeting(**{field: value}))
    assert (a.state, a.write_lsn, a.flush_lsn, a.elected_term) == before


def test_protocol_version_mismatch_is_refused_even_on_first_contact() -> None:
    a = Acceptor(5, AcceptorState(), 0)
    with pytest.raises(AcceptorError):
        a.on_greeting(greeting(protocol_version=PROTOCOL_VERSION + 1))
    assert a.state == AcceptorState()


# ---- votes ----------------------------------------------------------------------------------

def test_vote_granted_iff_term_above_current() -> None:
    for asked, current, granted in [(5, 4, True), (9, 4, True), (4, 4, False), (3, 4, False)]:
        a = Acceptor(1, configured(term=current), 0)
        reply = only_reply(a.on_vote(VoteRequest(asked), RecordEnd(0)))
        assert isinstance(reply, VoteReply)
        assert reply.granted is granted, (asked, current)
        assert a.state.term == (asked if granted else current)


def test_granted_vote_persists_the_term_before_replying() -> None:
    a = Acceptor(1, configured(term=4), 0)
    acts = a.on_vote(VoteRequest(6), RecordEnd(0))
    kinds = [type(x) for x in acts]
    assert kinds == [Persist, Reply]
    assert isinstance(acts[0], Persist) and acts[0].state.term == 6
    reply = only_reply(acts)
    assert isinstance(reply, VoteReply) and reply.term == 6 and reply.granted


def test_refused_vote_reports_the_higher_term_and_persists_nothing() -> None:
    a = Acceptor(1, configured(term=8), 0)
    acts = a.on_vote(VoteRequest(6), RecordEnd(0))
    assert not any(isinstance(x, Persist) for x in acts)
    reply = only_reply(acts)
    assert isinstance(reply, VoteReply)
    assert (reply.term, reply.granted) == (8, False)
    assert a.state.term == 8


def test_same_term_vote_is_not_granted_and_reports_that_term() -> None:
    a = Acceptor(1, configured(term=6), 0)
    reply = only_reply(a.on_vote(VoteRequest(6), RecordEnd(0)))
    assert isinstance(reply, VoteReply)
    assert (reply.term, reply.granted) == (6, False)


def test_vote_reply_carries_the_record_end_and_history_cut_there() -> None:
    timelines = (TimelineEntry(1, 0x5000),)
    state = replace(configured(term=3, history=h((1, 100), (2, 800), (3, 1200))),
                    timeline_history=timelines)
    a = Acceptor(1, state, 1500)
    reply = only_reply(a.on_vote(VoteRequest(4), RecordEnd(1000, tail_lsn=960, tail_crc=0xABCD)))
    assert isinstance(reply, VoteReply)
    assert reply.flush_lsn == 1000
    assert reply.term_history == h((1, 100), (2, 800))
    assert reply.timeline_history == timelines
    assert (reply.tail_lsn, reply.tail_crc) == (960, 0xABCD)


# ---- Elected --------------------------------------------------------------------------------

def test_elected_truncates_a_stale_tail_at_the_divergence_point() -> None:
    # Term 2's WAL from 800 was never acknowledged; term 4 starts at 700 on term 1's WAL.
    a = Acceptor(1, configured(term=3, history=h((1, 100), (2, 800))), 1500)
    a.on_vote(VoteRequest(4), RecordEnd(1500))
    proposer = h((1, 100), (4, 700))
    acts = a.on_elected(Elected(4, 700, proposer), RecordEnd(1500))
    assert [type(x) for x in acts] == [Truncate, Persist, Reply]
    assert acts[0] == Truncate(700)
    assert isinstance(acts[1], Persist) and acts[1].state.term_history == proposer
    assert only_reply(acts) == ElectedReply(4, 700)
    assert a.state.term_history == proposer
    assert (a.write_lsn, a.flush_lsn, a.elected_term) == (700, 700, 4)


def test_elected_keeps_a_lagging_safekeeper_at_its_flush() -> None:
    a = Acceptor(1, configured(term=1, history=h((1, 100))), 400)
    a.on_vote(VoteRequest(2), RecordEnd(400))
    acts = a.on_elected(Elected(2, 900, h((1, 100), (2, 900))), RecordEnd(400))
    assert Truncate(400) in acts
    assert only_reply(acts) == ElectedReply(2, 400)
    assert a.state.term_history == h((1, 100), (2, 900))
    assert a.write_lsn == 400


def test_elected_never_truncates_above_the_stored_wal() -> None:
    # No term in common and the proposer's history starts above this safekeeper's WAL:
    # the cut is min(flush, divergence point), i.e. the flush.
    a = Acceptor(1, configured(term=1, history=h((1, 100))), 400)
    a.on_vote(VoteRequest(2), RecordEnd(400))
    acts = a.on_elected(Elected(2, 900, h((2, 900))), RecordEnd(400))
    assert acts[0] == Truncate(400)
    assert only_reply(acts) == ElectedReply(2, 400)


def test_elected_with_no_common_term_cuts_at_the_proposer_history_start() -> None:
    a = Acceptor(1, configured(term=1, history=h((1, 100))), 4000)
    a.on_vote(VoteRequest(2), RecordEnd(4000))
    acts = a.on_elected(Elected(2, 100, h((2, 100))), RecordEnd(4000))
    assert acts[0] == Truncate(100)
    assert only_reply(acts) == ElectedReply(2, 100)


def test_elected_whose_cut_lies_below_commit_is_refused_naming_both_positions() -> None:
    # DL-1: after a vote, Elected(T, 0) would cut every byte; the acknowledged WAL is kept.
    a = Acceptor(1, configured(term=1, history=h((1, 0x1000000)), commit=0x1400000), 0x1500000)
    a.on_vote(VoteRequest(2), RecordEnd(0x1500000))
    before = snapshot(a)
    for start, hist in [(0, h((2, 0))), (0x1200000, h((1, 0x1000000), (2, 0x1200000)))]:
        with pytest.raises(AcceptorError, match=r"0/(0|1200000)\b.*0/1400000"):
            a.on_elected(Elected(2, start, hist), RecordEnd(0x1500000))
        assert snapshot(a) == before


def test_elected_at_or_above_commit_keeps_commit_lsn() -> None:
    a = Acceptor(1, configured(term=1, history=h((1, 100)), commit=1200), 1500)
    a.on_vote(VoteRequest(2), RecordEnd(1500))
    acts = a.on_elected(Elected(2, 1200, h((1, 100), (2, 1200))), RecordEnd(1500))
    assert acts[0] == Truncate(1200)
    assert isinstance(acts[1], Persist) and acts[1].state.commit_lsn == 1200
    assert a.state.commit_lsn == 1200


def test_elected_cutting_to_the_last_record_below_commit_lowers_commit_lsn_there() -> None:
    # commit_lsn was learned while the WAL up to it was written but not yet synced (a crash lost
    # it), or counted a torn record's bytes raw. Cutting at the last record end removes no whole
    # acknowledged record; the new term writes those positions again, so readers may have them
    # only once it acknowledges them: commit_lsn goes down to the cut.
    a = Acceptor(1, configured(term=1, history=h((1, 100)), commit=1400), 1000)
    a.on_vote(VoteRequest(2), RecordEnd(1000))
    acts = a.on_elected(Elected(2, 1500, h((1, 100), (2, 1500))), RecordEnd(1000))
    assert acts[0] == Truncate(1000)
    assert a.state.commit_lsn == 1000 and acts[1].state.commit_lsn == 1000  # type: ignore[union-attr]
    a.on_append(Append(2, 1000, 1200, 0, b"x" * 300), a.owner)
    assert a.state.commit_lsn == 1200  # the new term's acknowledgement raises it again


def test_elected_on_an_empty_store_starts_it_at_the_term_start() -> None:
    a = Acceptor(1, configured(term=0), 0)
    a.on_vote(VoteRequest(1), RecordEnd(0))
    acts = a.on_elected(Elected(1, 0x1000000, h((1, 0x1000000))), RecordEnd(0))
    assert acts[0] == Truncate(0x1000000)
    assert only_reply(acts) == ElectedReply(1, 0x1000000)


def test_elected_with_a_lower_term_is_answered_with_the_higher_term() -> None:
    a = Acceptor(1, configured(term=7, history=h((1, 100))), 500)
    acts = a.on_elected(Elected(5, 300, h((1, 100), (5, 300))), RecordEnd(500))
    assert not any(isinstance(x, (Truncate, Persist, Write)) for x in acts)
    reply = only_reply(acts)
    assert isinstance(reply, ElectedReply) and reply.term == 7
    assert a.state.term_history == h((1, 100))


def test_elected_without_a_vote_for_that_term_is_refused() -> None:
    a = Acceptor(1, configured(term=4, history=h((1, 100))), 500)
    with pytest.raises(AcceptorError, match="without a vote"):
        a.on_elected(Elected(6, 500, h((1, 100), (6, 500))), RecordEnd(500))
    assert a.state == configured(term=4, history=h((1, 100)))
    assert a.elected_term == 0


def test_elected_whose_history_does_not_end_with_its_term_is_refused() -> None:
    a = Acceptor(1, configured(term=4, history=h((1, 100))), 500)
    with pytest.raises(AcceptorError):
        a.on_elected(Elected(4, 500, h((1, 100), (3, 500))), RecordEnd(500))
    assert a.state.term_history == h((1, 100))


def test_elected_with_a_contradicting_history_is_refused() -> None:
    a = Acceptor(1, configured(term=3, history=h((1, 100), (2, 300))), 900)
    before = a.state
    with pytest.raises(AcceptorError, match="term 2"):
        a.on_elected(Elected(3, 800, h((1, 100), (2, 350), (3, 800))), RecordEnd(900))
    assert a.state == before
    assert a.elected_term == 0


def test_elected_again_in_the_same_term_keeps_what_was_written() -> None:
    a = elected_acceptor(term=3, start=1000)
    a.on_append(Append(3, 1000, 0, 0, b"x" * 300))
    a.on_flushed(1300)
    acts = a.on_elected(Elected(3, 1000, h((3, 1000))), RecordEnd(1300))
    assert Truncate(1300) in acts
    assert only_reply(acts) == ElectedReply(3, 1300)


# ---- Append ---------------------------------------------------------------------------------

def test_stale_append_is_refused_with_the_safekeepers_term() -> None:
    a = elected_acceptor(term=3, start=1000)
    a.on_vote(VoteRequest(5), RecordEnd(1000))
    acts = a.on_append(Append(3, 1000, 0, 0, b"old"))
    assert not any(isinstance(x, Write) for x in acts)
    reply = only_reply(acts)
    assert isinstance(reply, AppendReply) and reply.term == 5
    assert a.write_lsn == 1000


def test_append_before_elected_is_refused() -> None:
    a = Acceptor(1, configured(term=2), 0)
    a.on_vote(VoteRequest(3), RecordEnd(0))
    with pytest.raises(AcceptorError, match="before Elected"):
        a.on_append(Append(3, 0, 0, 0, b"abc"))
    with pytest.raises(AcceptorError):
        a.on_append(Append(3, 0, 0, 0, b""))
    assert a.write_lsn == 0


def test_append_for_a_term_above_the_promise_is_refused() -> None:
    a = elected_acceptor(term=3, start=1000)
    with pytest.raises(AcceptorError):
        a.on_append(Append(4, 1000, 0, 0, b"abc"))
    assert a.state.term == 3 and a.write_lsn == 1000


@pytest.mark.parametrize("begin", [999, 1001, 1004, 2000])
def test_non_contiguous_append_is_refused_and_changes_nothing(begin: int) -> None:
    a = elected_acceptor(term=3, start=1000)
    a.on_append(Append(3, 1000, 0, 0, b"abc"))
    before = (a.state, a.write_lsn, a.flush_lsn)
    with pytest.raises(AcceptorError, match="does not continue"):
        a.on_append(Append(3, begin, 1002, 0, b"zz"))
    assert (a.state, a.write_lsn, a.flush_lsn) == before


def test_append_writes_then_replies_after_flush() -> None:
    a = elected_acceptor(term=3, start=1000)
    acts = a.on_append(Append(3, 1000, 0, 0, b"hello"))
    assert Write(1000, b"hello") in acts
    assert not replies(acts)  # nothing is acknowledged before it is durable
    acts = a.on_append(Append(3, 1005, 0, 0, b"world"))
    assert Write(1005, b"world") in acts and not replies(acts)
    assert only_reply(a.on_flushed(1005)) == AppendReply(3, 1005, 0)
    assert only_reply(a.on_flushed(1010)) == AppendReply(3, 1010, 0)


def test_flush_is_capped_at_what_was_written_and_never_decreases() -> None:
    a = elected_acceptor(term=3, start=1000)
    a.on_append(Append(3, 1000, 0, 0, b"12345"))
    reply = only_reply(a.on_flushed(5000))
    assert isinstance(reply, AppendReply) and reply.flush_lsn == 1005
    reply = only_reply(a.on_flushed(1002))
    assert isinstance(reply, AppendReply) and reply.flush_lsn == 1005


def test_after_a_higher_promise_a_flush_is_no_acknowledgement_in_the_old_term() -> None:
    """WAL written in term 3 and synced after term 4 was promised: the reply carries term 4, which the
    old proposer takes as its end, not as an acknowledgement (the vote may have reported less)."""
    a = elected_acceptor(term=3, start=1000)
    a.on_append(Append(3, 1000, 0, 0, b"abcdef"))
    a.on_vote(VoteRequest(4), RecordEnd(1000))
    assert only_reply(a.on_flushed(1006)) == AppendReply(4, 1006, 0)
    assert only_reply(a.on_append(Append(3, 1006, 0, 0, b"more"))) == AppendReply(4, 1006, 0)
    assert a.write_lsn == 1006  # and nothing more is written in term 3


def test_heartbeat_is_answered_at_once_and_carries_commit() -> None:
    a = elected_acceptor(term=3, start=1000)
    a.on_append(Append(3, 1000, 0, 0, b"abcdef"))
    a.on_flushed(1006)
    acts = a.on_append(Append(3, 1006, 1004, 0, b""))
    assert not any(isinstance(x, Write) for x in acts)
    assert only_reply(acts) == AppendReply(3, 1006, 1004)
    assert a.state.commit_lsn == 1004


def test_commit_learned_never_exceeds_the_written_wal_nor_decreases() -> None:
    a = elected_acceptor(term=3, start=1000)
    a.on_append(Append(3, 1000, 5000, 0, b"abcdef"))
    assert a.state.commit_lsn == 1006
    a.on_append(Append(3, 1006, 1003, 0, b""))
    assert a.state.commit_lsn == 1006


def test_commit_hint_is_persisted_lazily_once_a_segment_of_progress() -> None:
    a = elected_acceptor(term=3, start=0x1000000)
    lsn = 0x1000000
    persisted: list[int] = []
    chunk = b"\0" * (1024 * 1024)
    for _ in range(40):
        acts = a.on_append(Append(3, lsn, lsn, 0, chunk))
        persisted += [x.state.commit_lsn for x in acts if isinstance(x, Persist)]
        lsn += len(chunk)
    assert persisted, "commit_lsn was never persisted"
    assert len(persisted) <= 3
    assert all(b - a_ >= SEG for a_, b in zip(persisted, persisted[1:]))
    assert persisted == sorted(persisted)


def test_a_probe_vote_request_persists_and_grants_nothing() -> None:
    from sidecar.consensus.acceptor import Acceptor, Persist, RecordEnd, Reply
    from sidecar.consensus.messages import VoteReply, VoteRequest
    from sidecar.consensus.state import AcceptorState
    for term in (0, 4):
        a = Acceptor(1, AcceptorState(system_id=1, wal_seg_size=16 << 20, timeline=1, term=term), 0)
        actions = a.on_vote(VoteRequest(0), RecordEnd(123, 100, 9))
        assert not [x for x in actions if isinstance(x, Persist)]
        [reply] = [x.message for x in actions if isinstance(x, Reply)]
        assert isinstance(reply, VoteReply) and not reply.granted and reply.term == term
        assert (reply.flush_lsn, reply.tail_lsn, reply.tail_crc) == (123, 100, 9)
        assert a.state.term == term


def test_learning_commit_keeps_every_other_field():
    state = AcceptorState(system_id=SYSID, wal_seg_size=SEG, pg_version=PGV, timeline=3, term=5,
                          term_history=h((5, SEG)), timeline_history=(TimelineEntry(2, SEG // 2),),
                          commit_lsn=SEG, backup_lsn=SEG - 8, peer_horizon_lsn=SEG - 16)
    acc = Acceptor(1, state, SEG)
    acc.elected_term = 5
    acc.on_append(Append(5, SEG, SEG + 100, SEG + 50, b"x" * 100))
    assert acc.state == replace(state, commit_lsn=SEG + 100, peer_horizon_lsn=SEG + 50)


# ---- every field validated before anything changes (audit UA-2, DOS-1, DOS-1b, CR-2, DL-2) --------

@pytest.mark.parametrize(("field", "value", "words"), [
    ("system_id", 0, "system id"),
    ("timeline", 0, "timeline"),
    ("wal_seg_size", 3, "segment size"),
    ("wal_seg_size", 1 << 31, "segment size"),
    ("wal_seg_size", 1 << 19, "segment size"),
    ("pg_version", 150000, "version"),
    ("pg_version", 0, "version"),
])
def test_a_fresh_safekeeper_is_not_claimed_by_a_nonsense_greeting(field: str, value: int, words: str) -> None:
    a = Acceptor(5, AcceptorState(), 0)
    with pytest.raises(AcceptorError, match=words):
        a.on_greeting(greeting(**{field: value}))
    assert a.state == AcceptorState()


def test_the_simulator_may_lower_the_segment_size_minimum() -> None:
    a = Acceptor(5, AcceptorState(), 0, min_seg_size=1024)
    a.on_greeting(greeting(wal_seg_size=1024))
    assert a.state.wal_seg_size == 1024


@pytest.mark.parametrize("term", [limits.MAX_TERM + 1, 2**64 - 1])
def test_a_vote_request_above_the_term_bound_is_refused(term: int) -> None:
    a = Acceptor(1, configured(term=4, history=h((4, 1000)), commit=1500), 2000)
    before = snapshot(a)
    with pytest.raises(AcceptorError, match="term"):
        a.on_vote(VoteRequest(term), RecordEnd(2000))
    assert snapshot(a) == before


def test_a_vote_at_the_term_bound_is_granted() -> None:
    a = Acceptor(1, configured(term=4), 0)
    assert only_reply(a.on_vote(VoteRequest(limits.MAX_TERM), RecordEnd(0))).granted  # type: ignore[union-attr]


@pytest.mark.parametrize("history", [
    h((3, 100), (2, 200), (5, 1000)),  # terms not ascending
    h((2, 900), (3, 100), (5, 1000)),  # start positions going back
    h((2, 100), (2, 200), (5, 1000)),  # a term twice
    tuple(TermEntry(t, 1000) for t in range(1, limits.MAX_HISTORY + 2)) + h((limits.MAX_HISTORY + 5, 1000)),
])
def test_elected_with_a_poisoned_history_is_refused(history: TermHistory) -> None:
    term = history[-1].term
    a = Acceptor(1, configured(term=term - 1, history=h((1, 100))), 1000)
    a.on_vote(VoteRequest(term), RecordEnd(1000))
    before = snapshot(a)
    with pytest.raises(AcceptorError, match="history"):
        a.on_elected(Elected(term, history[-1].start_lsn, history), RecordEnd(1000))
    assert snapshot(a) == before


def test_elected_outside_the_wal_range_is_refused() -> None:
    # CR-2: Elected(1, 2^64-101) on a fresh safekeeper used to start a store no segment can name.
    a = Acceptor(1, configured(term=0), 0)
    a.on_vote(VoteRequest(1), RecordEnd(0))
    before = snapshot(a)
    start = 2**64 - 101
    with pytest.raises(AcceptorError, match="LSN"):
        a.on_elected(Elected(1, start, h((1, start))), RecordEnd(0))
    assert snapshot(a) == before


def test_an_append_running_past_the_wal_range_is_refused() -> None:
    start = limits.MAX_LSN - 10
    a = elected_acceptor(term=1, start=start)
    before = snapshot(a)
    with pytest.raises(AcceptorError, match="range"):
        a.on_append(Append(1, start, 0, 0, b"x" * 11))
    assert snapshot(a) == before
    assert Write(start, b"x" * 10) in a.on_append(Append(1, start, 0, 0, b"x" * 10))


def test_only_the_connection_that_sent_elected_may_append_in_its_term() -> None:
    # DL-2: a second connection with the right term number changes nothing.
    owner, other = object(), object()
    a = Acceptor(1, configured(term=2), 0)
    a.on_vote(VoteRequest(3), RecordEnd(0))
    a.on_elected(Elected(3, 1000, h((3, 1000))), RecordEnd(0), owner)
    a.on_append(Append(3, 1000, 0, 0, b"abc"), owner)
    before = snapshot(a)
    for data in (b"zzzz", b""):
        with pytest.raises(AcceptorError, match="does not hold the term"):
            a.on_append(Append(3, 1003, 1003, 0, data), other)
        assert snapshot(a) == before
    # A stale term is still answered with the higher term, whoever asks: that fences a proposer.
    a.on_vote(VoteRequest(4), RecordEnd(1003))
    assert only_reply(a.on_append(Append(3, 1003, 0, 0, b"x"), other)) == AppendReply(4, 1000, 0)


def test_the_record_end_is_reused_until_the_wal_changes() -> None:
    # DOS-7: probes reuse one scan; a write or a cut makes it stale, even one during the scan.
    a = elected_acceptor(term=3, start=1000)
    assert a.cached_end() is None
    epoch = a.wal_epoch
    a.remember_end(epoch, RecordEnd(1000))
    assert a.cached_end() == RecordEnd(1000)
    a.on_append(Append(3, 1000, 0, 0, b""))  # a heartbeat writes nothing
    assert a.cached_end() == RecordEnd(1000)
    a.on_append(Append(3, 1000, 0, 0, b"abc"))
    assert a.cached_end() is None
    a.remember_end(epoch, RecordEnd(1003))  # a scan begun before that write
    assert a.cached_end() is None
    a.remember_end(a.wal_epoch, RecordEnd(1003))
    a.on_elected(Elected(3, 1000, h((3, 1000))), RecordEnd(1003))
    assert a.cached_end() is None


# ---- InfoRequest: what this safekeeper is ----------------------------------------------------

def test_info_reports_identity_positions_and_whether_a_proposer_holds_the_term() -> None:
    owner = object()
    a = Acceptor(1, configured(term=2), 0)
    a.on_vote(VoteRequest(3), RecordEnd(0))
    a.on_elected(Elected(3, 1000, h((3, 1000))), RecordEnd(0), owner)
    a.on_append(Append(3, 1000, 0, 0, b"x" * 100), owner)
    a.on_flushed(1100)
    a.on_append(Append(3, 1100, 1100, 0, b""), owner)
    before = snapshot(a)
    assert a.info() == InfoReply(1, SYSID, SEG, PGV, 1, 3, 3, 1100, 1100, True)
    assert snapshot(a) == before
    a.owner = None  # the term's connection closed
    assert a.info().proposer_connected is False
    assert Acceptor(5, AcceptorState(), 0).info() == InfoReply(5, 0, 0, 0, 0, 0, 0, 0, 0, False)


# ---- timelines (protocol version 2) --------------------------------------------------------

PROMOTED = (TimelineEntry(1, 0x3000100),)


def test_elected_with_a_new_timeline_adopts_it_between_the_cut_and_the_save() -> None:
    a = Acceptor(1, configured(term=2, history=h((1, 0x1000000)), commit=0x3000000), 0x3000100)
    a.on_vote(VoteRequest(3), RecordEnd(0x3000100))
    acts = a.on_elected(Elected(3, 0x3000100, h((1, 0x1000000), (3, 0x3000100)), 2, PROMOTED),
                        RecordEnd(0x3000100))
    kinds = [type(x) for x in acts]
    assert kinds == [Truncate, AdoptTimeline, Persist, Reply]
    assert acts[1] == AdoptTimeline(2, PROMOTED)
    saved = acts[2].state  # type: ignore[union-attr]
    assert (saved.timeline, saved.timeline_history) == (2, PROMOTED) == (a.state.timeline, a.state.timeline_history)


def test_elected_on_the_same_timeline_or_naming_none_adopts_nothing() -> None:
    a = Acceptor(1, configured(term=2), 0)
    a.on_vote(VoteRequest(3), RecordEnd(0))
    assert not [x for x in a.on_elected(Elected(3, 1000, h((3, 1000)), 1), RecordEnd(0)) if type(x) is AdoptTimeline]
    a.on_vote(VoteRequest(4), RecordEnd(1000))
    acts = a.on_elected(Elected(4, 1000, h((3, 1000), (4, 1000))), RecordEnd(1000))
    assert not [x for x in acts if type(x) is AdoptTimeline] and a.state.timeline == 1


def test_vote_and_greeting_replies_carry_the_timeline_and_reader_port() -> None:
    a = Acceptor(1, replace(configured(term=2), timeline=2, timeline_history=PROMOTED), 0)
    a.reader_port = 5433
    assert only_reply(a.on_greeting(greeting())) == GreetingReply(1, 2, 5433)
    vote = only_reply(a.on_vote(VoteRequest(3), RecordEnd(0)))
    assert isinstance(vote, VoteReply) and (vote.timeline, vote.timeline_history) == (2, PROMOTED)
    assert a.info().reader_port == 5433 and a.info().timeline == 2


@pytest.mark.parametrize("timeline,history", [
    (2, (TimelineEntry(2, 5),)),  # the history does not lead to the timeline
    (0, (TimelineEntry(1, 5),)),
    (3, (TimelineEntry(2, 5), TimelineEntry(1, 6))),
    (2**32, ()),
], ids=repr)
def test_elected_with_an_impossible_timeline_is_refused_and_changes_nothing(timeline: int, history) -> None:
    a = Acceptor(1, configured(term=2), 0)
    a.on_vote(VoteRequest(3), RecordEnd(0))
    before = snapshot(a)
    with pytest.raises(AcceptorError, match="timeline"):
        a.on_elected(Elected(3, 1000, h((3, 1000)), timeline, history), RecordEnd(0))
    assert snapshot(a) == before


def test_a_protocol_version_1_proposer_is_told_what_to_do() -> None:
    a = Acceptor(1, AcceptorState(), 0)
    with pytest.raises(AcceptorError, match="protocol version 1 is not supported .*same walsidecar release"):
        a.on_greeting(greeting(protocol_version=1))


# ---- an empty data directory: a lost disk, amnesic until the peers' terms are learned --------------

def knows(term: int, members: int = 3) -> PeerTerm:
    """The answer of a peer that did not lose its disk."""
    return PeerTerm(term, members)


AMNESIC_PEER = PeerTerm(0, 3, amnesic=True)


def test_amnesic_acceptor_refuses_vote_and_elected_saying_what_it_waits_for() -> None:
    a = Acceptor(3, AcceptorState(), 0, amnesic=True, listed_members=3)
    # A greeting is answered (a refused one reads as another cluster's) but takes nothing in.
    assert a.on_greeting(greeting()) == [Reply(GreetingReply(3, 0, 0))]
    for call in (lambda: a.on_vote(VoteRequest(5), RecordEnd(0)),
                 lambda: a.on_elected(Elected(5, 0x100, h((5, 0x100))), RecordEnd(0))):
        with pytest.raises(AcceptorError, match="empty data directory.*term of 2 of its 2 peers"):
            call()
    assert a.state == AcceptorState()
    info = a.info()
    assert (info.term, info.amnesic, info.members) == (0, True, 3)  # it still answers what it knows


def test_amnesic_acceptor_waits_for_enough_distinct_peers_then_persists_the_highest_term() -> None:
    a = Acceptor(3, AcceptorState(), 0, amnesic=True, listed_members=3)
    assert a.on_peer_terms({1: knows(9)}) == []
    assert a.on_peer_terms({3: knows(50), 1: knows(9)}) == []  # its own answer is not a peer's
    assert a.amnesic
    actions = a.on_peer_terms({1: knows(9), 2: knows(0)})
    assert actions == [Persist(AcceptorState(term=9, members=3, lost_disk_term=9))] and not a.amnesic
    with pytest.raises(AcceptorError, match="greet it again"):  # a greeting while amnesic took nothing in
        a.on_vote(VoteRequest(10), RecordEnd(0))
    assert a.on_peer_terms({1: knows(99), 2: knows(99)}) == []  # learned once: later answers change nothing


def test_an_amnesic_peers_answer_does_not_count() -> None:
    """Two lost disks at once: neither knows a term, and a term 0 from one must not let the other vote."""
    a = Acceptor(3, AcceptorState(), 0, amnesic=True, listed_members=3)
    assert a.on_peer_terms({1: knows(4), 2: AMNESIC_PEER}) == [] and a.amnesic
    assert a.amnesic_peers == 2
    assert a.on_peer_terms({1: knows(4), 2: knows(5)}) != [] and a.state.term == 5


def test_the_number_of_peers_comes_from_the_membership_not_the_peers_listed() -> None:
    """L-7: --peers lists one address in a 5-member cluster; the peer (and the proposer's greeting) say 5."""
    a = Acceptor(3, AcceptorState(), 0, amnesic=True, listed_members=2)
    assert a.amnesic_peers == 1  # all it knows yet
    assert a.on_peer_terms({1: knows(7, members=5)}) == [] and a.amnesic
    assert (a.members, a.amnesic_peers) == (5, 3)
    b = Acceptor(3, AcceptorState(), 0, amnesic=True, listed_members=2)
    b.on_greeting(greeting(members=5))  # the proposer's --safekeepers
    assert (b.members, b.amnesic_peers) == (5, 3) and b.state == AcceptorState()
    assert b.on_peer_terms({1: knows(7, members=3)}) == []  # a smaller count told later lowers nothing
    assert b.on_peer_terms({1: knows(7), 2: knows(6), 4: knows(8)}) == [
        Persist(AcceptorState(term=8, members=5, lost_disk_term=8))]


def test_without_peers_or_membership_an_amnesic_acceptor_needs_at_least_one_peer() -> None:
    a = Acceptor(3, AcceptorState(), 0, amnesic=True)
    assert a.amnesic_peers == 1 and a.on_peer_terms({}) == [] and a.amnesic


def test_peer_terms_are_checked_before_anything_changes() -> None:
    a = Acceptor(3, AcceptorState(), 0, amnesic=True, listed_members=2)
    with pytest.raises(AcceptorError, match="a peer's term"):
        a.on_peer_terms({1: knows(limits.MAX_TERM + 1)})
    with pytest.raises(AcceptorError, match="a peer's member count"):
        a.on_peer_terms({1: knows(4, members=limits.MAX_MEMBERS + 1)})
    assert a.amnesic and a.state == AcceptorState() and a.members == 2


def test_the_greeting_tells_the_membership_and_it_is_persisted() -> None:
    a = Acceptor(1, AcceptorState(members=3), 0)
    actions = a.on_greeting(greeting(members=5))
    assert Persist(replace(configured(), members=5)) in actions
    assert a.on_greeting(greeting(members=5)) == [Reply(GreetingReply(1, 0, 0))]  # unchanged: nothing saved
    assert a.on_greeting(greeting(members=0)) == [Reply(GreetingReply(1, 0, 0))]  # 0: not told, kept
    assert a.info().members == 5
    with pytest.raises(AcceptorError, match="member count"):
        a.on_greeting(greeting(members=limits.MAX_MEMBERS + 1))


# ---- a lost disk that learned its term votes only once its WAL holds the start of a later term ---------

def learned(term: int = 9) -> Acceptor:
    """Safekeeper 3 after a lost disk: it learned `term` from its peers and was greeted again."""
    a = Acceptor(3, AcceptorState(), 0, amnesic=True, listed_members=3)
    a.on_peer_terms({1: knows(term), 2: knows(term - 1)})
    a.on_greeting(greeting())
    return a


def test_a_learned_lost_disk_promises_a_new_term_without_granting_it() -> None:
    """It may lack a commit it acknowledged before the loss (on {itself, sk2}): a quorum counting it, with a
    peer that lacks the commit too, could elect a donor without it. It promises the term (nothing lower is
    taken) and says why it withheld the vote."""
    a = learned(9)
    vote = only_reply(a.on_vote(VoteRequest(10), RecordEnd(0)))
    assert isinstance(vote, VoteReply) and not vote.granted and (vote.term, vote.lost_disk_term) == (10, 9)
    assert a.state.term == 10 and a.state.lost_disk_term == 9
    assert a.info().lost_disk_term == 9
    vote = only_reply(a.on_vote(VoteRequest(9), RecordEnd(0)))  # below its promise: refused as always
    assert isinstance(vote, VoteReply) and not vote.granted and vote.lost_disk_term == 0


def test_a_learned_lost_disk_takes_elected_and_votes_once_its_wal_holds_a_later_terms_start() -> None:
    a = learned(9)
    a.on_vote(VoteRequest(10), RecordEnd(0))  # promised, withheld: the proposer won with the others
    actions = a.on_elected(Elected(10, 0x5000, h((2, 0x1000), (10, 0x5000))), RecordEnd(0), owner="p")
    assert Truncate(0x1000) in actions  # an empty store starts at the history's first entry
    assert a.recovering_from == 9  # its WAL does not reach term 10's start yet
    a.on_append(Append(10, 0x1000, 0, 0, b"x" * 0x3000), owner="p")
    a.on_flushed(0x4000)
    vote = only_reply(a.on_vote(VoteRequest(11), RecordEnd(0x4000)))
    assert isinstance(vote, VoteReply) and not vote.granted and vote.lost_disk_term == 9
    b = learned(9)
    b.on_vote(VoteRequest(10), RecordEnd(0))
    b.on_elected(Elected(10, 0x5000, h((2, 0x1000), (10, 0x5000))), RecordEnd(0), owner="p")
    b.on_append(Append(10, 0x1000, 0, 0, b"x" * 0x4000), owner="p")
    b.on_flushed(0x5000)
    assert b.recovering_from == 0 and b.info().lost_disk_term == 0
    actions = b.on_vote(VoteRequest(11), RecordEnd(0x5000))
    vote = only_reply(actions)
    assert isinstance(vote, VoteReply) and vote.granted and vote.lost_disk_term == 0
    assert Persist(replace(b.state, term=11, lost_disk_term=0)) in actions and b.state.lost_disk_term == 0


def test_the_rule_survives_a_restart() -> None:
    """What the rule needs is in the control file: reopened before its WAL holds a later term, it still withholds."""
    a = learned(9)
    reopened = Acceptor(3, a.state, 0)
    vote = only_reply(reopened.on_vote(VoteRequest(12), RecordEnd(0)))
    assert isinstance(vote, VoteReply) and not vote.granted and vote.lost_disk_term == 9


def test_a_term_learned_as_zero_means_nothing_was_ever_committed() -> None:
    """No peer that did not lose its disk had promised anything: no term was elected, so nothing can be missing."""
    a = Acceptor(3, AcceptorState(), 0, amnesic=True, listed_members=3)
    a.on_peer_terms({1: knows(0), 2: knows(0)})
    a.on_greeting(greeting())
    vote = only_reply(a.on_vote(VoteRequest(1), RecordEnd(0)))
    assert isinstance(vote, VoteReply) and vote.granted


def test_an_acceptor_with_a_data_directory_is_not_amnesic() -> None:
    a = Acceptor(1, configured(term=4), 0)
    assert not a.amnesic and a.on_peer_terms({2: knows(7), 3: knows(7)}) == []


# ---- degraded ranges (--commit-wait degrade-after) ----------------------------------------------


def test_a_degraded_range_is_persisted_before_the_reply_and_shown_to_clients() -> None:
    a = elected_acceptor(term=3)
    rng = DegradedRange(3, 1000, 1, frozenset({1, 2}))
    actions = a.on_degraded(DegradedRecord(3, rng))
    assert isinstance(actions[0], Persist) and actions[0].state.degraded == rng
    assert actions[1:] == [Reply(DegradedRecordReply(3, 1))]
    assert a.info().degraded == rng and a.info().degrade_term == 3
    cleared = a.on_degraded(DegradedRecord(3, NO_DEGRADED))
    assert isinstance(cleared[0], Persist) and cleared[0].state.degraded == NO_DEGRADED
    # The copy goes; that a degrade-after proposer wrote here stays, for a failover without the broker to see.
    assert not a.info().degraded and a.info().degrade_term == 3
    assert a.on_degraded(DegradedRecord(3, NO_DEGRADED)) == [Reply(DegradedRecordReply(3, 0))]  # nothing to persist


def test_a_degraded_range_only_from_the_connection_holding_the_term() -> None:
    a = elected_acceptor(term=3)
    before = snapshot(a)
    with pytest.raises(AcceptorError, match="does not hold the term"):
        a.on_degraded(DegradedRecord(3, DegradedRange(3, 1000, 1, frozenset({1}))), object())
    assert snapshot(a) == before
    # From an earlier term: nothing is stored, and the reply tells that proposer the term it lost to.
    assert a.on_degraded(DegradedRecord(2, DegradedRange(2, 10, 1, frozenset({1})))) == \
        [Reply(DegradedRecordReply(3, 0))]
    assert snapshot(a) == before


def test_the_append_path_keeps_the_degraded_range() -> None:
    """Appends rebuild the state on their hot path: the stored range must survive them."""
    a = elected_acceptor(term=3)
    rng = DegradedRange(3, 1000, 1, frozenset({1}))
    a.on_degraded(DegradedRecord(3, rng))
    a.on_append(Append(3, 1000, 0, 0, b"x" * 100))
    a.on_flushed(1100)
    a.on_append(Append(3, 1100, 1100, 1100))  # a heartbeat that moves commit_lsn
    assert a.state.commit_lsn == 1100 and a.state.degraded == rng

"""The per-connection acceptor session: greeting first, roles, term ownership, frame caps, scan reuse."""

from __future__ import annotations

import pytest

from sidecar.consensus import codec, limits
from sidecar.consensus.acceptor import Acceptor, AcceptorError, Persist, RecordEnd, Reply, Truncate, Write
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, ElectedReply, Greeting, InfoReply, InfoRequest, Message,
    TermEntry, VoteReply, VoteRequest,
)
from sidecar.consensus.session import AcceptorSession, Role
from sidecar.consensus.state import AcceptorState

SYSID = 7_300_000_000_000_000_001
SEG = 16 * 1024 * 1024
START = 0x1000000
GREETING = Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15)


def fresh() -> Acceptor:
    return Acceptor(1, AcceptorState(), 0)


def snapshot(a: Acceptor) -> tuple[object, ...]:
    return (a.state, a.write_lsn, a.flush_lsn, a.elected_term, a.owner, a.wal_epoch)


def say(s: AcceptorSession, msg: Message, end: RecordEnd | None = None) -> list:
    """What the server does for one message: a scan only if the session asks for one."""
    if s.needs_record_end(msg):
        end = end or RecordEnd(s.acceptor.write_lsn)
    return s.receive(msg, end)


def elected(a: Acceptor, term: int = 1) -> AcceptorSession:
    s = AcceptorSession(a)
    say(s, GREETING)
    say(s, VoteRequest(term))
    acts = say(s, Elected(term, START, (TermEntry(term, START),)))
    assert Truncate(START) in acts and s.holds_term
    return s


def reply(actions: list) -> Message:
    [msg] = [a.message for a in actions if isinstance(a, Reply)]
    return msg


# ---- greeting first, and roles --------------------------------------------------------------

@pytest.mark.parametrize("msg", [VoteRequest(1), VoteRequest(0), Elected(1, START, (TermEntry(1, START),)),
                                 Append(1, START, 0, 0, b"x")])
def test_the_first_message_must_be_a_greeting(msg: Message) -> None:
    a = fresh()
    before = snapshot(a)
    with pytest.raises(AcceptorError, match="first message must be a Greeting"):
        AcceptorSession(a).receive(msg, RecordEnd(0))
    assert snapshot(a) == before


def test_info_is_answered_before_a_greeting_and_changes_nothing() -> None:
    a = fresh()
    s = AcceptorSession(a)
    assert s.receive(InfoRequest()) == [Reply(InfoReply(1, 0, 0, 0, 0, 0, 0, 0, 0, False))]
    assert not s.greeted and snapshot(a) == snapshot(fresh())


@pytest.mark.parametrize("role", [Role.CLIENT, Role.SAFEKEEPER])
def test_a_read_only_role_may_only_ask_for_information(role: Role) -> None:
    a = Acceptor(1, AcceptorState(SYSID, SEG, 15, 1, term=3), 0)
    s = AcceptorSession(a, role)
    before = snapshot(a)
    assert s.receive(InfoRequest()) == [Reply(InfoReply(1, SYSID, SEG, 15, 1, 3, 0, 0, 0, False))]
    for msg in (GREETING, VoteRequest(4), VoteRequest(0), Elected(3, START, (TermEntry(3, START),)),
                Append(3, START, 0, 0, b"x")):
        with pytest.raises(AcceptorError, match=f"a {role.value} connection may only ask for information"):
            s.receive(msg, RecordEnd(0))
        assert not s.needs_record_end(msg)
    assert snapshot(a) == before and s.max_frame == limits.PREAUTH_MAX_FRAME


def test_a_greeting_with_nonsense_does_not_claim_a_fresh_safekeeper() -> None:
    a = fresh()
    s = AcceptorSession(a)
    with pytest.raises(AcceptorError, match="segment size"):
        s.receive(Greeting(PROTOCOL_VERSION, "x", 1, 1, 3, 15))
    assert a.state == AcceptorState() and not s.greeted


# ---- the term belongs to one connection --------------------------------------------------------

def test_only_the_elected_connection_appends_in_the_term() -> None:
    a = fresh()
    s1 = elected(a)
    assert Write(START, b"abc") in say(s1, Append(1, START, 0, 0, b"abc"))
    s2 = AcceptorSession(a)
    say(s2, GREETING)
    before = snapshot(a)
    with pytest.raises(AcceptorError, match="does not hold the term"):
        say(s2, Append(1, START + 3, 0, 0, b"evil"))
    assert snapshot(a) == before and s1.holds_term


def test_an_elected_without_a_vote_request_on_that_connection_is_refused() -> None:
    a = fresh()
    s1 = elected(a)
    say(s1, Append(1, START, 0, 0, b"abc"))
    s2 = AcceptorSession(a)
    say(s2, GREETING)
    before = snapshot(a)
    with pytest.raises(AcceptorError, match="did not ask for a vote"):
        say(s2, Elected(1, START, (TermEntry(1, START),)), RecordEnd(START + 3))
    assert snapshot(a) == before and s1.holds_term


def test_a_reconnecting_proposer_takes_the_term_over_after_asking_for_its_vote() -> None:
    # What the proposer does on a new connection in the same term: Greeting, VoteRequest(T)
    # (answered "not granted, same term"), Elected(T). The old connection is fenced.
    a = fresh()
    s1 = elected(a)
    say(s1, Append(1, START, 0, 0, b"abc"))
    s2 = AcceptorSession(a)
    say(s2, GREETING)
    vote = reply(say(s2, VoteRequest(1), RecordEnd(START + 3)))
    assert isinstance(vote, VoteReply) and not vote.granted and vote.term == 1
    acts = say(s2, Elected(1, START, (TermEntry(1, START),)), RecordEnd(START + 3))
    assert reply(acts) == ElectedReply(1, START + 3)
    assert s2.holds_term and not s1.holds_term
    with pytest.raises(AcceptorError, match="does not hold the term"):
        say(s1, Append(1, START + 3, 0, 0, b"late"))
    s1.closed()  # the old connection going away does not release the new one's term
    assert s2.holds_term
    s2.closed()
    assert a.owner is None
    with pytest.raises(AcceptorError, match="does not hold the term"):
        say(s2, Append(1, START + 3, 0, 0, b"x"))


def test_a_stale_elected_is_answered_with_the_higher_term_on_any_connection() -> None:
    a = fresh()
    elected(a, term=2)
    s = AcceptorSession(a)
    say(s, GREETING)
    assert reply(say(s, Elected(1, START, (TermEntry(1, START),)))) == ElectedReply(2, START)
    assert reply(say(s, Append(1, START, 0, 0, b"x"))) == AppendReply(2, START, 0)


# ---- frame caps -----------------------------------------------------------------------------

def test_frames_grow_only_with_trust() -> None:
    a = fresh()
    s = AcceptorSession(a)
    assert s.max_frame == limits.PREAUTH_MAX_FRAME
    say(s, GREETING)
    assert s.max_frame == limits.CONTROL_MAX_FRAME
    say(s, VoteRequest(1))
    assert s.max_frame == limits.CONTROL_MAX_FRAME
    say(s, Elected(1, START, (TermEntry(1, START),)))
    assert s.max_frame == codec.MAX_FRAME
    other = AcceptorSession(a)
    say(other, GREETING)
    assert other.max_frame == limits.CONTROL_MAX_FRAME
    s.closed()
    assert s.max_frame == limits.CONTROL_MAX_FRAME


# ---- a vote reuses the last scan until the WAL changes (DOS-7) -----------------------------------

def test_probes_reuse_one_scan_until_the_wal_is_written_or_cut() -> None:
    a = Acceptor(1, AcceptorState(SYSID, SEG, 15, 1), 0)
    s = AcceptorSession(a)
    assert not s.needs_record_end(VoteRequest(0))  # not greeted: refused before any scan
    say(s, GREETING)
    assert not s.needs_record_end(GREETING) and not s.needs_record_end(Append(0, 0, 0, 0))
    assert s.needs_record_end(VoteRequest(0))
    first = reply(s.receive(VoteRequest(0), RecordEnd(START, START - 10, 77)))
    scans = 0
    for _ in range(100):
        scans += s.needs_record_end(VoteRequest(0))
        assert reply(s.receive(VoteRequest(0))) == first
    assert scans == 0
    say(s, VoteRequest(1))
    assert not s.needs_record_end(Elected(1, START, (TermEntry(1, START),)))  # still the same WAL
    acts = s.receive(Elected(1, START, (TermEntry(1, START),)))
    assert Truncate(START) in acts and isinstance(acts[1], Persist)
    assert s.needs_record_end(VoteRequest(0))  # the cut made it stale
    s.receive(VoteRequest(0), RecordEnd(START))
    assert not s.needs_record_end(VoteRequest(0))
    say(s, Append(1, START, 0, 0, b"abc"))
    assert s.needs_record_end(VoteRequest(0))  # and so does a write


def test_a_vote_without_a_scan_or_a_cached_one_is_a_caller_bug() -> None:
    s = AcceptorSession(Acceptor(1, AcceptorState(SYSID, SEG, 15, 1), 0))
    say(s, GREETING)
    with pytest.raises(ValueError, match="needs_record_end"):
        s.receive(VoteRequest(1))

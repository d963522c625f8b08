"""--commit-wait degrade-after in the proposer core: record before acknowledging, members, closing, the gate."""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.consensus.degraded import DegradedCarry, gate_problem
from sidecar.consensus.messages import (
    NO_DEGRADED, AppendReply, DegradedRange, DegradedRecord, DegradedRecordReply, ElectedReply, GreetingReply,
    TermEntry, VoteReply, VoteRequest,
)
from sidecar.consensus.proposer import (
    Action, CloseDegraded, DegradeBegan, DegradeEnded, FailoverTerm, GateRefused, Phase, Proposer, ReportStatus,
    Send, StoreDegraded,
)
from tests.support.core import BOOT, config, greet, of, sends, streaming

A, B, C = ord("a"), ord("b"), ord("c")  # node ids: the test greeting replies use ord(name)
T = 30.0


def flushed(actions: Sequence[Action]) -> list[int]:
    return [a.flush_lsn for a in actions if isinstance(a, ReportStatus)]


def degraded_on_a(p: Proposer) -> list[Action]:
    """WAL up to BOOT+300 sent; only `a` flushes it; b and c are gone; T passes: the range opens on a."""
    p.wal_received(BOOT, b"x" * 300)
    p.peer_disconnected("b")
    p.peer_disconnected("c")
    p.peer_message("a", AppendReply(1, BOOT + 100, 0))
    assert p.tick(100.0) == []  # the stall is first seen
    assert p.tick(100.0 + T - 1) == []
    return p.tick(100.0 + T)


def test_nothing_is_acknowledged_above_the_quorum_before_the_range_is_stored_in_the_broker_and_on_every_member() -> None:
    p, _ = streaming(degrade_after=T)
    out = degraded_on_a(p)
    rng = DegradedRange(1, BOOT, 1, frozenset({A}))
    assert of(out, DegradeBegan) and of(out, StoreDegraded) == [StoreDegraded(rng)]
    assert sends(out, DegradedRecord) == [Send("a", DegradedRecord(1, rng))]
    assert p.status()[1] == BOOT and not flushed(out)
    # The safekeeper stored it, the broker not yet: still nothing.
    assert flushed(p.peer_message("a", DegradedRecordReply(1, 1))) == []
    # The broker too: the commit flushed by the member is acknowledged.
    assert flushed(p.degraded_stored(1)) == [BOOT + 100]
    # And further flushes by it as they come.
    assert flushed(p.peer_message("a", AppendReply(1, BOOT + 300, 0))) == [BOOT + 300]


def test_the_broker_first_then_the_member_is_the_same() -> None:
    p, _ = streaming(degrade_after=T)
    degraded_on_a(p)
    assert flushed(p.degraded_stored(1)) == []
    assert flushed(p.peer_message("a", DegradedRecordReply(1, 1))) == [BOOT + 100]


def test_no_degradation_while_the_quorum_moves_or_without_the_option() -> None:
    p, _ = streaming()  # the default: wait
    assert degraded_on_a(p) == [] and p.status()[1] == BOOT
    p, _ = streaming(degrade_after=T)
    p.wal_received(BOOT, b"x" * 300)
    p.tick(0.0)
    p.peer_message("a", AppendReply(1, BOOT + 10, 0))
    p.peer_message("b", AppendReply(1, BOOT + 10, 0))
    assert p.tick(T) == []  # the commit moved at T: the count starts again
    assert p.tick(2 * T - 1) == []


def test_a_member_that_leaves_is_recorded_out_before_the_next_degraded_acknowledgement() -> None:
    p, _ = streaming(degrade_after=T)
    p.wal_received(BOOT, b"x" * 300)
    p.peer_disconnected("c")
    p.peer_message("a", AppendReply(1, BOOT + 100, 0))
    p.peer_message("b", AppendReply(1, BOOT + 50, 0))  # commit = BOOT + 50 on {a, b}
    p.peer_disconnected("b")
    p.tick(0.0)
    out = p.tick(T)
    rng = of(out, StoreDegraded)[0].record
    assert rng.members == {A} and rng.start_lsn == BOOT + 50
    p.peer_message("a", DegradedRecordReply(1, 1))
    assert flushed(p.degraded_stored(1)) == [BOOT + 100]
    out = p.peer_disconnected("a")
    assert of(out, StoreDegraded) == [StoreDegraded(DegradedRange(1, BOOT + 50, 2, frozenset()), rng)]
    assert p.status()[1] == BOOT + 100  # never back
    assert not p.degraded_confirmed


def test_a_safekeeper_joins_once_it_holds_every_degraded_acknowledgement_and_the_range_closes_with_the_quorum() -> None:
    p, _ = streaming(degrade_after=T)
    degraded_on_a(p)
    p.peer_message("a", DegradedRecordReply(1, 1))
    p.degraded_stored(1)
    p.peer_message("a", AppendReply(1, BOOT + 300, 0))
    # b comes back in the term, below the degraded position: not a member yet.
    p.peer_connected("b")
    p.peer_message("b", GreetingReply(B, 1))
    p.peer_message("b", VoteReply(1, False, BOOT, (TermEntry(1, BOOT),), ()))
    out = p.peer_message("b", ElectedReply(1, BOOT))
    assert not of(out, StoreDegraded)
    # It flushes up to BOOT + 300: a quorum holds every degraded acknowledgement; the range closes.
    out = p.peer_message("b", AppendReply(1, BOOT + 300, 0))
    assert of(out, CloseDegraded) == [CloseDegraded(DegradedRange(1, BOOT, 1, frozenset({A})))]
    assert of(out, DegradeEnded)
    assert Send("a", DegradedRecord(1, NO_DEGRADED)) in out and Send("b", DegradedRecord(1, NO_DEGRADED)) in out
    assert not p.degraded and p.open_range() is None


def test_a_joining_safekeeper_is_recorded_before_it_counts() -> None:
    five = ("a", "b", "c", "d", "e")
    p, _ = streaming(five, degrade_after=T)
    p.wal_received(BOOT, b"x" * 300)
    for n in ("b", "c", "d", "e"):
        p.peer_disconnected(n)
    p.tick(0.0)
    p.tick(T)  # a, at BOOT, is the member
    p.peer_message("a", DegradedRecordReply(1, 1))
    p.degraded_stored(1)
    p.peer_message("a", AppendReply(1, BOOT + 200, 0))
    assert p.status()[1] == BOOT + 200
    p.peer_connected("e")
    p.peer_message("e", GreetingReply(ord("e"), 1))
    p.peer_message("e", VoteReply(1, False, BOOT, (TermEntry(1, BOOT),), ()))
    out = p.peer_message("e", ElectedReply(1, BOOT))
    assert not of(out, StoreDegraded)  # below the degraded position: it would not hold every acknowledgement
    out = p.peer_message("e", AppendReply(1, BOOT + 250, 0))  # above it: it joins
    assert of(out, StoreDegraded) == [StoreDegraded(DegradedRange(1, BOOT, 2, frozenset({A, ord("e")})), DegradedRange(1, BOOT, 1, frozenset({A})))]
    p.peer_message("a", AppendReply(1, BOOT + 300, 0))
    assert p.status()[1] == BOOT + 200  # version 2 is not recorded yet
    p.peer_message("a", DegradedRecordReply(1, 2))
    p.peer_message("e", DegradedRecordReply(1, 2))
    assert flushed(p.degraded_stored(2)) == [BOOT + 250]  # the lowest member's flush


def test_the_next_term_carries_the_range_and_closes_it_once_its_quorum_reaches_it() -> None:
    p, _ = streaming(degrade_after=T)
    degraded_on_a(p)
    p.peer_message("a", DegradedRecordReply(1, 1))
    p.degraded_stored(1)
    p.stream_ended()
    carry = p.open_range()
    assert carry == DegradedCarry(DegradedRange(1, BOOT, 1, frozenset({A})), BOOT + 100)
    q, _ = streaming(degrade_after=T, carried=carry)
    assert q.carried == carry
    q.wal_received(BOOT, b"y" * 300)
    q.peer_message("a", AppendReply(1, BOOT + 100, 0))
    out = q.peer_message("b", AppendReply(1, BOOT + 100, 0))
    assert of(out, CloseDegraded) == [CloseDegraded(carry.record)] and q.carried is None


def test_an_inherited_range_blocks_a_new_one_until_closed() -> None:
    carry = DegradedCarry(DegradedRange(1, BOOT, 1, frozenset({A})), BOOT + 1000)
    p, _ = streaming(degrade_after=T, carried=carry)
    assert degraded_on_a(p) == []


def vote(term: int, flush: int, last_term: int) -> VoteReply:
    return VoteReply(term, True, flush, (TermEntry(last_term, BOOT),), ())


def test_the_gate_rule() -> None:
    rng = DegradedRange(3, BOOT, 2, frozenset({A}))
    assert gate_problem(rng, {"b": (B, vote(5, BOOT + 10, 3)), "c": (C, vote(5, BOOT + 10, 3))}, BOOT + 10) \
        .startswith("no voter is a member")
    assert gate_problem(rng, {"a": (A, vote(5, BOOT + 90, 3)), "b": (B, vote(5, BOOT + 10, 3))}, BOOT + 90) is None
    # A member whose WAL a later term wrote over proves nothing.
    assert "later term" in gate_problem(rng, {"a": (A, vote(5, BOOT + 90, 4)), "b": (B, vote(5, BOOT, 3))},
                                        BOOT + 90)
    # A later term's log, shorter than the member's, would become E and cut it.
    assert "below the flush" in gate_problem(
        rng, {"a": (A, vote(5, BOOT + 90, 3)), "b": (B, vote(5, BOOT + 10, 4))}, BOOT + 10)


def failover(gate: DegradedRange) -> Proposer:
    p = Proposer(config(failover=FailoverTerm.END, gate=gate))
    greet(p, {"a": 5, "b": 5, "c": 5})
    return p


def test_a_failover_waits_for_a_members_vote_and_then_closes_the_range_once_e_is_on_a_quorum() -> None:
    rng = DegradedRange(1, BOOT, 1, frozenset({A}))
    p = failover(rng)
    term = p.term
    p.peer_message("b", vote(term, BOOT + 90, 1))
    assert p.peer_message("c", vote(term, BOOT + 90, 1)) == [] and p.phase is Phase.VOTING
    assert "no voter is a member" in (p.gate_waiting or "")
    p.peer_message("a", vote(term, BOOT + 90, 1))
    assert p.phase is Phase.VERIFYING and p.term_start == BOOT + 90
    p.primary_verified()
    out = p.peer_message("a", ElectedReply(term, BOOT + 90))
    assert not of(out, CloseDegraded)
    out = p.peer_message("b", ElectedReply(term, BOOT + 90))  # E on a quorum
    assert of(out, CloseDegraded) == [CloseDegraded(rng)]


def test_a_failover_whose_votes_cannot_cover_the_range_refuses_before_any_elected() -> None:
    rng = DegradedRange(1, BOOT, 1, frozenset({A}))
    p = failover(rng)
    term = p.term
    p.peer_message("a", vote(term, BOOT + 90, 1))
    out = p.peer_message("b", vote(term, BOOT + 10, 2))  # a later term's shorter log would be E
    assert of(out, GateRefused) and p.phase is Phase.STOPPED
    assert not sends(out) and not sends(out, VoteRequest)

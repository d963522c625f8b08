"""The proposer state machine, one PROTOCOL.md rule per test."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from sidecar.consensus import proposer as proposer_mod

from sidecar.consensus.limits import MAX_LSN, MAX_TERM
from sidecar.consensus.messages import (
    Append, AppendReply, Elected, ElectedReply, GreetingReply, VoteReply, VoteRequest,
)
from sidecar.timelines import TimelineEntry
from sidecar.consensus.proposer import (
    Action, Campaign, DropPeer, FetchWal, Phase, Proposer, ReportStatus, Send, StartStreaming,
    TermLost, TermsExhausted, VerifyPrimary,
)

from tests.support.core import BOOT, PEERS, config, grant, greet, h, of, sends, streaming


def appends_to(actions: Sequence[Action], peer: str) -> list[Append]:
    return [s.message for s in sends(actions, Append) if s.peer == peer]  # type: ignore[misc]


# ---- election ---------------------------------------------------------------------------------

def test_campaign_waits_for_a_quorum_of_greetings() -> None:
    p = Proposer(config())
    out = greet(p, {"a": 3})
    assert not sends(out, VoteRequest)
    assert p.phase is Phase.GREETING
    out = greet(p, {"b": 5})
    votes = sends(out, VoteRequest)
    assert {s.peer for s in votes} == {"a", "b"}
    assert all(s.message == VoteRequest(6) for s in votes)
    assert p.phase is Phase.VOTING and p.term == 6


def test_campaign_term_is_above_min_term() -> None:
    p = Proposer(config(), min_term=10)
    out = greet(p, {"a": 3, "b": 5})
    assert {s.message for s in sends(out, VoteRequest)} == {VoteRequest(11)}
    p2 = Proposer(config(), min_term=2)
    out = greet(p2, {"a": 3, "b": 5})
    assert {s.message for s in sends(out, VoteRequest)} == {VoteRequest(6)}


def test_late_greeting_during_voting_gets_a_vote_request() -> None:
    p = Proposer(config())
    greet(p, {"a": 1, "b": 1})
    out = greet(p, {"c": 0})
    assert [(s.peer, s.message) for s in sends(out, VoteRequest)] == [("c", VoteRequest(2))]


def test_elected_by_a_quorum_of_grants_only() -> None:
    p = Proposer(config())
    greet(p, {"a": 0, "b": 0, "c": 0})
    assert not of(p.peer_message("a", grant(1)), VerifyPrimary)
    # A refusal at the same term does not count.
    refused = VoteReply(1, False, 0, (), ())
    assert not of(p.peer_message("b", refused), VerifyPrimary)
    assert p.phase is Phase.VOTING
    assert of(p.peer_message("c", grant(1)), VerifyPrimary)
    assert p.phase is Phase.VERIFYING


def test_a_vote_withheld_by_a_lost_disk_is_logged_not_counted_and_the_peer_joins_the_term() -> None:
    """A safekeeper that lost its disk promises our term without granting it: we say so, win with the others,
    and send it Elected so that it is caught up in our term."""
    p = Proposer(config())
    out = greet(p, {"a": 0, "b": 0, "c": 0})
    assert Send("a", proposer_mod.Greeting(proposer_mod.PROTOCOL_VERSION, "p1", 42, 1, 16 * 1024 * 1024, 16, 3)) \
        in p.peer_connected("a") and sends(out, VoteRequest)
    greet(p, {"a": 0})
    withheld = VoteReply(1, False, 0, (), (), lost_disk_term=7)
    out = p.peer_message("a", withheld)
    assert of(out, proposer_mod.VoteWithheld) == [proposer_mod.VoteWithheld("a", 1, 7)]
    assert proposer_mod.VoteWithheld.level == "warning"
    assert not of(p.peer_message("b", grant(1)), VerifyPrimary) and p.phase is Phase.VOTING
    assert of(p.peer_message("c", grant(1)), VerifyPrimary)
    out = p.primary_verified()
    assert {s.peer for s in sends(out, Elected)} == {"a", "b", "c"}
    assert of(p.peer_message("a", ElectedReply(1, BOOT)), proposer_mod.PeerJoined)


def test_a_lost_disk_reconnecting_while_streaming_withholds_its_vote_and_is_sent_elected() -> None:
    p, _ = streaming()
    p.peer_disconnected("c")
    out = p.peer_connected("c") + p.peer_message("c", GreetingReply(ord("c"), 0))
    assert [s.message for s in sends(out, VoteRequest)] == [VoteRequest(1)]
    out = p.peer_message("c", VoteReply(1, False, 0, (), (), lost_disk_term=1))
    assert of(out, proposer_mod.VoteWithheld) and [s.peer for s in sends(out, Elected)] == ["c"]
    assert p.phase is Phase.STREAMING and p.term == 1


def test_higher_term_vote_reply_restarts_the_campaign_above_it() -> None:
    p = Proposer(config())
    greet(p, {"a": 0, "b": 0, "c": 0})
    p.peer_message("a", grant(1))
    out = p.peer_message("b", VoteReply(7, False, 0, (), ()))
    assert p.phase is Phase.VOTING and p.term == 8
    assert {s.message for s in sends(out, VoteRequest)} == {VoteRequest(8)}
    assert {s.peer for s in sends(out, VoteRequest)} == set(PEERS)
    # The old grant no longer counts: one grant for term 8 is not a quorum.
    assert not of(p.peer_message("a", grant(1)), VerifyPrimary)
    assert not of(p.peer_message("a", grant(8)), VerifyPrimary)
    assert of(p.peer_message("c", grant(8)), VerifyPrimary)
    assert p.term == 8


def test_election_timeout_campaigns_one_term_higher() -> None:
    p = Proposer(config())
    greet(p, {"a": 2, "b": 2})
    out = p.election_timeout()
    assert p.term == 4
    assert {s.message for s in sends(out, VoteRequest)} == {VoteRequest(4)}


def test_donor_newer_term_beats_longer_log() -> None:
    p = Proposer(config())
    greet(p, {"a": 3, "b": 3, "c": 3})
    long_stale = grant(4, 9000, h((1, 100), (2, 500)))
    short_new = VoteReply(4, True, 700, h((1, 100), (3, 600)), (), tail_lsn=650, tail_crc=99)
    p.peer_message("a", long_stale)
    out = p.peer_message("b", short_new)
    [verify] = of(out, VerifyPrimary)
    assert (verify.term, verify.start_lsn, verify.donor) == (4, 700, "b")
    assert (verify.tail_lsn, verify.tail_crc) == (650, 99)
    assert p.term_start == 700
    assert p.history == h((1, 100), (3, 600), (4, 700))


def test_donor_same_last_term_longest_log_wins_and_history_is_cut_at_e() -> None:
    p = Proposer(config())
    greet(p, {"a": 3, "b": 3, "c": 3})
    # The donor's history may name terms above its flush position: they are cut at E.
    p.peer_message("a", grant(4, 800, h((1, 100), (2, 500))))
    p.peer_message("b", grant(4, 650, h((1, 100), (2, 500))))
    out = p.peer_message("c", grant(4, 900, h((1, 100), (2, 500))))
    assert not of(out, VerifyPrimary)  # already elected by a and b
    assert p.term_start == 800
    assert p.history == h((1, 100), (2, 500), (4, 800))


def test_bootstrap_when_every_voter_is_empty() -> None:
    p = Proposer(config())
    greet(p, {"a": 0, "b": 0})
    p.peer_message("a", grant(1))
    out = p.peer_message("b", grant(1))
    [verify] = of(out, VerifyPrimary)
    assert verify.start_lsn == BOOT
    assert p.history == h((1, BOOT))


def test_nothing_streams_before_the_primary_is_verified() -> None:
    p = Proposer(config())
    greet(p, {"a": 0, "b": 0})
    p.peer_message("a", grant(1))
    out = p.peer_message("b", grant(1))
    assert not sends(out, Elected) and not of(out, StartStreaming)
    out = p.primary_verified()
    assert of(out, StartStreaming) == [StartStreaming(BOOT)]
    assert {(s.peer, s.message) for s in sends(out, Elected)} == {
        ("a", Elected(1, BOOT, h((1, BOOT)), 1)), ("b", Elected(1, BOOT, h((1, BOOT)), 1))}


def test_primary_refused_stops_the_proposer() -> None:
    p = Proposer(config())
    greet(p, {"a": 0, "b": 0})
    p.peer_message("a", grant(1))
    p.peer_message("b", grant(1))
    p.primary_refused("the primary lacks quorum-committed WAL")
    assert p.phase is Phase.STOPPED
    assert p.primary_verified() == []
    assert p.peer_message("a", ElectedReply(1, BOOT)) == []


# ---- higher terms while elected -----------------------------------------------------------

@pytest.mark.parametrize("reply", [AppendReply(5, BOOT, 0), ElectedReply(5, BOOT),
                                   VoteReply(5, False, BOOT, (), ())])
def test_higher_term_while_streaming_loses_the_term(reply: object) -> None:
    p, _ = streaming()
    out = p.peer_message("b", reply)  # type: ignore[arg-type]
    [lost] = of(out, TermLost)
    assert lost.term == 5
    assert p.phase is Phase.STOPPED
    assert p.heartbeat() == []
    assert p.peer_message("a", AppendReply(1, BOOT, 0)) == []


def test_higher_term_greeting_from_a_reconnecting_safekeeper_loses_the_term() -> None:
    p, _ = streaming()
    p.peer_disconnected("c")
    p.peer_connected("c")
    out = p.peer_message("c", GreetingReply(3, 9))
    assert [x.term for x in of(out, TermLost)] == [9]
    assert p.phase is Phase.STOPPED


def test_reconnecting_safekeeper_is_sent_elected_again() -> None:
    p, _ = streaming()
    p.wal_received(BOOT, b"w" * 100)
    p.peer_message("c", AppendReply(1, BOOT + 40, 0))
    p.peer_disconnected("c")
    out = p.peer_connected("c")
    out = p.peer_message("c", GreetingReply(3, 1))
    assert [(s.peer, s.message) for s in sends(out)] == [("c", VoteRequest(1))]
    out = p.peer_message("c", VoteReply(1, False, BOOT + 40, h((1, BOOT)), ()))
    assert [(s.peer, s.message) for s in sends(out)] == [("c", Elected(1, BOOT, h((1, BOOT)), 1))]
    out = p.peer_message("c", ElectedReply(1, BOOT + 40))
    [app] = appends_to(out, "c")
    assert (app.begin_lsn, app.data) == (BOOT + 40, b"w" * 60)


def test_no_appends_to_a_peer_before_its_elected_reply() -> None:
    p = Proposer(config())
    greet(p, {"a": 0, "b": 0, "c": 0})
    p.peer_message("a", grant(1))
    p.peer_message("b", grant(1))
    p.primary_verified()
    out = p.wal_received(BOOT, b"abc")
    assert not sends(out, Append)
    out = p.peer_message("a", ElectedReply(1, BOOT))
    assert [(m.begin_lsn, m.data) for m in appends_to(out, "a")] == [(BOOT, b"abc")]
    assert appends_to(out, "b") == []


# ---- streaming ---------------------------------------------------------------------------

def test_appends_carry_the_term_and_are_contiguous_per_peer() -> None:
    p, _ = streaming()
    out: list[Action] = []
    lsn = BOOT
    for size in (10, 1, 300, 7):
        out += p.wal_received(lsn, bytes([size % 256]) * size)
        lsn += size
    for peer in PEERS:
        apps = appends_to(out, peer)
        assert all(a.term == 1 for a in apps)
        pos = BOOT
        for a in apps:
            assert a.begin_lsn == pos
            pos = a.end_lsn
        assert pos == lsn


def test_inflight_window_is_respected() -> None:
    p, _ = streaming(max_inflight=100)
    out: list[Action] = []
    lsn = BOOT
    for _ in range(50):
        out += p.wal_received(lsn, b"z" * 10)
        lsn += 10
    apps = appends_to(out, "a")
    assert apps, "nothing was sent"
    # No Append starts at or past max_inflight beyond the acknowledged flush.
    assert all(a.begin_lsn < BOOT + 100 for a in apps)
    sent = apps[-1].end_lsn
    assert sent - BOOT >= 100
    # An acknowledgement opens the window by what it acknowledged, and no more.
    out = p.peer_message("a", AppendReply(1, BOOT + 50, 0))
    more = appends_to(out, "a")
    assert more and more[0].begin_lsn == sent
    assert all(a.begin_lsn < BOOT + 150 for a in more)
    assert more[-1].end_lsn >= BOOT + 150


def test_commit_counts_only_positions_at_or_above_the_term_start() -> None:
    p = Proposer(config())
    greet(p, {"a": 1, "b": 1, "c": 1})
    # a is the donor at 1000 (term 1); b and c lag in term 1.
    p.peer_message("a", grant(2, 1000, h((1, 100))))
    p.peer_message("b", grant(2, 600, h((1, 100))))
    p.peer_message("c", grant(2, 700, h((1, 100))))
    assert p.term_start == 1000
    out = p.primary_verified()
    out += p.peer_message("b", ElectedReply(2, 600))
    out += p.peer_message("c", ElectedReply(2, 700))
    # Two safekeepers hold term 1's WAL up to 600/700: nothing is committed (or even
    # counted as written) in term 2.
    assert p.commit_lsn == 0
    assert of(out, ReportStatus) == []
    out = p.peer_message("a", ElectedReply(2, 1000))
    assert p.commit_lsn == 0  # only one safekeeper holds the term start
    assert of(out, ReportStatus) == [ReportStatus(1000, 0, 0)]
    p.wal_received(1000, b"q" * 500)
    out = p.peer_message("a", AppendReply(2, 1500, 0))
    assert p.commit_lsn == 0
    out = p.catchup_data("b", 600, b"q" * 400) + p.catchup_done("b")
    out = p.peer_message("b", AppendReply(2, 1200, 0))
    assert p.commit_lsn == 1200
    assert of(out, ReportStatus)[-1].flush_lsn == 1200


def test_report_status_write_max_flush_commit_apply_min() -> None:
    p, out = streaming()
    assert of(out, ReportStatus)[-1] == ReportStatus(BOOT, BOOT, BOOT)
    p.wal_received(BOOT, b"x" * 1000)
    out = p.peer_message("a", AppendReply(1, BOOT + 900, 0))
    # Only one safekeeper has it: write moves, commit does not.
    assert of(out, ReportStatus) == [ReportStatus(BOOT + 900, BOOT, BOOT)]
    out = p.peer_message("b", AppendReply(1, BOOT + 500, 0))
    assert of(out, ReportStatus) == [ReportStatus(BOOT + 900, BOOT + 500, BOOT)]
    out = p.peer_message("c", AppendReply(1, BOOT + 300, 0))
    assert of(out, ReportStatus) == [ReportStatus(BOOT + 900, BOOT + 500, BOOT + 300)]
    # Nothing moved: no report.
    assert of(p.peer_message("c", AppendReply(1, BOOT + 300, 0)), ReportStatus) == []
    out = p.peer_message("c", AppendReply(1, BOOT + 1000, 0))
    assert of(out, ReportStatus) == [ReportStatus(BOOT + 1000, BOOT + 900, BOOT + 500)]


def test_apply_waits_for_every_safekeeper_even_a_missing_one() -> None:
    p = Proposer(config())
    greet(p, {"a": 0, "b": 0})
    p.peer_message("a", grant(1))
    p.peer_message("b", grant(1))
    p.primary_verified()
    p.peer_message("a", ElectedReply(1, BOOT))
    p.peer_message("b", ElectedReply(1, BOOT))
    p.wal_received(BOOT, b"x" * 100)
    p.peer_message("a", AppendReply(1, BOOT + 100, 0))
    out = p.peer_message("b", AppendReply(1, BOOT + 100, 0))
    write, flush, apply = p.status()
    assert (write, flush) == (BOOT + 100, BOOT + 100)
    assert apply < BOOT  # c never joined this term
    assert of(out, ReportStatus)[-1] == ReportStatus(write, flush, apply)


def test_commit_never_decreases_within_a_term() -> None:
    p, _ = streaming()
    p.wal_received(BOOT, b"x" * 1000)
    p.peer_message("a", AppendReply(1, BOOT + 800, 0))
    p.peer_message("b", AppendReply(1, BOOT + 800, 0))
    assert p.commit_lsn == BOOT + 800
    # b reconnects and re-joins at a lower position (it answers Elected with its flush).
    p.peer_disconnected("b")
    p.peer_connected("b")
    p.peer_message("b", GreetingReply(2, 1))
    p.peer_message("b", VoteReply(1, False, BOOT + 800, h((1, BOOT)), ()))
    p.peer_disconnected("a")
    out = p.peer_message("b", ElectedReply(1, BOOT + 800))
    assert p.commit_lsn == BOOT + 800
    assert all(r.flush_lsn >= BOOT + 800 for r in of(out, ReportStatus))
    # Acknowledgements below the committed position never pull it back.
    out = p.peer_message("c", AppendReply(1, BOOT + 100, 0))
    assert p.commit_lsn == BOOT + 800
    reports = [r.flush_lsn for r in of(out, ReportStatus)]
    assert all(f >= BOOT + 800 for f in reports)


def test_commit_does_not_follow_a_safekeeper_that_rejoins_lower() -> None:
    p, _ = streaming()
    p.wal_received(BOOT, b"x" * 1000)
    p.peer_message("a", AppendReply(1, BOOT + 800, 0))
    p.peer_message("b", AppendReply(1, BOOT + 800, 0))
    p.peer_message("c", AppendReply(1, BOOT + 100, 0))
    assert p.commit_lsn == BOOT + 800
    p.peer_disconnected("b")
    p.peer_connected("b")
    p.peer_message("b", GreetingReply(2, 1))
    p.peer_message("b", VoteReply(1, False, BOOT + 300, h((1, BOOT)), ()))
    out = p.peer_message("b", ElectedReply(1, BOOT + 300))
    assert p.commit_lsn == BOOT + 800
    assert all(r.flush_lsn == BOOT + 800 for r in of(out, ReportStatus))
    # It is fed again from where it says it is.
    assert appends_to(out, "b")[0].begin_lsn == BOOT + 300


def test_appends_carry_commit_and_heartbeat_reaches_idle_peers() -> None:
    p, _ = streaming()
    p.wal_received(BOOT, b"x" * 100)
    p.peer_message("a", AppendReply(1, BOOT + 100, 0))
    p.peer_message("b", AppendReply(1, BOOT + 100, 0))
    out = p.heartbeat()
    beats = {s.peer: s.message for s in sends(out, Append)}
    assert set(beats) == set(PEERS)
    for peer, m in beats.items():
        assert isinstance(m, Append) and m.data == b"" and m.commit_lsn == BOOT + 100
        assert m.begin_lsn == BOOT + 100


def test_fetch_wal_for_a_safekeeper_below_the_buffer_start() -> None:
    p = Proposer(config())
    greet(p, {"a": 1, "b": 1, "c": 1})
    p.peer_message("a", grant(2, 5000, h((1, 100))))
    p.peer_message("b", grant(2, 5000, h((1, 100))))
    p.primary_verified()
    p.peer_message("a", ElectedReply(2, 5000))
    p.wal_received(5000, b"n" * 100)
    p.peer_message("c", grant(2, 3000, h((1, 100))))
    out = p.peer_message("c", ElectedReply(2, 3000))
    assert of(out, FetchWal) == [FetchWal("c", 3000, 5000)]
    assert appends_to(out, "c") == []
    # Heartbeats skip it while it catches up.
    assert "c" not in {s.peer for s in sends(p.heartbeat())}
    out = p.catchup_data("c", 3000, b"o" * 1200)
    assert [(m.begin_lsn, len(m.data), m.term) for m in appends_to(out, "c")] == [(3000, 1200, 2)]
    assert p.catchup_data("c", 3000, b"o" * 10) == []  # not where it left off
    out = p.catchup_data("c", 4200, b"o" * 800) + p.catchup_done("c")
    assert [(m.begin_lsn, m.end_lsn) for m in appends_to(out, "c")] == [(4200, 5000), (5000, 5100)]
    assert not of(out, FetchWal)


def test_buffer_trimmed_once_every_safekeeper_has_flushed() -> None:
    p, _ = streaming()
    for i in range(10):
        p.wal_received(BOOT + i * 100, b"x" * 100)
    buf = p.buffer
    assert buf is not None
    p.peer_message("a", AppendReply(1, BOOT + 1000, 0))
    p.peer_message("b", AppendReply(1, BOOT + 1000, 0))
    assert buf.start == BOOT  # c still needs everything
    p.peer_message("c", AppendReply(1, BOOT + 450, 0))
    assert BOOT + 400 == buf.start  # the chunk holding c's flush stays
    p.peer_message("c", AppendReply(1, BOOT + 1000, 0))
    assert buf.start == buf.end == BOOT + 1000


def test_disconnected_in_term_peer_keeps_its_wal_in_the_buffer() -> None:
    p, _ = streaming()
    for i in range(10):
        p.wal_received(BOOT + i * 100, b"x" * 100)
    p.peer_message("c", AppendReply(1, BOOT + 200, 0))
    p.peer_disconnected("c")
    p.peer_message("a", AppendReply(1, BOOT + 1000, 0))
    p.peer_message("b", AppendReply(1, BOOT + 1000, 0))
    assert p.buffer is not None and p.buffer.start == BOOT + 200


def test_buffer_limit_trims_and_a_lagging_peer_fetches() -> None:
    p, _ = streaming(buffer_limit=300, max_inflight=1 << 30)
    for i in range(10):
        p.wal_received(BOOT + i * 100, b"x" * 100)
    p.peer_message("a", AppendReply(1, BOOT + 1000, 0))
    out = p.peer_message("b", AppendReply(1, BOOT + 1000, 0))
    assert p.buffer is not None and p.buffer.start == BOOT + 700
    p.peer_disconnected("c")
    p.peer_connected("c")
    p.peer_message("c", GreetingReply(3, 1))
    p.peer_message("c", VoteReply(1, False, BOOT, h((1, BOOT)), ()))
    out = p.peer_message("c", ElectedReply(1, BOOT))
    assert of(out, FetchWal) == [FetchWal("c", BOOT, BOOT + 700)]


# ---- the pre-vote probe -----------------------------------------------------------------------

def probe_reply(term: int, flush: int = 0, tail: tuple[int, int] = (0, 0)) -> VoteReply:
    return VoteReply(term=term, granted=False, flush_lsn=flush, term_history=h((1, BOOT)) if flush else (),
                     timeline_history=(), tail_lsn=tail[0], tail_crc=tail[1])


def probed(p: Proposer, flush: int = 0, tail: tuple[int, int] = (0, 0)) -> list[Action]:
    out: list[Action] = []
    for n in PEERS:
        out += p.peer_connected(n)
        out += p.peer_message(n, GreetingReply(ord(n), 1))
    for n in PEERS:
        out += p.peer_message(n, probe_reply(1, flush, tail))
    return out


def test_a_quorum_of_greetings_starts_a_probe_that_promises_nothing() -> None:
    p = Proposer(config())
    out = greet_only(p, ("a", "b"))
    assert {s.message for s in sends(out, VoteRequest)} == {VoteRequest(0)}
    assert p.phase is Phase.PROBING and p.term == 0


def greet_only(p: Proposer, names: tuple[str, ...]) -> list[Action]:
    out: list[Action] = []
    for n in names:
        out += p.peer_connected(n)
        out += p.peer_message(n, GreetingReply(ord(n), 1))
    return out


def test_a_primary_refused_by_the_probe_never_sees_a_campaign() -> None:
    p = Proposer(config())
    out = probed(p, flush=BOOT + 500, tail=(BOOT + 100, 77))
    [check] = of(out, VerifyPrimary)
    assert (check.start_lsn, check.tail_lsn, check.tail_crc) == (BOOT + 500, BOOT + 100, 77)
    assert p.phase is Phase.PRECHECK
    out = p.primary_refused("stale primary")
    assert p.phase is Phase.STOPPED
    assert not [s for s in sends(out, VoteRequest) if s.message.term > 0]
    # Late replies change nothing either.
    assert not sends(p.peer_message("a", probe_reply(1)), VoteRequest)


def test_an_election_on_the_probed_log_skips_the_second_check() -> None:
    p = Proposer(config())
    probed(p, flush=BOOT + 500, tail=(BOOT + 100, 77))
    out = p.primary_verified()
    assert {s.message for s in sends(out, VoteRequest)} == {VoteRequest(2)}
    vote = VoteReply(2, True, BOOT + 500, h((1, BOOT)), (), BOOT + 100, 77)
    out = p.peer_message("a", vote) + p.peer_message("b", vote)
    assert not of(out, VerifyPrimary)
    assert of(out, StartStreaming) == [StartStreaming(BOOT + 500)]
    assert p.phase is Phase.STREAMING


def test_an_election_on_a_different_log_checks_the_primary_again() -> None:
    p = Proposer(config())
    probed(p, flush=BOOT + 500, tail=(BOOT + 100, 77))
    p.primary_verified()
    moved = VoteReply(2, True, BOOT + 900, h((1, BOOT)), (), BOOT + 600, 78)
    out = p.peer_message("a", moved) + p.peer_message("b", moved)
    [check] = of(out, VerifyPrimary)
    assert (check.term, check.start_lsn) == (2, BOOT + 900)
    assert p.phase is Phase.VERIFYING and not of(out, StartStreaming)


def test_a_precheck_that_outlives_every_connection_still_campaigns() -> None:
    # Found by the simulation: every peer disconnected while the primary was being checked.
    p = Proposer(config())
    probed(p, flush=BOOT + 500, tail=(BOOT + 100, 77))
    for n in PEERS:
        p.peer_disconnected(n)
    assert p.primary_verified() == [Campaign(1)]
    assert p.phase is Phase.VOTING
    out = p.peer_connected("a") + p.peer_message("a", GreetingReply(1, 3))
    assert sends(out, VoteRequest)[-1].message == VoteRequest(4)  # a higher term restarts the campaign


# ---- trust no reported position ---------------------------------------------------------------

def rejoin(p: Proposer, name: str, vote: VoteReply) -> list[Action]:
    """`name` reconnects while the proposer streams, votes with `vote` and is sent Elected."""
    p.peer_disconnected(name)
    out = p.peer_connected(name) + p.peer_message(name, GreetingReply(ord(name), p.term))
    out += p.peer_message(name, vote)
    assert sends(out, Elected)
    return out


def test_an_append_reply_above_what_was_sent_drops_the_link_and_counts_nothing() -> None:
    p, _ = streaming()
    p.wal_received(BOOT, b"x" * 100_000)
    assert p.peers["a"].sent_lsn == BOOT + 100_000
    p.peer_message("a", AppendReply(1, BOOT + 100_000, 0))  # honest
    before = (p.commit_lsn, p.status())
    out = p.peer_message("b", AppendReply(1, 0x9000000, 0))  # flush beyond anything it was sent
    [drop] = of(out, DropPeer)
    assert drop.peer == "b" and "never sent" in drop.reason
    assert drop.fields == {"term": 1, "flush_lsn": 0x9000000, "sent_lsn": BOOT + 100_000}
    assert (p.commit_lsn, p.status()) == before and not of(out, ReportStatus)
    # Until it reconnects, nothing more from it counts; then it joins afresh.
    assert p.peer_message("b", AppendReply(1, BOOT + 100_000, 0)) == []
    assert p.commit_lsn == before[0]
    out = rejoin(p, "b", VoteReply(1, False, BOOT + 100_000, h((1, BOOT)), ()))
    out = p.peer_message("b", ElectedReply(1, BOOT + 100_000))
    assert not of(out, DropPeer) and p.commit_lsn == BOOT + 100_000


def test_an_elected_reply_above_the_voted_flush_drops_the_link() -> None:
    p = Proposer(config())
    greet(p, {"a": 1, "b": 1, "c": 1})
    p.peer_message("a", grant(2, 5000, h((1, 100))))
    p.peer_message("b", grant(2, 5000, h((1, 100))))
    p.peer_message("c", grant(2, 3000, h((1, 100))))
    p.primary_verified()
    assert not of(p.peer_message("a", ElectedReply(2, 5000)), DropPeer)
    out = p.peer_message("c", ElectedReply(2, 0x7000000))
    [drop] = of(out, DropPeer)
    assert drop.peer == "c" and drop.fields["flush_lsn"] == 0x7000000 and drop.fields["voted_flush_lsn"] == 3000
    assert not p.peers["c"].elected and p.peers["c"].flush_lsn == 0 and not sends(out, Append)
    assert p.peer_message("c", ElectedReply(2, 3000)) == []  # ignored until it reconnects


def test_an_elected_reply_past_the_term_start_with_a_stale_log_drops_the_link() -> None:
    # c voted with a longer log of an older term: it must cut back to where our term starts.
    p = Proposer(config())
    greet(p, {"a": 2, "b": 2, "c": 2})
    p.peer_message("a", grant(3, 5000, h((1, 100), (2, 4000))))
    p.peer_message("c", grant(3, 9000, h((1, 100))))
    p.peer_message("b", grant(3, 5000, h((1, 100), (2, 4000))))
    p.primary_verified()
    assert p.term_start == 5000
    [drop] = of(p.peer_message("c", ElectedReply(3, 9000)), DropPeer)
    assert drop.fields["term_start_lsn"] == 5000
    p.peer_disconnected("c")
    rejoin(p, "c", VoteReply(3, False, 9000, h((1, 100)), ()))
    assert not of(p.peer_message("c", ElectedReply(3, 4000)), DropPeer)


def test_a_safekeeper_of_this_term_may_rejoin_with_wal_sent_on_its_last_connection() -> None:
    # Found by the simulation: Appends of the old connection arrive after the new vote.
    p, _ = streaming()
    p.wal_received(BOOT, b"x" * 500)
    rejoin(p, "c", VoteReply(1, False, BOOT + 100, h((1, BOOT)), ()))
    assert not of(p.peer_message("c", ElectedReply(1, BOOT + 500)), DropPeer)
    rejoin(p, "c", VoteReply(1, False, BOOT + 100, h((1, BOOT)), ()))
    assert of(p.peer_message("c", ElectedReply(1, BOOT + 501)), DropPeer)


def test_a_granted_vote_whose_history_holds_the_term_is_a_protocol_error_not_a_crash() -> None:
    p = Proposer(config())
    greet(p, {"a": 1, "b": 1, "c": 1})
    assert p.term == 2
    out = p.peer_message("a", grant(2, 5000, h((1, 100), (9, 200))))  # audit DOS-4: term 9 >= 2
    [drop] = of(out, DropPeer)
    assert drop.peer == "a" and "term 9" in drop.reason
    out = p.peer_message("b", grant(2, 5000, h((2, 100))))  # the very term it grants
    assert of(out, DropPeer) and p.phase is Phase.VOTING
    p.peer_message("c", grant(2, 5000, h((1, 100))))
    for n in ("a", "b"):
        rejoin_vote = p.peer_connected(n) + p.peer_message(n, GreetingReply(ord(n), 2))
        assert sends(rejoin_vote, VoteRequest)
    out = p.peer_message("a", grant(2, 5000, h((1, 100))))
    assert of(out, VerifyPrimary) and p.history == h((1, 100), (2, 5000))


@pytest.mark.parametrize("reply", [
    GreetingReply(1, MAX_TERM + 1),
    VoteReply(MAX_TERM + 1, False, 0, (), ()),
    VoteReply(1, False, MAX_LSN + 1, (), ()),
    VoteReply(1, False, 10, h((1, 5), (1, 6)), ()),
    VoteReply(1, False, 10, (), (TimelineEntry(2, 5), TimelineEntry(1, 6))),
    ElectedReply(MAX_TERM + 1, 0),
    ElectedReply(1, MAX_LSN + 1),
    AppendReply(MAX_TERM + 1, 0, 0),
    AppendReply(1, MAX_LSN + 1, 0),
    AppendReply(1, 0, MAX_LSN + 1),
], ids=repr)
def test_a_reply_outside_the_limits_is_a_protocol_error_and_adopts_nothing(reply: object) -> None:
    p, _ = streaming()
    out = p.peer_message("a", reply)  # type: ignore[arg-type]
    [drop] = of(out, DropPeer)
    assert drop.peer == "a" and not of(out, TermLost)
    assert p.phase is Phase.STREAMING and p.term == 1 and not p.peers["a"].connected


# ---- terms are bounded ------------------------------------------------------------------------

def test_no_campaign_above_the_highest_term() -> None:
    p = Proposer(config())
    out = greet(p, {"a": MAX_TERM - 1, "b": 3})
    assert {s.message for s in sends(out, VoteRequest)} == {VoteRequest(MAX_TERM)}
    out = p.election_timeout()
    assert out == [TermsExhausted(MAX_TERM - 1, "a")] and p.phase is Phase.STOPPED

    p = Proposer(config())
    out = greet(p, {"a": MAX_TERM, "b": 3})
    assert of(out, TermsExhausted) == [TermsExhausted(MAX_TERM, "a")]
    assert not [s for s in sends(out, VoteRequest) if s.message.term]
    assert p.phase is Phase.STOPPED
    assert p.peer_message("b", GreetingReply(2, 3)) == []  # stopped: nothing loops

    p = Proposer(config(), min_term=MAX_TERM)
    assert of(greet(p, {"a": 1, "b": 1}), TermsExhausted) == [TermsExhausted(MAX_TERM, None)]


def test_a_higher_term_while_voting_at_the_top_stops() -> None:
    p = Proposer(config())
    greet(p, {"a": 1, "b": 1})
    out = p.peer_message("a", VoteReply(MAX_TERM, False, 0, (), ()))
    assert out == [TermsExhausted(MAX_TERM, "a")]


# ---- the WAL buffer is bounded ------------------------------------------------------------------

MiB = 1024 * 1024


def test_the_buffer_stays_bounded_when_no_safekeeper_answers() -> None:
    p, _ = streaming(buffer_limit=64 * MiB)
    chunk = bytes(MiB)
    fetches: list[FetchWal] = []
    for i in range(200):
        fetches += of(p.wal_received(BOOT + i * MiB, chunk), FetchWal)
        assert p.buffer is not None and p.buffer.size <= 64 * MiB
    assert (p.buffer.start, p.buffer.end) == (BOOT + 136 * MiB, BOOT + 200 * MiB)
    # Each safekeeper was sent its in-flight window, then left behind: it reads the primary next.
    assert sorted(fetches, key=lambda f: f.peer) == [FetchWal(n, BOOT + 32 * MiB, BOOT + 33 * MiB) for n in PEERS]
    # With every link down the same holds.
    for n in PEERS:
        p.peer_disconnected(n)
    for i in range(200, 250):
        assert p.wal_received(BOOT + i * MiB, chunk) == []
    assert p.buffer.size <= 64 * MiB and p.phase is Phase.STREAMING


def test_a_peer_overtaken_mid_send_fetches_until_it_reaches_the_buffer() -> None:
    p, _ = streaming(buffer_limit=300, max_inflight=150)

    def receive(lsn: int, data: bytes) -> list[Action]:
        """WAL arrives; a and b acknowledge all they were sent, c stays silent."""
        out = p.wal_received(lsn, data)
        for n in ("a", "b"):
            out += p.peer_message(n, AppendReply(1, p.peers[n].sent_lsn, 0))
        return out

    receive(BOOT, b"a" * 100)
    receive(BOOT + 100, b"b" * 100)
    assert p.peers["c"].sent_lsn == BOOT + 200  # its in-flight window, not acknowledged
    out: list[Action] = []
    for i in range(2, 6):
        out += receive(BOOT + i * 100, bytes([i]) * 100)
    assert p.buffer is not None and p.buffer.start == BOOT + 300
    assert not of(out, FetchWal)  # its window is full: nothing to send it yet
    out = p.peer_message("c", AppendReply(1, BOOT + 100, 0))
    assert of(out, FetchWal) == [FetchWal("c", BOOT + 200, BOOT + 300)]
    # WAL keeps coming while c catches up: the buffer moves on past its fetch.
    out = receive(BOOT + 600, b"g" * 100) + receive(BOOT + 700, b"h" * 100)
    assert p.buffer.start == BOOT + 500 and not of(out, FetchWal) and not appends_to(out, "c")
    out = p.catchup_data("c", BOOT + 200, b"b" * 100) + p.catchup_done("c")
    assert [(m.begin_lsn, m.end_lsn) for m in appends_to(out, "c")] == [(BOOT + 200, BOOT + 300)]
    assert of(out, FetchWal) == [FetchWal("c", BOOT + 300, BOOT + 500)]
    out = p.catchup_data("c", BOOT + 300, b"x" * 200) + p.catchup_done("c")
    assert [(m.begin_lsn, m.end_lsn) for m in appends_to(out, "c")] == [(BOOT + 300, BOOT + 500)]
    # Acknowledged: it is fed from the buffer again, within its window.
    out = p.peer_message("c", AppendReply(1, BOOT + 500, 0))
    assert [(m.begin_lsn, m.end_lsn) for m in appends_to(out, "c")] == [(BOOT + 500, BOOT + 800)]
    assert not of(out, FetchWal) and not of(out, DropPeer)


# ---- teeth: without the caps, the simulator's lying safekeepers break durability ----------------

def test_trusting_a_lying_safekeeper_is_caught_by_the_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.sim import hostile
    from sidecar.sim.runner import first_violation

    if not hasattr(hostile.Hostile, "lie"):
        pytest.skip("this simulator has no lying safekeepers")
    monkeypatch.setattr(proposer_mod.Proposer, "_append_cap", lambda self, p: MAX_LSN)
    monkeypatch.setattr(proposer_mod.Proposer, "_elected_cap", lambda self, p, vote: MAX_LSN)
    out = first_violation(range(60))
    assert out is not None, "no violation in 60 seeds"
    assert out.invariant.startswith(("1 ", "2 ", "4 ")), out.invariant

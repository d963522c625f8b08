"""A failover is final (consensus/lineage.py): the fence a failover's term sets, and what it refuses after."""

from __future__ import annotations

import pytest

from sidecar.consensus import lineage
from sidecar.consensus.acceptor import Acceptor, AcceptorError, Persist, RecordEnd, Reply
from sidecar.consensus.messages import (
    NO_FENCE, Append, Elected, GreetingReply, TermEntry, TimelineFence, VoteReply, VoteRequest,
)
from sidecar.consensus.proposer import (
    FailoverTerm, LineageEnded, Phase, Proposer, ProposerConfig, Send, VerifyPrimary,
)
from sidecar.consensus.state import AcceptorState
from sidecar.timelines import TimelineEntry

SYSID = 7_300_000_000_000_000_001
SEG = 16 << 20
E = 0x3000000
FENCE = TimelineFence(term=5, timeline=1, lsn=E)


def acceptor(term: int = 4, fence: TimelineFence = NO_FENCE) -> Acceptor:
    return Acceptor(1, AcceptorState(system_id=SYSID, wal_seg_size=SEG, pg_version=15, timeline=1, term=term,
                                     term_history=(TermEntry(1, 0x1000000),), commit_lsn=E, fence=fence), E)


def elect(a: Acceptor, term: int, timeline: int = 1, history: tuple[TimelineEntry, ...] = (),
          fence: TimelineFence = NO_FENCE) -> list:  # type: ignore[type-arg]
    a.on_vote(VoteRequest(term), RecordEnd(E))
    return a.on_elected(Elected(term, E, (TermEntry(1, 0x1000000), TermEntry(term, E)), timeline, history, fence),
                        RecordEnd(E), owner=term)


def test_a_failovers_elected_sets_the_fence_and_persists_it_before_the_reply() -> None:
    a = acceptor()
    acts = elect(a, 5, fence=FENCE)
    persist = next(i for i, x in enumerate(acts) if isinstance(x, Persist))
    assert acts[persist].state.fence == FENCE and a.state.fence == FENCE
    assert persist < next(i for i, x in enumerate(acts) if isinstance(x, Reply))


def test_the_old_primarys_timeline_is_refused_in_every_later_term() -> None:
    a = acceptor(term=5, fence=FENCE)
    before = a.state
    with pytest.raises(AcceptorError, match="ended timeline 1 at 0/3000000"):
        elect(a, 6, timeline=1)
    assert a.state.term == 6 and a.state.term_history == before.term_history  # the promise only; no Elected applied


def test_a_timeline_that_left_below_e_is_refused_and_the_promoted_one_passes() -> None:
    with pytest.raises(AcceptorError, match="does not descend"):
        elect(acceptor(term=5, fence=FENCE), 6, timeline=2, history=(TimelineEntry(1, E - 1),))
    a = acceptor(term=5, fence=FENCE)
    elect(a, 6, timeline=2, history=(TimelineEntry(1, E),))
    assert a.elected_term == 6 and a.state.fence == FENCE  # carried on


def test_a_fence_carried_by_the_elected_counts_where_the_safekeeper_had_none() -> None:
    with pytest.raises(AcceptorError, match="ended timeline 1"):
        elect(acceptor(term=5), 6, timeline=1, fence=FENCE)


def test_a_failovers_term_streams_nothing_past_its_start() -> None:
    a = acceptor()
    elect(a, 5, fence=FENCE)
    a.on_append(Append(5, E, E, 0, b""), owner=5)  # a heartbeat is fine
    with pytest.raises(AcceptorError, match="a failover's term"):
        a.on_append(Append(5, E, E, 0, b"x" * 10), owner=5)


def test_a_failover_run_again_on_the_same_timeline_and_its_undo_are_allowed() -> None:
    a = acceptor(term=5, fence=FENCE)
    again = TimelineFence(6, 1, E)
    elect(a, 6, timeline=1, fence=again)
    assert a.state.fence == again
    elect(a, 7, timeline=0, fence=TimelineFence(7))  # the undo names no timeline
    assert a.state.fence == TimelineFence(7)
    elect(a, 8, timeline=1)  # the old primary's sidecar streams again
    assert a.elected_term == 8


def test_the_vote_reports_the_fence() -> None:
    reply = next(x.message for x in acceptor(term=5, fence=FENCE).on_vote(VoteRequest(6), RecordEnd(E))
                 if isinstance(x, Reply))
    assert isinstance(reply, VoteReply) and reply.fence == FENCE


def test_latest_is_by_term_and_fenced_out_names_the_way_back() -> None:
    assert lineage.latest(FENCE, TimelineFence(7), NO_FENCE) == TimelineFence(7)
    assert lineage.fenced_out(NO_FENCE, 1, ()) is None
    assert "pg_rewind" in (lineage.fenced_out(FENCE, 1, ()) or "")
    assert lineage.fenced_out(FENCE, 3, (TimelineEntry(1, E), TimelineEntry(2, E + 8))) is None


def config(failover: FailoverTerm = FailoverTerm.NONE, timeline: int = 1) -> ProposerConfig:
    return ProposerConfig(proposer_id="p", peers=("a", "b", "c"), quorum=2, system_id=SYSID, timeline=timeline,
                          wal_seg_size=SEG, pg_version=15, bootstrap_lsn=0x1000000, failover=failover)


def probed(core: Proposer, fence: TimelineFence) -> list:  # type: ignore[type-arg]
    out = []
    for name in ("a", "b"):
        core.peer_connected(name)
        out += core.peer_message(name, GreetingReply(1, 5))
    for name in ("a", "b"):
        out += core.peer_message(name, VoteReply(5, False, E, (TermEntry(5, E),), (), E - 8, 1, 1, fence))
    return out


def test_the_old_primarys_sidecar_stops_at_the_probe_before_any_promise() -> None:
    core = Proposer(config())
    acts = probed(core, FENCE)
    assert [type(x) for x in acts if not isinstance(x, Send)][-1] is LineageEnded
    assert core.phase is Phase.STOPPED
    assert not any(isinstance(x, Send) and isinstance(x.message, VoteRequest) and x.message.term for x in acts)


def test_a_failovers_own_term_is_not_stopped_and_sets_the_fence_at_its_start() -> None:
    core = Proposer(config(FailoverTerm.END))
    acts = probed(core, FENCE)
    assert any(isinstance(x, VerifyPrimary) for x in acts)
    core.primary_verified()
    for name in ("a", "b"):
        core.peer_message(name, VoteReply(core.term, True, E, (TermEntry(5, E),), (), E - 8, 1, 1, FENCE))
    assert core.fence == TimelineFence(core.term, 1, E)

"""Driving the proposer core in unit tests: a config, greetings, votes, a streaming term."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sidecar.consensus.messages import ElectedReply, GreetingReply, TermEntry, TermHistory, VoteReply, VoteRequest
from sidecar.consensus.proposer import Action, Phase, Proposer, ProposerConfig, Send

PEERS = ("a", "b", "c")
BOOT = 0x1000000


def h(*pairs: tuple[int, int]) -> TermHistory:
    return tuple(TermEntry(t, s) for t, s in pairs)


def config(peers: tuple[str, ...] = PEERS, **kw: Any) -> ProposerConfig:
    return ProposerConfig(proposer_id="p1", peers=peers, quorum=len(peers) // 2 + 1,
                          system_id=42, timeline=1, wal_seg_size=16 * 1024 * 1024, pg_version=16,
                          bootstrap_lsn=BOOT, **kw)


def sends(actions: Sequence[Action], kind: type | None = None) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and (kind is None or isinstance(a.message, kind))]


def of(actions: Sequence[Action], kind: type) -> list:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, kind)]


# A probe answer whose fingerprint no vote in these tests carries, so that the election
# after it must verify the primary again (the probe-skip case has a test of its own).
PROBED = dict(flush_lsn=0, term_history=(), timeline_history=(), tail_lsn=1, tail_crc=0xDEAD)


def greet(p: Proposer, terms: dict[str, int]) -> list[Action]:
    """Greet, answer the pre-vote probes and pass the pre-check: the proposer then campaigns."""
    out: list[Action] = []
    for name, term in terms.items():
        out += p.peer_connected(name)
        out += p.peer_message(name, GreetingReply(ord(name), term))
    for s in sends(out, VoteRequest):
        if s.message == VoteRequest(0) and p.phase is Phase.PROBING:
            out += p.peer_message(s.peer, VoteReply(term=terms.get(s.peer, 0), granted=False, **PROBED))
    if p.phase is Phase.PRECHECK:
        out += p.primary_verified()
    return [a for a in out if not (isinstance(a, Send) and a.message == VoteRequest(0))]


def grant(term: int, flush: int = 0, history: TermHistory = ()) -> VoteReply:
    return VoteReply(term=term, granted=True, flush_lsn=flush, term_history=history, timeline_history=())


def streaming(peers: tuple[str, ...] = PEERS, **kw: Any) -> tuple[Proposer, list[Action]]:
    """A proposer elected for term 1 from empty safekeepers, streaming, every peer joined at BOOT."""
    p = Proposer(config(peers, **kw))
    greet(p, {n: 0 for n in peers})
    for n in peers:
        p.peer_message(n, grant(1))
    out = p.primary_verified()
    for n in peers:
        out += p.peer_message(n, ElectedReply(1, BOOT))
    assert p.phase is Phase.STREAMING and p.term == 1
    return p, out

"""An empty data directory learns its term from its peers before this safekeeper votes (--peers).

A safekeeper that lost its disk has forgotten the terms it promised; voting again in one of them
could give two proposers the same term. Opened on an empty directory with --peers, its acceptor is
amnesic (`Acceptor.amnesic_peers`): this task asks every peer's proposer port for its term (the
read-only, link-authenticated InfoRequest) until N-Q+1 distinct peers answered, then hands their
terms to the acceptor, which persists the highest and votes from then on.

An amnesic peer answers term 0, and that answer counts: with one lost disk at a time, every quorum
this safekeeper voted in still holds a peer that remembers the term, and a brand-new cluster, all
empty, thus starts at once once every member is up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from sidecar.consensus.acceptor import Acceptor, AcceptorAction, AcceptorError
from sidecar.linkauth import Security
from sidecar.logs import get_logger
from sidecar.skclient import ProbeError, probe_safekeeper

# Seconds between rounds of questions while too few peers answered: short at first, as the members
# of a brand-new cluster start within moments of each other, then a second.
RETRY_MIN, RETRY_MAX = 0.05, 1.0
TIMEOUT = 3.0  # seconds one peer has to answer


class TermLearner:
    """Asks the peers for their terms until the acceptor has learned its own."""

    def __init__(self, acceptor: Acceptor, peers: Sequence[str], security: Security,
                 transition: Callable[[Callable[[], list[AcceptorAction]]], Awaitable[list[AcceptorAction]]]) -> None:
        self.acceptor = acceptor
        self.peers = tuple(peers)
        self.security = security
        # Runs an acceptor transition under the server's acceptor lock and carries out its actions.
        self.transition = transition
        self.log = get_logger(node=acceptor.node_id)
        self.terms: dict[int, int] = {}  # node id -> the highest term it answered
        self.answered: dict[str, int] = {}  # peer address -> its node id

    @property
    def waiting_for(self) -> list[str]:
        """The peers that have not answered yet."""
        return [p for p in self.peers if p not in self.answered]

    async def run(self) -> None:
        """Ask, round after round, until the acceptor learned its term; returns at once if it is not amnesic."""
        acc = self.acceptor
        rounds = 0
        while acc.amnesic:
            await asyncio.gather(*(self._ask(p) for p in self.waiting_for))
            terms = dict(self.terms)
            try:
                actions = await self.transition(lambda: acc.on_peer_terms(terms))
            except AcceptorError as e:  # a term out of range: ask everyone again
                self.log.warning("a peer told an impossible term; asking again", reason=str(e))
                self.terms.clear()
                self.answered.clear()
                actions = []
            if actions:
                self.log.info("learned the term from the peers; voting from now on", term=acc.state.term,
                              peer_terms={str(k): v for k, v in sorted(self.terms.items())})
                return
            rounds += 1
            if rounds & (rounds - 1) == 0:  # the 1st, 2nd, 4th, 8th... round: said, not repeated every second
                self.log.warning("empty data directory: not voting until enough peers tell their term",
                                 needed=acc.amnesic_peers, answered=sorted(self.answered),
                                 waiting_for=self.waiting_for, rounds=rounds)
            await asyncio.sleep(min(RETRY_MIN * 2 ** (rounds - 1), RETRY_MAX))

    async def _ask(self, peer: str) -> None:
        try:
            info = await probe_safekeeper(peer, TIMEOUT, self.security)
        except ProbeError as e:
            self.log.debug("peer did not tell its term", peer=peer, reason=str(e))
            return
        if info.node_id <= 0 or info.node_id == self.acceptor.node_id:
            self.log.warning("a --peers address answered with this safekeeper's id or none; not counted",
                             peer=peer, peer_id=info.node_id)
            return
        self.answered[peer] = info.node_id
        self.terms[info.node_id] = max(self.terms.get(info.node_id, 0), info.term)
        self.log.info("peer told its term", peer=peer, peer_id=info.node_id, peer_term=info.term)


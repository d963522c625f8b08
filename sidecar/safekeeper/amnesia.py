"""An empty data directory (a lost disk) learns its term from its peers before this safekeeper votes (--peers).

A safekeeper that lost its disk has forgotten the terms it promised; voting again in one of them
could give two proposers the same term. A new cluster's safekeepers are created with a control file
(create.py), so an empty directory is always a lost disk, and its acceptor is amnesic
(`Acceptor.amnesic`): this task asks every peer's proposer port for its term (the read-only,
link-authenticated InfoRequest) until N-Q+1 distinct peers that did not lose their disk answered, N
the cluster's size as the peers, the proposer's greeting and --peers tell it; then the acceptor
persists the highest term and, once its WAL holds the start of a later term, votes again.

An amnesic peer's answer does not count (it knows no term): two lost disks at once wait for each other
until one of them has learned, which needs another member, and the log says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from sidecar.consensus.acceptor import Acceptor, AcceptorAction, AcceptorError, PeerTerm
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
        self.terms: dict[int, PeerTerm] = {}  # node id -> its answer (the highest term it told)
        self.answered: dict[str, int] = {}  # peer address -> its node id, once it answered knowing its term
        self.amnesic_peers: dict[str, int] = {}  # peer address -> node id of a peer that lost its disk too
        self._short_list_said = False

    @property
    def waiting_for(self) -> list[str]:
        """The peers that have not answered knowing their term yet (an amnesic one is asked again)."""
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
                self.log.info("learned the term from the peers; no vote until the WAL holds the start of a later "
                              "term (it is caught up meanwhile)", term=acc.state.term, members=acc.members,
                              peer_terms={str(k): v.term for k, v in sorted(self.terms.items()) if not v.amnesic})
                return
            if acc.members > len(self.peers) + 1 and not self._short_list_said:
                self._short_list_said = True
                self.log.error("--peers lists fewer safekeepers than the cluster has: this one needs the term of "
                               f"{acc.amnesic_peers} of the {acc.members - 1} others and can ask only "
                               f"{len(self.peers)}; list every other safekeeper", members=acc.members,
                               peers=list(self.peers), needed=acc.amnesic_peers)
            rounds += 1
            if rounds & (rounds - 1) == 0:  # the 1st, 2nd, 4th, 8th... round: said, not repeated every second
                self.log.warning("empty data directory (a lost disk): not voting until enough peers that did not "
                                 "lose theirs tell their term", needed=acc.amnesic_peers, members=acc.members,
                                 answered=sorted(self.answered), amnesic=sorted(self.amnesic_peers),
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
        before = self.terms.get(info.node_id)
        if info.amnesic:
            self.amnesic_peers[peer] = info.node_id
            self.terms[info.node_id] = PeerTerm(0, max(info.members, before.members if before else 0), True)
            self.log.info("peer lost its disk too and knows no term yet; asking it again", peer=peer,
                          peer_id=info.node_id, members=info.members)
            return
        self.amnesic_peers.pop(peer, None)
        self.answered[peer] = info.node_id
        term = max(info.term, before.term if before is not None and not before.amnesic else 0)
        self.terms[info.node_id] = PeerTerm(term, info.members, False)
        self.log.info("peer told its term", peer=peer, peer_id=info.node_id, peer_term=info.term,
                      members=info.members)


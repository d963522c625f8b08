"""Hostile peers: connections that belong to no proposer and try to take a term or cut committed
WAL, and safekeeper replies claiming flushes that were never made."""

from __future__ import annotations

from sidecar.consensus import history as hist
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, ElectedReply, Greeting, InfoRequest, Message, TermEntry,
    VoteRequest,
)
from sidecar.consensus.proposer import Phase
from sidecar.consensus.session import Role
from sidecar.sim.context import Context
from sidecar.sim.network import Network
from sidecar.sim.nodes import Service
from sidecar.sim.profile import SYSTEM_ID
from sidecar.sim.safekeepers import Safekeepers
from sidecar.sim.wal import BOOT, encode_record, record_end

ROGUE = "rogue"  # sender of the hostile connections that belong to no proposer


class Hostile:
    """Rogue connections to the safekeepers and lying replies to the services."""

    def __init__(self, ctx: Context, net: Network, safekeepers: Safekeepers, services: list[Service]) -> None:
        self.ctx = ctx
        self.net = net
        self.safekeepers = safekeepers
        self.services = services

    def rogue(self) -> bool:
        """A connection that belongs to no proposer tries to take the current term or cut committed WAL.

        It knows everything a reader of InfoRequest knows and more (the exact write position), and
        speaks in one burst; the session must refuse it before anything changes.
        """
        ctx, rng = self.ctx, self.ctx.rng
        cands = [sk for sk in self.safekeepers.nodes if sk.acceptor is not None and sk.acceptor.state.system_id]
        if not cands:
            return False
        sk = rng.choice(cands)
        acc = sk.acceptor
        assert acc is not None
        s, kind = acc.state, rng.choice(("append", "elect", "cut", "read-only"))
        greeting = Greeting(PROTOCOL_VERSION, ROGUE, SYSTEM_ID, s.timeline, s.wal_seg_size, s.pg_version)
        term = s.term
        role = Role.PROPOSER
        if kind == "append":  # claim the elected term without its Elected: bytes after ours
            if not acc.elected_term or acc.elected_term != term:
                return False
            junk = encode_record(acc.write_lsn, acc.write_lsn, rng.randbytes(rng.randint(1, 40)))
            msgs: list[Message] = [greeting, Append(term, acc.write_lsn, acc.write_lsn, 0, junk)]
        elif kind == "elect":  # claim the term without asking for a vote on this connection
            if not s.term_history or s.term_history[-1].term != term:
                return False
            last = s.term_history[-1]
            msgs = [greeting, Elected(term, last.start_lsn, s.term_history)]
        elif kind == "cut":  # a same-term vote request, then an Elected that cuts below commit
            flush = record_end(sk.disk, sk.disk.end, fingerprint=False).flush_lsn
            below = min(s.commit_lsn, flush)
            if not term or below <= BOOT:
                return False
            low = rng.randint(BOOT, below - 1)
            rogue_history = (TermEntry(term, low),)
            try:
                if hist.divergence_point(s.term_history, flush, rogue_history) >= below:
                    return False
            except hist.HistoryError:
                return False
            msgs = [greeting, VoteRequest(term), Elected(term, low, rogue_history)]
        else:  # a read-only (client) certificate trying to vote
            role = Role.CLIENT
            msgs = [InfoRequest(), VoteRequest(term + 1)]
        ctx.count(f"rogue connections ({kind})")
        c = self.net.open(ROGUE, ROGUE, None, sk, role)
        ctx.event(c.label, "rogue connection", kind)
        for msg in msgs:
            ctx.delivered(c.label, True, msg)
            if not self.safekeepers.receive(c, msg):
                ctx.count(f"rogue connections refused ({kind})")
                return True
            if sk.acceptor is None:  # a crash between two actions closed it
                ctx.count(f"rogue connections cut short by a crash ({kind})")
                return True
        self.net.close_sk_end(c)
        return True

    def lie(self) -> bool:
        """A safekeeper reply claiming a flush it cannot hold: above what it was sent, or voted with."""
        cands = [(svc, c) for svc in self.services if svc.core is not None
                 and svc.core.phase is Phase.STREAMING
                 for c in svc.links.values() if c is not None and c.carries_replies]
        if not cands:
            return False
        svc, c = self.ctx.rng.choice(cands)
        core = svc.core
        assert core is not None
        p = core.peers[c.sk.name]
        # Far above anything the proposer can have sent by the time the lie arrives: a lie within
        # what was sent (an fsync claimed but not done) is beyond any proposer's power to detect.
        extra = (1 << 40) + self.ctx.rng.randint(1, 4000)
        if p.elected:
            lie: Message = AppendReply(core.term, p.sent_lsn + extra, core.commit_lsn)
        elif p.vote is not None:
            lie = ElectedReply(core.term, max(p.vote.flush_lsn, core.term_start) + extra)
        else:
            return False
        self.ctx.count("lying safekeeper replies")
        self.ctx.event(c.label, "safekeeper lies", lie)
        c.to_prop.append(lie)
        return True

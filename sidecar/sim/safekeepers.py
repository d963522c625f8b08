"""The simulated safekeeper processes: every connection through the real `AcceptorSession`, the
acceptor's actions carried out against a simulated disk, group fsyncs, crashes and restarts."""

from __future__ import annotations

from dataclasses import replace

from sidecar.consensus.acceptor import (
    Acceptor, AcceptorAction, AcceptorError, AdoptTimeline, Persist, RecordEnd, Reply, Truncate, Write,
)
from sidecar.consensus.messages import Append, Elected, Message, Refusal, VoteRequest
from sidecar.sim.checker import Checker
from sidecar.sim.context import Context
from sidecar.sim.network import Network
from sidecar.sim.nodes import Connection, SimSafekeeper
from sidecar.sim.trace import pos
from sidecar.sim.wal import record_end

MIN_SEG_SIZE = 1024  # the simulator's tiny segments are below PostgreSQL's 1 MiB minimum


class Safekeepers:
    """What server.py does around the acceptor, for every simulated safekeeper."""

    def __init__(self, ctx: Context, checker: Checker, net: Network, nodes: list[SimSafekeeper]) -> None:
        self.ctx = ctx
        self.checker = checker
        self.net = net
        self.nodes = nodes
        for sk in nodes:
            sk.acceptor = Acceptor(sk.node_id, sk.persisted, 0, MIN_SEG_SIZE)

    def receive(self, c: Connection, msg: Message) -> bool:
        """The server's `_connection` loop body: the session decides, then its actions run in order."""
        sk, session = c.sk, c.session
        acc = session.acceptor
        try:
            end = self._flushed_record_end(sk) if session.needs_record_end(msg) else None
            actions = session.receive(msg, end)
        except AcceptorError as e:
            self.ctx.event(sk.name, "refuses", c.label, str(e))
            self.ctx.count("refusals by safekeepers")
            if c.carries_replies:
                c.to_prop.append(Refusal(str(e)))
            self.net.close_sk_end(c)
            return False
        if end is None and type(msg) in (VoteRequest, Elected):
            self.ctx.count("scans reused by a vote or Elected")
        if type(msg) is Append and msg.term == acc.elected_term and msg.term >= acc.state.term:
            self.checker.accepted(sk, msg.term, c.sender, "Append")
        elif type(msg) is Elected and any(isinstance(a, Truncate) for a in actions):
            self.checker.accepted(sk, msg.term, c.sender, "Elected")
        self._execute(sk, c, actions)
        return True

    def _flushed_record_end(self, sk: SimSafekeeper) -> RecordEnd:
        assert sk.acceptor is not None
        if sk.disk.start is None:
            return RecordEnd(0)
        sk.disk.fsync()
        sk.changed()
        self.checker.durable(sk)
        return record_end(sk.disk, sk.disk.end)

    def _execute(self, sk: SimSafekeeper, c: Connection | None, actions: list[AcceptorAction]) -> None:
        ctx, profile = self.ctx, self.ctx.profile
        for a in actions:
            if profile.mid_crash and not ctx.scripted and ctx.rng.random() < profile.mid_crash:
                ctx.event(sk.name, "dies before", type(a).__name__)
                self.crash(sk)
                return
            match a:
                case Write():
                    assert sk.acceptor is not None
                    self.checker.wrote(sk, sk.acceptor.elected_term)
                    sk.disk.write(a.lsn, a.data)
                case Persist():
                    sk.persisted = a.state
                    self.checker.durable(sk)
                case Truncate():
                    ctx.event(sk.name, "truncates at", a.lsn)
                    sk.truncations.append(a.lsn)
                    sk.disk.truncate(a.lsn)
                case AdoptTimeline():
                    # Segment names and .history files: the disk model stores bytes by position only.
                    ctx.event(sk.name, "follows timeline", a.timeline)
                    ctx.count("timelines adopted by safekeepers")
                case Reply():
                    self.checker.replied(sk, a.message)
                    if c is not None and c.carries_replies:
                        c.to_prop.append(a.message)
                case _:
                    raise AssertionError(f"the simulator does not know the action {a!r}")
            sk.changed()

    def crash(self, sk: SimSafekeeper) -> None:
        for c in list(sk.conns):
            self.net.close_sk_end(c)
        sk.acceptor = None
        kept, junk = sk.disk.crash(self.ctx.rng)
        sk.changed()
        self.ctx.count("safekeeper crashes")
        if kept or junk:
            self.ctx.count("torn safekeeper tails")
        self.ctx.event(sk.name, "crashes", f"kept={kept}", f"junk={junk}", f"end={pos(sk.disk.end)}")

    # ---- scheduled events ------------------------------------------------------------------------

    def deliver(self) -> bool:
        """A message reaches a safekeeper that is up."""
        cands = [c for sk in self.nodes if sk.acceptor is not None for c in sk.conns
                 if c.to_sk and (c.svc is None or self.net.reachable(c.svc, sk))]
        c = self.net.pick(cands)
        if c is None:
            return False
        msg = c.to_sk.popleft()
        self.ctx.delivered(c.label, True, msg)
        self.receive(c, msg)
        return True

    def fsync(self) -> bool:
        cands = [sk for sk in self.nodes if sk.acceptor is not None and sk.disk.durable < sk.disk.end]
        if not cands:
            return False
        sk = self.ctx.rng.choice(cands)
        acc = sk.acceptor
        assert acc is not None
        if sk.disk.durable >= acc.write_lsn:
            return False  # the flusher only runs for WAL the acceptor handed over
        flushed = sk.disk.fsync()
        sk.changed()
        self.checker.durable(sk)
        self.ctx.event(sk.name, "fsync", flushed)
        if sk.stream is not None:
            self._execute(sk, sk.stream, acc.on_flushed(flushed))
        return True

    def crash_one(self) -> bool:
        up = [sk for sk in self.nodes if sk.acceptor is not None]
        if not up:
            return False
        self.crash(self.ctx.rng.choice(up))
        return True

    def restart_one(self) -> bool:
        down = [sk for sk in self.nodes if sk.acceptor is None]
        if not down:
            return False
        sk = self.ctx.rng.choice(down)
        state, write_lsn = sk.persisted, 0
        if state.wal_seg_size:
            end = record_end(sk.disk, sk.disk.end).flush_lsn
            if end:
                sk.disk.truncate(end)
            write_lsn = end
            if state.commit_lsn > end:  # startup._commit_within: WAL lost in a crash takes commit_lsn down
                state = sk.persisted = replace(state, commit_lsn=end,
                                               peer_horizon_lsn=min(state.peer_horizon_lsn, end))
        sk.acceptor = Acceptor(sk.node_id, state, write_lsn, MIN_SEG_SIZE)
        sk.changed()
        self.checker.durable(sk)
        self.ctx.event(sk.name, "restarts", f"term={state.term}", f"flush={pos(write_lsn)}")
        return True

"""The simulated safekeeper processes: every connection through the real `AcceptorSession`, the
acceptor's actions carried out against a simulated disk, group fsyncs, crashes and restarts.

Each connection is served as the real safekeeper's thread for it serves it (proposerport.py,
server.py `converse`), one step per piece that runs under the acceptor lock or outside it:

- receive a message and carry out its actions, writes included (under the lock); a vote or an
  Elected flushes and scans in the same step (the one-step rule, docs/protocol.md invariant 3);
- for the elected proposer's Appends, ask the real `GroupCommit`; reading on while it says
  LATER (input is already here), else a sync is due:
- fdatasync (outside the lock);
- take the lock, `on_flushed` and reply, if the connection still holds the term.

The scheduler interleaves any other connection's steps between them: after the write, after
the fdatasync, before the reply.
"""

from __future__ import annotations

from dataclasses import replace

from sidecar.consensus.acceptor import (
    Acceptor, AcceptorAction, AcceptorError, AdoptTimeline, PeerTerm, Persist, RecordEnd, Reply, Truncate, Write,
)
from sidecar.consensus.groupcommit import Decision
from sidecar.consensus.messages import Append, Elected, Message, Refusal, VoteRequest
from sidecar.consensus.state import AcceptorState
from sidecar.sim.checker import Checker
from sidecar.sim.context import Context
from sidecar.sim.network import Network
from sidecar.sim.nodes import Connection, SimSafekeeper
from sidecar.sim.trace import pos
from sidecar.sim.wal import Disk, record_end

MIN_SEG_SIZE = 1024  # the simulator's tiny segments are below PostgreSQL's 1 MiB minimum


class Safekeepers:
    """What server.py does around the acceptor, for every simulated safekeeper."""

    def __init__(self, ctx: Context, checker: Checker, net: Network, nodes: list[SimSafekeeper]) -> None:
        self.ctx = ctx
        self.checker = checker
        self.net = net
        self.nodes = nodes
        for sk in nodes:
            # The cluster is created explicitly (`walsidecar safekeeper-init`): a control file at term 0 naming
            # how many members it has. An empty directory is then always a lost disk.
            sk.persisted = replace(sk.persisted, members=len(nodes))
            sk.acceptor = Acceptor(sk.node_id, sk.persisted, 0, MIN_SEG_SIZE)

    def vote_is_one_step(self) -> bool:
        """The rule of docs/protocol.md beside invariant 3: a vote's or an Elected's flush and scan
        and its taking effect are one step under the acceptor lock (a teeth test turns it off)."""
        return True

    def receive(self, c: Connection, msg: Message, end: RecordEnd | None = None) -> bool:
        """The thread's step for one message (`server.converse` and `_receive`): the session decides,
        then its actions run in order; `end`: the scan of an earlier step (the rule turned off)."""
        sk, session = c.sk, c.session
        acc = session.acceptor
        try:
            if end is None and session.needs_record_end(msg):
                end = self._flushed_record_end(sk)
                if not self.vote_is_one_step():
                    c.scanned = (msg, end)
                    return True
                scanned = True
            else:
                scanned = end is not None
            actions = session.receive(msg, end)
        except AcceptorError as e:
            self.ctx.event(sk.name, "refuses", c.label, str(e))
            self.ctx.count("refusals by safekeepers")
            if c.carries_replies:
                c.to_prop.append(Refusal(str(e)))
            self.net.close_sk_end(c)
            return False
        if not scanned and type(msg) in (VoteRequest, Elected):
            self.ctx.count("scans reused by a vote or Elected")
        if type(msg) is Append and msg.term == acc.elected_term and msg.term >= acc.state.term:
            self.checker.accepted(sk, msg.term, c.sender, "Append")
        elif type(msg) is Elected and any(isinstance(a, Truncate) for a in actions):
            self.checker.accepted(sk, msg.term, c.sender, "Elected")
        self._execute(sk, c, actions)
        return True

    def _group_commit(self, c: Connection) -> Decision:
        """After an Append on the term's connection: the real policy, with input already here."""
        acc = c.session.acceptor
        more = bool(c.to_sk) and (c.svc is None or self.net.reachable(c.svc, c.sk))
        return c.commit.decide(acc.write_lsn, acc.flush_lsn, more, False, self.ctx.step)

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
                    sk.wiped = False
                    self.checker.durable(sk)
                case Truncate():
                    ctx.event(sk.name, "truncates at", a.lsn)
                    sk.truncations.append(a.lsn)
                    sk.disk.truncate(a.lsn)
                    self.checker.truncated(sk, a.lsn)
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
        """A message reaches a safekeeper that is up, and its connection's thread, idle, reads it;
        while group commit says input is waiting it reads on, as the thread does."""
        cands = [c for sk in self.nodes if sk.acceptor is not None for c in sk.conns
                 if c.to_sk and not c.busy and (c.svc is None or self.net.reachable(c.svc, sk))]
        c = self.net.pick(cands)
        if c is None:
            return False
        while True:
            msg = c.to_sk.popleft()
            self.ctx.delivered(c.label, True, msg)
            if not self.receive(c, msg) or c.sk.acceptor is None or not c.sk_open:
                return True
            if type(msg) is not Append or not c.session.holds_term:
                return True
            decision = self._group_commit(c)
            if decision is Decision.SYNC_NOW:
                c.sync_wanted = True
            if decision is not Decision.LATER:
                return True

    def _busy(self, what: str) -> list[Connection]:
        return [c for sk in self.nodes if sk.acceptor is not None for c in sk.conns if getattr(c, what)]

    def sync(self) -> bool:
        """A thread's fdatasync (outside the acceptor lock): durable now, acknowledged in a later step."""
        cands = self._busy("sync_wanted")
        if not cands:
            return False
        c = self.ctx.rng.choice(cands)
        sk = c.sk
        c.sync_wanted = False
        c.flushed = sk.disk.fsync()
        c.commit.synced()
        sk.changed()
        self.checker.durable(sk)
        self.ctx.event(sk.name, "fsync", c.flushed, c.label)
        return True

    def acknowledge(self) -> bool:
        """The thread takes the lock again: it acknowledges what its sync made durable, if the
        connection still holds the term (`server._acknowledge`)."""
        cands = [c for c in self._busy("flushed")]
        if not cands:
            return False
        c = self.ctx.rng.choice(cands)
        flushed, c.flushed = c.flushed, None
        assert flushed is not None and c.sk.acceptor is not None
        if c.session.holds_term:
            self._execute(c.sk, c, c.sk.acceptor.on_flushed(flushed))
        return True

    def apply_scan(self) -> bool:
        """Only with the one-step rule off: a vote or Elected takes effect with the end scanned earlier."""
        cands = [c for c in self._busy("scanned")]
        if not cands:
            return False
        c = self.ctx.rng.choice(cands)
        assert c.scanned is not None
        (msg, end), c.scanned = c.scanned, None
        self.receive(c, msg, end)
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
        # startup.py: an empty data directory learns its term from its peers (every other one is listed as
        # --peers) before it votes.
        sk.acceptor = Acceptor(sk.node_id, state, write_lsn, MIN_SEG_SIZE,
                               amnesic=sk.wiped and self.ctx.cfg.amnesia_rule, listed_members=len(self.nodes))
        sk.changed()
        self.checker.durable(sk)
        self.ctx.event(sk.name, "restarts", f"term={state.term}", f"flush={pos(write_lsn)}")
        return True

    def lose_disk(self) -> bool:
        """A safekeeper's disk is lost: its control file and WAL are gone; it restarts later with the same id.

        Any safekeeper, whatever it alone acknowledged, but one lost disk at a time: none while another has
        not learned its term, or has and holds no start of a later term yet (the fault model of
        docs/protocol.md "A lost disk").
        """
        if any(sk.wiped or self._recovering(sk) for sk in self.nodes):
            return False
        sk = self.ctx.rng.choice(self.nodes)
        if sk.acceptor is not None:
            self.crash(sk)
        sk.disk, sk.persisted, sk.truncations, sk.wiped = Disk(), AcceptorState(), [], True
        self.checker.disk_lost(sk)
        sk.changed()
        self.ctx.count("lost disks")
        self.ctx.event(sk.name, "loses its disk")
        return True

    @staticmethod
    def _recovering(sk: SimSafekeeper) -> bool:
        """Amnesic, or learned its term and holds no start of a later term yet (down: until it voted again)."""
        if sk.acceptor is not None:
            return sk.acceptor.amnesic or sk.acceptor.recovering_from > 0
        return sk.persisted.lost_disk_term > 0

    def learn_terms(self) -> bool:
        """An amnesic safekeeper asks its peers that are up for their terms (an InfoRequest each)."""
        cands = [sk for sk in self.nodes if sk.acceptor is not None and sk.acceptor.amnesic]
        if not cands:
            return False
        sk = self.ctx.rng.choice(cands)
        acc = sk.acceptor
        assert acc is not None
        answers = {o.node_id: PeerTerm(o.acceptor.state.term, o.acceptor.members, o.acceptor.amnesic)
                   for o in self.nodes if o is not sk and o.acceptor is not None and self.ctx.rng.random() < 0.8}
        actions = acc.on_peer_terms(answers)
        self.ctx.event(sk.name, "asks its peers' terms", {n: a.term for n, a in answers.items()},
                       "learned" if actions else "not enough")
        if actions:
            self.ctx.count("terms learned after a lost disk")
            if not self.ctx.cfg.later_term_rule:  # the teeth test's switch: vote at once after learning
                acc.state = replace(acc.state, lost_disk_term=0)
                actions = [Persist(acc.state)]
            self._execute(sk, None, actions)
        return True

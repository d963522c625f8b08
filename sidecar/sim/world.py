"""The simulated cluster: safekeepers, proposer services, primaries and the network between them.

The world executes the actions of the real `Proposer` and of one `AcceptorSession` per
connection the way `sidecar/proposer/service.py` and `sidecar/safekeeper/server.py` do, and lets
a seeded random scheduler pick the next step among everything that could happen next, hostile
peers included.
"""

from __future__ import annotations

import bisect
import random
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.consensus import history as hist
from sidecar.consensus.acceptor import Acceptor, AcceptorError, Persist, RecordEnd, Reply, Truncate, Write
from sidecar.consensus.messages import (
    PROTOCOL_VERSION,
    Append,
    AppendReply,
    Elected,
    ElectedReply,
    Greeting,
    InfoRequest,
    Message,
    Refusal,
    TermEntry,
    TermHistory,
    TimelineEntry,
    TimelineHistory,
    VoteRequest,
)
from sidecar.consensus.proposer import (
    Action,
    DropPeer,
    FetchWal,
    GreetingsRefused,
    Note,
    Phase,
    Proposer,
    ProposerConfig,
    ReportStatus,
    Send,
    StartStreaming,
    TermLost,
    TermsExhausted,
    VerifyPrimary,
)
from sidecar.consensus.acceptor import AcceptorAction
from sidecar.consensus.session import AcceptorSession, Role
from sidecar.consensus.state import AcceptorState
from sidecar.sim.checker import Checker
from sidecar.sim.trace import Delivery, Event, Trace, pos
from sidecar.sim.wal import BOOT, Disk, Primary, encode_record

SYSTEM_ID = 7301
PG_VERSION = 15  # the major version, as the proposer reads it from server_version_num
MIN_SEG_SIZE = 1024  # the simulator's tiny segments are below PostgreSQL's 1 MiB minimum
ROGUE = "rogue"  # sender of the hostile connections that belong to no proposer
NOTES = frozenset({"campaign", "elected", "streaming", "safekeeper refused"})  # Notes worth a trace line


@dataclass(frozen=True)
class SimConfig:
    """What a run is asked to do; everything else is drawn from the seed."""

    steps: int = 1500
    safekeepers: int | None = None  # None: 3, or sometimes 5, drawn from the seed
    proposer_quorum: int | None = None  # None: a majority; anything else is a deliberately broken rule
    trace: int | None = 80  # events kept for the report; None keeps all
    disabled: frozenset[str] = frozenset()  # invariants not checked (to see what else catches a bug)


@dataclass(frozen=True)
class Profile:
    """The seed's personality: cluster size, how hostile the environment is, proposer limits."""

    safekeepers: int
    chaos: float
    seg_size: int
    max_inflight: int
    buffer_limit: int
    mid_crash: float  # chance that a safekeeper dies between two actions of one message
    rivals: float  # weight of starting a second, competing proposer
    rogues: float  # weight of hostile connections (term hijacks, cuts below commit, read-only writers)
    liars: float  # weight of a safekeeper reply claiming a flush it never made

    @staticmethod
    def draw(rng: random.Random, cfg: SimConfig) -> Profile:
        return Profile(
            safekeepers=cfg.safekeepers or rng.choice((3, 3, 3, 5)),
            chaos=rng.choice((0.3, 1.0, 1.0, 2.5)),
            seg_size=rng.choice((1024, 8192, 16 << 20)),
            max_inflight=rng.choice((32 << 20, 4000, 700)),
            buffer_limit=rng.choice((64 << 20, 6000, 1500)),
            mid_crash=rng.choice((0.0, 0.002, 0.01)),
            rivals=rng.choice((0.0, 0.05, 0.3)),
            rogues=rng.choice((0.0, 0.3, 1.0)),
            liars=rng.choice((0.0, 0.2, 1.0)),
        )


@dataclass(eq=False)
class Safekeeper:
    name: str
    node_id: int
    disk: Disk = field(default_factory=Disk)
    persisted: AcceptorState = field(default_factory=AcceptorState)  # the control file
    acceptor: Acceptor | None = None  # None while the process is down
    conns: list[Connection] = field(default_factory=list)
    truncations: list[int] = field(default_factory=list)
    version: int = 0  # bumped on every change the checker looks at
    views: list = field(default_factory=list)
    view_version: int = -1

    @property
    def commit_lsn(self) -> int:
        return (self.acceptor.state if self.acceptor else self.persisted).commit_lsn

    @property
    def stream(self) -> Connection | None:
        """Where on_flushed replies go: the connection holding the term (the server's `_stream`)."""
        owner = self.acceptor.owner if self.acceptor is not None else None
        return owner.conn if isinstance(owner, AcceptorSession) else None  # type: ignore[return-value]


@dataclass(eq=False)
class Connection:
    """One TCP connection: FIFO both ways; each end closes on its own and sees EOF later."""

    label: str
    sender: str  # label of the Proposer instance this connection was opened for
    svc: Service | None  # None for a hostile connection that belongs to no proposer
    sk: Safekeeper
    slow: bool
    session: AcceptorSession
    to_sk: deque[Message] = field(default_factory=deque)
    to_prop: deque[Message] = field(default_factory=deque)
    prop_open: bool = True
    sk_open: bool = True
    # The proposer closed its writer at the end of a term but its reader still holds
    # replies already received, which the next term's core will read before the EOF.
    lingering: bool = False

    @property
    def carries_replies(self) -> bool:
        return self.prop_open and self.sk_open and not self.lingering


@dataclass(eq=False)
class Stream:
    """The replication stream from the primary to one term's core."""

    start: int
    pos: int
    flushed: int = 0  # highest flush reported back on it


@dataclass(eq=False)
class Fetch:
    pos: int
    end: int


@dataclass(eq=False)
class Service:
    """One `walsidecar start` process: a new Proposer per replication stream."""

    name: str
    primary: Primary
    alive: bool = True
    core: Proposer | None = None
    label: str = ""
    attempts: int = 0
    last_term: int = 0
    links: dict[str, Connection | None] = field(default_factory=dict)
    stream: Stream | None = None
    verifies: list[tuple[Proposer, VerifyPrimary]] = field(default_factory=list)
    fetches: dict[str, Fetch] = field(default_factory=dict)
    # What the service did, for scripted tests.
    reports: list[ReportStatus] = field(default_factory=list)
    checks: list[VerifyPrimary] = field(default_factory=list)
    fetched: list[FetchWal] = field(default_factory=list)


def switches_below(history: TimelineHistory, lsn: int) -> tuple[tuple[int, int], ...]:
    return tuple((e.timeline, e.switch_lsn) for e in history if e.switch_lsn <= lsn)


class World:
    """Everything simulated; `step()` is one random event, `run()` a whole seed.

    With `scripted=True` nothing happens by itself: no proposer is started, links are
    never slow and never linger, and a test drives the world with the methods at the end.
    """

    def __init__(self, seed: int, cfg: SimConfig | None = None, scripted: bool = False) -> None:
        self.seed = seed
        self.scripted = scripted
        self.cfg = cfg = cfg or SimConfig()
        self.rng = random.Random(seed)
        self.profile = Profile.draw(self.rng, cfg)
        self.safekeepers = [Safekeeper(f"sk{i + 1}", i + 1) for i in range(self.profile.safekeepers)]
        for sk in self.safekeepers:
            sk.acceptor = Acceptor(sk.node_id, sk.persisted, 0, MIN_SEG_SIZE)
        self.by_name = {sk.name: sk for sk in self.safekeepers}
        self.primaries = [Primary("pg1", 1, ())]
        self.current = self.primaries[0]
        self.services: list[Service] = []
        self.cut_off: set[tuple[str, str]] = set()  # (service, safekeeper) pairs partitioned apart
        self.trace = Trace(cfg.trace)
        self.checker = Checker(self, cfg.disabled)
        self.step_no = 0
        self.stats: dict[str, int] = {}
        self._conn_seq = 0
        self._handlers, self._weights = self._schedule()
        if not scripted:
            self._start_service()

    # ---- bookkeeping ---------------------------------------------------------------------------

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def event(self, actor: str, what: str, *args: object) -> None:
        self.trace.add(Event(self.step_no, actor, what, args))

    def _changed(self, sk: Safekeeper) -> None:
        sk.version += 1

    # ---- the scheduler -------------------------------------------------------------------------

    def _schedule(self) -> tuple[list, list[float]]:
        c, p = self.profile.chaos, self.profile
        table = [
            (30, self._deliver_to_safekeeper), (30, self._deliver_to_proposer), (8, self._fsync),
            (10, self._primary_write), (8, self._primary_flush), (14, self._stream_piece),
            (6, self._catchup_piece), (4, self._verify), (3, self._heartbeat),
            (1.5, self._election_timeout), (5, self._reconnect), (4, self._eof),
            (1.0 * c, self._break_connection), (0.5 * c, self._crash_safekeeper),
            (4, self._restart_safekeeper), (0.15 * c, self._crash_service), (3, self._restart_service),
            (p.rivals * c, self._start_rival), (3, self._new_term), (0.25 * c, self._crash_primary),
            (0.02 * c, self._promote_standby), (0.03 * c, self._restore_primary),
            (0.02 * c, self._resume_stale_primary), (0.15 * c, self._partition), (1.5, self._heal),
            (p.rogues * c, self._rogue), (p.liars * c, self._lie),
        ]
        weights, total = [], 0.0
        for w, _ in table:
            total += w
            weights.append(total)
        return [h for _, h in table], weights

    def step(self) -> None:
        """One scheduled event (a few tries to find one that can happen), then every check."""
        self.step_no += 1
        rng, weights = self.rng, self._weights
        for _ in range(6):
            h = self._handlers[bisect.bisect_right(weights, rng.random() * weights[-1])]
            if h():
                break
        self.checker.after_step()

    def run(self, steps: int | None = None) -> None:
        for _ in range(self.cfg.steps if steps is None else steps):
            self.step()

    # ---- safekeeper side ---------------------------------------------------------------------

    def scan(self, disk: Disk, history: TermHistory, upto: int, fingerprint: bool = True) -> RecordEnd:
        """The end of WAL a scan finds if the stored bytes ended at `upto`: the last complete record.

        server.py walks from its last durable segment; this walks the chain from the store's
        start. Both find the same record end; the vote fingerprints that record wherever it lies.
        """
        if disk.start is None:
            return RecordEnd(0)
        last = disk.last_record(upto)
        if last is None:
            return RecordEnd(disk.start)
        if not fingerprint:
            return RecordEnd(last[1])
        return RecordEnd(last[1], last[0], zlib.crc32(disk.read(last[0], last[1])))

    def _flushed_record_end(self, sk: Safekeeper) -> RecordEnd:
        assert sk.acceptor is not None
        if sk.disk.start is None:
            return RecordEnd(0)
        sk.disk.fsync()
        self._changed(sk)
        self.checker.durable(sk)
        return self.scan(sk.disk, sk.acceptor.state.term_history, sk.disk.end)

    def _deliver_to_safekeeper(self) -> bool:
        cands = [c for sk in self.safekeepers if sk.acceptor is not None for c in sk.conns
                 if c.to_sk and (c.svc is None or (c.svc.name, sk.name) not in self.cut_off)]
        c = self._pick(cands)
        if c is None:
            return False
        msg = c.to_sk.popleft()
        self.trace.add(Delivery(self.step_no, c.label, True, msg))
        self._acceptor_receive(c, msg)
        return True

    def _pick(self, cands: list[Connection]) -> Connection | None:
        """A connection to deliver on; a slow one usually lets this turn pass."""
        if not cands:
            return None
        c = self.rng.choice(cands)
        return None if c.slow and not self.scripted and self.rng.random() < 0.7 else c

    def _acceptor_receive(self, c: Connection, msg: Message) -> bool:
        """The server's `_connection` loop body: the session decides, then its actions run in order."""
        sk, session = c.sk, c.session
        acc = session.acceptor
        try:
            end = self._flushed_record_end(sk) if session.needs_record_end(msg) else None
            actions = session.receive(msg, end)
        except AcceptorError as e:
            self.event(sk.name, "refuses", c.label, str(e))
            self.count("refusals by safekeepers")
            if c.carries_replies:
                c.to_prop.append(Refusal(str(e)))
            self._close_sk_end(c)
            return False
        if end is None and type(msg) in (VoteRequest, Elected):
            self.count("scans reused by a vote or Elected")
        if type(msg) is Append and msg.term == acc.elected_term and msg.term >= acc.state.term:
            self.checker.accepted(sk, msg.term, c.sender, "Append")
        elif type(msg) is Elected and any(isinstance(a, Truncate) for a in actions):
            self.checker.accepted(sk, msg.term, c.sender, "Elected")
        self._execute(sk, c, actions)
        return True

    def _execute(self, sk: Safekeeper, c: Connection | None, actions: list[AcceptorAction]) -> None:
        for a in actions:
            if self.profile.mid_crash and not self.scripted and self.rng.random() < self.profile.mid_crash:
                self.event(sk.name, "dies before", type(a).__name__)
                self._crash(sk)
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
                    self.event(sk.name, "truncates at", a.lsn)
                    sk.truncations.append(a.lsn)
                    sk.disk.truncate(a.lsn)
                case Reply():
                    self.checker.replied(sk, a.message)
                    if c is not None and c.carries_replies:
                        c.to_prop.append(a.message)
                case _:
                    raise AssertionError(f"the simulator does not know the action {a!r}")
            self._changed(sk)

    def _fsync(self) -> bool:
        cands = [sk for sk in self.safekeepers if sk.acceptor is not None and sk.disk.durable < sk.disk.end]
        if not cands:
            return False
        sk = self.rng.choice(cands)
        acc = sk.acceptor
        assert acc is not None
        if sk.disk.durable >= acc.write_lsn:
            return False  # the flusher only runs for WAL the acceptor handed over
        flushed = sk.disk.fsync()
        self._changed(sk)
        self.checker.durable(sk)
        self.event(sk.name, "fsync", flushed)
        if sk.stream is not None:
            self._execute(sk, sk.stream, acc.on_flushed(flushed))
        return True

    def _crash(self, sk: Safekeeper) -> None:
        for c in list(sk.conns):
            self._close_sk_end(c)
        sk.acceptor = None
        kept, junk = sk.disk.crash(self.rng)
        self._changed(sk)
        self.count("safekeeper crashes")
        if kept or junk:
            self.count("torn safekeeper tails")
        self.event(sk.name, "crashes", f"kept={kept}", f"junk={junk}", f"end={pos(sk.disk.end)}")

    def _crash_safekeeper(self) -> bool:
        up = [sk for sk in self.safekeepers if sk.acceptor is not None]
        if not up:
            return False
        self._crash(self.rng.choice(up))
        return True

    def _restart_safekeeper(self) -> bool:
        down = [sk for sk in self.safekeepers if sk.acceptor is None]
        if not down:
            return False
        sk = self.rng.choice(down)
        state, write_lsn = sk.persisted, 0
        if state.wal_seg_size:
            end = self.scan(sk.disk, state.term_history, sk.disk.end).flush_lsn
            if end:
                sk.disk.truncate(end)
            write_lsn = end
        sk.acceptor = Acceptor(sk.node_id, state, write_lsn, MIN_SEG_SIZE)
        self._changed(sk)
        self.checker.durable(sk)
        self.event(sk.name, "restarts", f"term={state.term}", f"flush={pos(write_lsn)}")
        return True

    # ---- connections ---------------------------------------------------------------------------

    def _deliver_to_proposer(self) -> bool:
        cands = [c for svc in self.services if svc.alive for c in svc.links.values()
                 if c is not None and c.to_prop and (svc.name, c.sk.name) not in self.cut_off]
        c = self._pick(cands)
        if c is None:
            return False
        msg = c.to_prop.popleft()
        self.trace.add(Delivery(self.step_no, c.label, False, msg))
        svc = c.svc
        if svc.core is not None:
            self._run(svc, svc.core.peer_message(c.sk.name, msg))
        return True

    def _reconnect(self) -> bool:
        cands = [(svc, sk) for svc in self.services if svc.alive and svc.core is not None
                 for sk in self.safekeepers if svc.links.get(sk.name) is None and sk.acceptor is not None
                 and (svc.name, sk.name) not in self.cut_off]
        if not cands:
            return False
        self._connect(*self.rng.choice(cands))
        return True

    def _open(self, label: str, sender: str, svc: Service | None, sk: Safekeeper,
              role: Role = Role.PROPOSER) -> Connection:
        """A connection accepted by `sk`, with its session, as the server's `_connection` starts one."""
        assert sk.acceptor is not None
        self._conn_seq += 1
        session = AcceptorSession(sk.acceptor, role)
        c = Connection(f"{label}-{sk.name}#{self._conn_seq}", sender, svc, sk,
                       slow=svc is not None and self.rng.random() < 0.2, session=session)
        session.conn = c
        sk.conns.append(c)
        return c

    def _connect(self, svc: Service, sk: Safekeeper) -> None:
        c = self._open(svc.label, svc.label, svc, sk)
        svc.links[sk.name] = c
        self.event(svc.label, "connects", c.label)
        assert svc.core is not None
        self._run(svc, svc.core.peer_connected(sk.name))

    def _close_prop_end(self, c: Connection, notify: bool, lose: bool = False) -> None:
        """The proposer's end closes: it reads nothing more; what it sent may still arrive."""
        if not c.prop_open:
            return
        c.prop_open = c.lingering = False
        c.to_prop.clear()
        if lose and c.to_sk:
            # A network failure: TCP delivered some prefix of what was in flight.
            for _ in range(self.rng.randint(0, len(c.to_sk))):
                c.to_sk.pop()
        svc, name = c.svc, c.sk.name
        if svc is not None and svc.links.get(name) is c:
            svc.links[name] = None
            svc.fetches.pop(name, None)  # the service cancels the catch-up of a peer that went down
            if notify and svc.core is not None:
                self._run(svc, svc.core.peer_disconnected(name))

    def _close_sk_end(self, c: Connection) -> None:
        if not c.sk_open:
            return
        c.sk_open = False
        c.to_sk.clear()
        c.sk.conns.remove(c)
        c.session.closed()

    def _break_connection(self) -> bool:
        cands = [c for sk in self.safekeepers for c in sk.conns if c.prop_open]
        if not cands:
            return False
        c = self.rng.choice(cands)
        if self.rng.random() < 0.5:
            self.event(c.label, "breaks (proposer side)")
            self._close_prop_end(c, notify=True, lose=True)
        else:
            self.event(c.label, "breaks (safekeeper side)")
            self._close_sk_end(c)
        return True

    def _eof(self) -> bool:
        """An end whose peer has closed reads the rest of the stream, then sees EOF."""
        cands = [(c, True) for sk in self.safekeepers for c in sk.conns
                 if (not c.prop_open or c.lingering) and not c.to_sk]
        cands += [(c, False) for svc in self.services for c in svc.links.values()
                  if c is not None and (not c.sk_open or c.lingering) and not c.to_prop]
        if not cands:
            return False
        c, at_sk = self.rng.choice(cands)
        if at_sk:
            self._close_sk_end(c)
        else:
            self.event(c.label, "EOF at the proposer")
            self._close_prop_end(c, notify=True)
        return True

    def _partition(self) -> bool:
        live = [svc for svc in self.services if svc.alive]
        if not live:
            return False
        names = [sk.name for sk in self.safekeepers]
        cut = self.rng.sample(names, self.rng.randint(1, len(names)))
        svcs = live if self.rng.random() < 0.5 else [self.rng.choice(live)]
        for svc in svcs:
            self.cut_off.update((svc.name, n) for n in cut)
        self.event("network", "partition", "+".join(s.name for s in svcs), "|", "+".join(sorted(cut)))
        return True

    def _heal(self) -> bool:
        if not self.cut_off:
            return False
        self.cut_off.clear()
        self.event("network", "heals")
        return True

    # ---- hostile peers ---------------------------------------------------------------------------

    def _rogue(self) -> bool:
        """A connection that belongs to no proposer tries to take the current term or cut committed WAL.

        It knows everything a reader of InfoRequest knows and more (the exact write position), and
        speaks in one burst; the session must refuse it before anything changes.
        """
        cands = [sk for sk in self.safekeepers if sk.acceptor is not None and sk.acceptor.state.system_id]
        if not cands:
            return False
        sk = self.rng.choice(cands)
        acc = sk.acceptor
        assert acc is not None
        s, kind = acc.state, self.rng.choice(("append", "elect", "cut", "read-only"))
        greeting = Greeting(PROTOCOL_VERSION, ROGUE, SYSTEM_ID, s.timeline, s.wal_seg_size, s.pg_version)
        term = s.term
        role = Role.PROPOSER
        if kind == "append":  # claim the elected term without its Elected: bytes after ours
            if not acc.elected_term or acc.elected_term != term:
                return False
            junk = encode_record(acc.write_lsn, acc.write_lsn, self.rng.randbytes(self.rng.randint(1, 40)))
            msgs: list[Message] = [greeting, Append(term, acc.write_lsn, acc.write_lsn, 0, junk)]
        elif kind == "elect":  # claim the term without asking for a vote on this connection
            if not s.term_history or s.term_history[-1].term != term:
                return False
            last = s.term_history[-1]
            msgs = [greeting, Elected(term, last.start_lsn, s.term_history)]
        elif kind == "cut":  # a same-term vote request, then an Elected that cuts below commit
            flush = self.scan(sk.disk, s.term_history, sk.disk.end, fingerprint=False).flush_lsn
            below = min(s.commit_lsn, flush)
            if not term or below <= BOOT:
                return False
            low = self.rng.randint(BOOT, below - 1)
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
        self.count(f"rogue connections ({kind})")
        c = self._open(ROGUE, ROGUE, None, sk, role)
        self.event(c.label, "rogue connection", kind)
        for msg in msgs:
            self.trace.add(Delivery(self.step_no, c.label, True, msg))
            if not self._acceptor_receive(c, msg):
                self.count(f"rogue connections refused ({kind})")
                return True
            if sk.acceptor is None:  # a crash between two actions closed it
                self.count(f"rogue connections cut short by a crash ({kind})")
                return True
        self._close_sk_end(c)
        return True

    def _lie(self) -> bool:
        """A safekeeper reply claiming a flush it cannot hold: above what it was sent, or voted with."""
        cands = [(svc, c) for svc in self.services if svc.core is not None
                 and svc.core.phase is Phase.STREAMING
                 for c in svc.links.values() if c is not None and c.carries_replies]
        if not cands:
            return False
        svc, c = self.rng.choice(cands)
        core = svc.core
        assert core is not None
        p = core.peers[c.sk.name]
        # Far above anything the proposer can have sent by the time the lie arrives: a lie within
        # what was sent (an fsync claimed but not done) is beyond any proposer's power to detect.
        extra = (1 << 40) + self.rng.randint(1, 4000)
        if p.elected:
            lie: Message = AppendReply(core.term, p.sent_lsn + extra, core.commit_lsn)
        elif p.vote is not None:
            lie = ElectedReply(core.term, max(p.vote.flush_lsn, core.term_start) + extra)
        else:
            return False
        self.count("lying safekeeper replies")
        self.event(c.label, "safekeeper lies", lie)
        c.to_prop.append(lie)
        return True

    # ---- proposer side -----------------------------------------------------------------------

    def _config(self, primary: Primary, svc: Service) -> ProposerConfig:
        p = self.profile
        return ProposerConfig(
            proposer_id=svc.name, peers=tuple(sk.name for sk in self.safekeepers),
            quorum=self.cfg.proposer_quorum or len(self.safekeepers) // 2 + 1, system_id=SYSTEM_ID,
            timeline=primary.timeline, wal_seg_size=p.seg_size, pg_version=PG_VERSION,
            bootstrap_lsn=BOOT, max_inflight=p.max_inflight, buffer_limit=p.buffer_limit)

    def _run(self, svc: Service, actions: list[Action]) -> None:
        """The service's `_run`: carry out one batch of proposer actions."""
        core = svc.core
        lost = refused = False
        for a in actions:
            match a:
                case Send():
                    c = svc.links.get(a.peer)
                    if c is not None and c.prop_open and not c.lingering:
                        c.to_sk.append(a.message)
                case ReportStatus():
                    if svc.stream is not None and core is not None:
                        self.count("reports")
                        svc.reports.append(a)
                        self.checker.reported(svc, core, a)
                case StartStreaming():
                    assert core is not None
                    self._start_stream(svc, core, a.start_lsn)
                case VerifyPrimary():
                    assert core is not None
                    svc.verifies.append((core, a))
                    svc.checks.append(a)
                case FetchWal():
                    svc.fetches[a.peer] = Fetch(a.start, a.end)
                    svc.fetched.append(a)
                    self.count("catch-ups")
                    self.event(svc.label, "fetches for", a.peer, a.start, a.end)
                case TermLost():
                    svc.last_term = max(svc.last_term, a.term)
                    self.event(svc.label, "term lost", a.reason)
                    lost = True
                case GreetingsRefused():
                    refused = True
                case DropPeer():
                    # The service logs the protocol error and closes that link; it reconnects later.
                    self.count("links dropped by the proposer")
                    self.event(svc.label, "drops", a.peer, a.reason)
                    c = svc.links.get(a.peer)
                    if c is not None:
                        self._close_prop_end(c, notify=False)
                case TermsExhausted():
                    self._stop_service(svc, "exits: no term left to campaign in")
                case Note():
                    if a.event in NOTES:
                        self.event(svc.label, a.event, *(f"{k}={pos(v) if k.endswith('_lsn') else v}"
                                                         for k, v in a.fields.items()))
                case _:
                    raise AssertionError(f"the simulator does not know the action {a!r}")
        if refused and svc.alive:
            self.count("proposers stopped by refused greetings")
            self._stop_service(svc, "exits: safekeepers refuse its greeting")
        elif lost and svc.core is core:
            self._end_term(svc)

    def _start_stream(self, svc: Service, core: Proposer, start: int) -> None:
        if svc.primary.flush < start:
            self.event(svc.label, "START_REPLICATION fails", start)
            self._end_term(svc)
            return
        svc.stream = Stream(start, start)
        self.count("terms streamed")
        self.checker.streaming(svc, core)

    def _new_core(self, svc: Service) -> None:
        live = [p for p in self.primaries if p.alive]
        if self.current.alive and (self.rng.random() < 0.85 or not svc.primary.alive):
            svc.primary = self.current
        elif not svc.primary.alive:
            svc.primary = self.rng.choice(live)
        svc.attempts += 1
        svc.label = f"{svc.name}.{svc.attempts}"
        svc.core = Proposer(self._config(svc.primary, svc), min_term=svc.last_term)
        self.event(svc.label, "new term attempt", f"primary={svc.primary.name}", f"min_term={svc.last_term}")
        for name, c in svc.links.items():
            if c is not None:  # a link whose close the service has not noticed yet
                self._run(svc, svc.core.peer_connected(name))

    def _end_term(self, svc: Service) -> None:
        """The service's `_end_term`: the core goes, every link is dropped."""
        core = svc.core
        if core is not None:
            svc.last_term = max(svc.last_term, core.term)
            core.stream_ended()
        self.event(svc.label, "term over")
        svc.core, svc.stream = None, None
        svc.fetches.clear()
        svc.verifies.clear()
        for c in svc.links.values():
            if c is None:
                continue
            if not self.scripted and self.rng.random() < 0.15:
                c.lingering = True
            else:
                self._close_prop_end(c, notify=False)

    def _new_term(self) -> bool:
        cands = [svc for svc in self.services if svc.alive and svc.core is None]
        if not cands or not any(p.alive for p in self.primaries):
            return False
        self._new_core(self.rng.choice(cands))
        return True

    def _start_service(self) -> Service:
        live = [p for p in self.primaries if p.alive]
        svc = Service(f"P{len(self.services) + 1}", self.current if self.current.alive else self.rng.choice(live))
        svc.links = {sk.name: None for sk in self.safekeepers}
        self.services.append(svc)
        self.event(svc.name, "starts")
        self._new_core(svc)
        return svc

    def _restart_service(self) -> bool:
        if any(svc.alive for svc in self.services) or not any(p.alive for p in self.primaries):
            return False
        self._start_service()
        return True

    def _start_rival(self) -> bool:
        if sum(svc.alive for svc in self.services) != 1 or not any(p.alive for p in self.primaries):
            return False
        self.count("rival proposers")
        self._start_service()
        return True

    def _stop_service(self, svc: Service, why: str) -> None:
        self.event(svc.label, why)
        svc.alive = False
        svc.core, svc.stream = None, None
        svc.fetches.clear()
        svc.verifies.clear()
        for c in svc.links.values():
            if c is not None:
                self._close_prop_end(c, notify=False, lose=True)

    def _crash_service(self) -> bool:
        live = [svc for svc in self.services if svc.alive]
        if not live:
            return False
        self.count("proposer crashes")
        self._stop_service(self.rng.choice(live), "crashes")
        return True

    def _heartbeat(self) -> bool:
        return self._tick(Proposer.heartbeat)

    def _election_timeout(self) -> bool:
        return self._tick(Proposer.election_timeout)

    def _tick(self, timer: Callable[[Proposer], list[Action]]) -> bool:
        """One of the service's periodic timers fires."""
        live = [svc for svc in self.services if svc.core is not None]
        if not live:
            return False
        svc = self.rng.choice(live)
        assert svc.core is not None
        if timer is Proposer.election_timeout:
            self.event(svc.label, "election timeout")
        self._run(svc, timer(svc.core))
        return True

    def _verify(self) -> bool:
        cands = [svc for svc in self.services if svc.verifies]
        if not cands:
            return False
        svc = self.rng.choice(cands)
        core, a = svc.verifies.pop(0)
        if core is not svc.core:
            return True
        problem = self.check_primary(svc.primary, a)
        if problem is None:
            self.event(svc.label, "primary verified", svc.primary.name, f"E={pos(a.start_lsn)}")
            self._run(svc, core.primary_verified())
            return True
        self.count("primaries refused")
        donor = self.by_name[a.donor].disk
        if donor.start == BOOT and donor.end >= a.start_lsn and svc.primary.end >= a.start_lsn and \
                donor.read(BOOT, a.start_lsn) == svc.primary.read(BOOT, a.start_lsn):
            # Liveness, not safety: the primary does hold the donor's WAL up to E.
            self.count(f"primaries refused that hold the donor's WAL ({problem.split(' ')[0]})")
        self.event(svc.label, "primary refused", svc.primary.name, problem)
        self._run(svc, core.primary_refused(problem))
        self._stop_service(svc, "exits: refuses to stream")  # PrimaryMismatch is fatal
        return True

    @staticmethod
    def check_primary(primary: Primary, a: VerifyPrimary) -> str | None:
        """The service's `_check_primary`: flush, timeline lineage and the donor's tail bytes."""
        if primary.flush < a.start_lsn:
            return f"lacks WAL between {pos(primary.flush)} and {pos(a.start_lsn)}"
        ours, theirs = switches_below(primary.history, a.start_lsn), switches_below(a.timeline_history, a.start_lsn)
        if ours != theirs:
            return f"timeline history {ours} leaves the safekeepers' WAL {theirs} before {pos(a.start_lsn)}"
        if a.tail_lsn and zlib.crc32(primary.read(a.tail_lsn, a.start_lsn)) != a.tail_crc:
            return f"WAL in [{pos(a.tail_lsn)}, {pos(a.start_lsn)}) differs from {a.donor}'s"
        return None

    def _stream_piece(self) -> bool:
        cands = [svc for svc in self.services
                 if svc.stream is not None and svc.stream.pos < svc.primary.flush]
        if not cands:
            return False
        svc = self.rng.choice(cands)
        assert svc.stream is not None
        self._send_wal(svc, min(svc.primary.flush, svc.stream.pos + self.rng.randint(1, 600)))
        return True

    def _send_wal(self, svc: Service, upto: int) -> None:
        st, pg, core = svc.stream, svc.primary, svc.core
        assert st is not None and core is not None
        lsn = st.pos
        if upto <= lsn:
            return
        st.pos = upto
        pg.sent = max(pg.sent, upto)
        self.event(svc.label, "receives WAL", lsn, upto)
        self._run(svc, core.wal_received(lsn, pg.read(lsn, upto)))

    def _catchup_piece(self) -> bool:
        cands = [(svc, name) for svc in self.services for name in svc.fetches]
        if not cands:
            return False
        svc, name = self.rng.choice(cands)
        f, core = svc.fetches[name], svc.core
        assert core is not None
        if not self.scripted and self.rng.random() < 0.03:
            self.event(svc.label, "catch-up fails", name)
            c = svc.links.get(name)
            del svc.fetches[name]
            if c is not None:
                self._close_prop_end(c, notify=True)
            return True
        lsn = f.pos
        f.pos = min(f.end, lsn + self.rng.randint(1, 800))
        self._run(svc, core.catchup_data(name, lsn, svc.primary.read(lsn, f.pos)))
        if f.pos >= f.end and svc.fetches.get(name) is f:
            del svc.fetches[name]
            if svc.core is core:
                self._run(svc, core.catchup_done(name))
        return True

    # ---- primaries -----------------------------------------------------------------------------

    def _live_primary(self) -> Primary | None:
        if self.current.alive and self.rng.random() < 0.8:
            return self.current
        live = [p for p in self.primaries if p.alive]
        return self.rng.choice(live) if live else None

    def _primary_write(self) -> bool:
        pg = self._live_primary()
        if pg is None:
            return False
        start = pg.end
        for _ in range(self.rng.randint(1, 3)):
            pg.write_record(self.rng)
        self.event(pg.name, "writes", start, pg.end)
        return True

    def _primary_flush(self) -> bool:
        pg = self._live_primary()
        if pg is None or pg.flush >= pg.end:
            return False
        pg.flush_some(self.rng)
        self.event(pg.name, "flushes to", pg.flush)
        # Walsenders wake up on a flush: often the new WAL is on its way at once, which is
        # what lets a crash right after it overwrite bytes already sent.
        for svc in self.services:
            if svc.primary is pg and svc.stream is not None and self.rng.random() < 0.5:
                self._send_wal(svc, pg.flush)
        return True

    def _primary_gone(self, pg: Primary) -> None:
        """Its replication connections break: every term streaming from it ends."""
        for svc in self.services:
            if svc.primary is pg and svc.core is not None:
                self._end_term(svc)

    def _crash_primary(self) -> bool:
        pg = self._live_primary()
        if pg is None:
            return False
        sent = pg.sent
        cut, torn = pg.crash(self.rng)
        self.count("primary crashes")
        if sent > cut:
            self.count("sent primary WAL overwritten")
        pg.sent = min(sent, cut)
        self.event(pg.name, "crashes; recovers to", cut, f"torn_flushed={torn}", f"sent={pos(sent)}")
        self._primary_gone(pg)
        return True

    def _standby_point(self, pg: Primary) -> int:
        """Where a standby of `pg` stops replaying: a record end at or below pg's flush."""
        k = bisect.bisect_right(pg.ends, pg.flush)
        if k == 0:
            return BOOT
        return pg.ends[k - 1] if self.rng.random() < 0.5 else pg.ends[self.rng.randint(0, k - 1)]

    def _promote_standby(self) -> bool:
        pg = self.current
        if not pg.alive:
            return False
        at = self._standby_point(pg)
        tli = max(p.timeline for p in self.primaries) + 1
        new = pg.fork(f"pg{len(self.primaries) + 1}", at, tli, pg.history + (TimelineEntry(pg.timeline, at),))
        self.primaries.append(new)
        self.current = new
        self.count("standbys promoted")
        split = self.rng.random() < 0.3
        self.event(new.name, "promoted", f"from={pg.name}", f"at={pos(at)}", f"timeline={tli}",
                   "old primary keeps running" if split else "old primary stopped")
        if not split:
            pg.alive = False
            self._primary_gone(pg)
        return True

    def _restore_primary(self) -> bool:
        pg = self.current
        if not pg.alive:
            return False
        at = self._standby_point(pg)
        new = pg.fork(f"pg{len(self.primaries) + 1}", at, pg.timeline, pg.history)
        self.primaries.append(new)
        self.current = new
        pg.alive = False
        self.count("primaries restored from a copy")
        self.event(new.name, "restored from a copy of", pg.name, f"at={pos(at)}")
        self._primary_gone(pg)
        return True

    def _resume_stale_primary(self) -> bool:
        stale = [p for p in self.primaries if not p.alive]
        if not stale:
            return False
        pg = self.rng.choice(stale)
        pg.alive = True
        self.current = pg
        self.count("stale primaries resumed")
        self.event(pg.name, "stale primary comes back")
        return True

    # ---- scripted control (tests) ----------------------------------------------------------------

    def start_service(self) -> Service:
        """A proposer process attached to the current primary, with no link up yet."""
        return self._start_service()

    def connect(self, svc: Service, name: str) -> None:
        self._connect(svc, self.by_name[name])

    def disconnect(self, svc: Service, name: str) -> None:
        c = svc.links[name]
        assert c is not None
        self._close_prop_end(c, notify=True)

    def end_term(self, svc: Service) -> None:
        """The replication stream ended: the next `new_term` builds a new Proposer."""
        self._end_term(svc)

    def new_term(self, svc: Service) -> None:
        self._new_core(svc)

    def produce(self, records: int) -> None:
        """The current primary writes and flushes `records` records; its walsenders send them."""
        pg = self.current
        for _ in range(records):
            pg.write_record(self.rng)
        pg.flush = pg.end
        for svc in self.services:
            if svc.primary is pg and svc.stream is not None:
                self._send_wal(svc, pg.flush)

    def restore_primary(self, at: int) -> Primary:
        """Replace the current primary by a copy of its WAL up to the record end `at`."""
        old = self.current
        self.current = old.fork(f"pg{len(self.primaries) + 1}", at, old.timeline, old.history)
        self.primaries.append(self.current)
        old.alive = False
        self._primary_gone(old)
        return self.current

    def heartbeat(self, svc: Service) -> None:
        assert svc.core is not None
        self._run(svc, svc.core.heartbeat())

    def busy(self, steps: int) -> None:
        """Up to `steps` fault-free events, in a random order."""
        for _ in range(steps):
            if not self._calm_step():
                return

    def settle(self, limit: int = 1_000_000) -> None:
        """Fault-free events until there is nothing left to deliver, flush, send or check."""
        for _ in range(limit):
            if not self._calm_step():
                return
        raise AssertionError("the world did not settle")

    def _calm_step(self) -> bool:
        self.step_no += 1
        calm = [self._deliver_to_safekeeper, self._deliver_to_proposer, self._fsync, self._stream_piece,
                self._catchup_piece, self._verify, self._eof]
        self.rng.shuffle(calm)
        done = any(h() for h in calm)
        self.checker.after_step()
        return done

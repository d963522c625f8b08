"""Simulated readers (a standby, pg_receivewal): each drives the real `ReadCursor` as the walsender does.

A reader connects to a safekeeper that is up, at the end of the last complete record it holds (where
a standby resumes: its replay position), on the timeline that holds that position, and takes what
`ReadCursor.next()` says: WAL, a wait, or the end of its timeline (it then connects again and follows
the next one). An error (its term's WAL cut, WAL not stored there) or the safekeeper's crash ends the
connection; it connects again later, maybe to another safekeeper. The checker sees every piece of WAL
sent (invariants 5 and 6).

As the reader process (safekeeper/readerprocess.py) does, a reader decides on a snapshot of the
safekeeper's state that may be older than the safekeeper (pushed to the process, which may not have
taken the latest push yet), reads the disk as it is now, and throws the read away when the cut
generation, written before each cut, is no longer its snapshot's; it then waits for a newer snapshot.
A connection starts on a fresh one, as the pin's answer carries it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.consensus.acceptor import Acceptor
from sidecar.consensus.reading import ReadCursor, ReadRefused, Send, ServerState, TimelineDone
from sidecar.pgrepl import timeline_of
from sidecar.sim.checker import Checker
from sidecar.sim.context import Context
from sidecar.sim.nodes import SimSafekeeper
from sidecar.sim.wal import parse_chain

MAX_READERS = 3


@dataclass(eq=False)
class SimReader:
    """What one reader holds: WAL from `base`, whole records up to `ends[-1]`, and its connection."""

    name: str
    base: int = 0  # 0 until its first connection
    data: bytearray = field(default_factory=bytearray)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    parsed: int = 0  # offset in data the record walk reached
    sk: SimSafekeeper | None = None
    acceptor: Acceptor | None = None  # the process it is connected to: a restart ends the connection
    cursor: ReadCursor | None = None
    snapshot: ServerState | None = None  # what the reader process was last told of the safekeeper

    @property
    def resume_lsn(self) -> int:
        """Where it asks to start: the end of its last complete record (a standby's replay position)."""
        return self.ends[-1] if self.ends else self.base

    def cut_to_records(self) -> None:
        """Drop bytes past the last complete record: a standby re-requests them from its replay position."""
        del self.data[self.resume_lsn - self.base:]
        self.parsed = len(self.data)

    def receive(self, lsn: int, data: bytes) -> list[tuple[int, int]]:
        """Append WAL sent at `lsn`; the (start, end) of every record it completes."""
        assert lsn == self.base + len(self.data), (lsn, self.base, len(self.data))
        self.data += data
        k = len(self.ends)
        prev = self.starts[-1] if self.starts else None
        self.parsed, _ = parse_chain(self.data, self.base, self.parsed, prev, self.starts, self.ends)
        return list(zip(self.starts[k:], self.ends[k:]))


def server_state(sk: SimSafekeeper) -> ServerState | None:
    """What `Safekeeper.reader_state()` publishes, for the simulated safekeeper (None while it is down)."""
    acc = sk.acceptor
    if acc is None:
        return None
    s = acc.state
    return ServerState(s.term, acc.flush_lsn, s.commit_lsn, acc.cut_generation, s.timeline or 1,
                       s.timeline_history, sk.disk.start, tuple(acc.cuts))


class Readers:
    """Every reader of the run, and what can happen to them."""

    def __init__(self, ctx: Context, checker: Checker, safekeepers: list[SimSafekeeper]) -> None:
        self.ctx = ctx
        self.checker = checker
        self.safekeepers = safekeepers
        self.all: list[SimReader] = []

    def _disconnect(self, r: SimReader, why: str) -> None:
        self.ctx.event(r.name, "disconnected", why)
        r.sk = r.acceptor = r.cursor = r.snapshot = None

    # ---- scheduled events ------------------------------------------------------------------------

    def connect(self) -> bool:
        """An idle reader (or a new one) connects to a safekeeper that is up and stores WAL."""
        rng = self.ctx.rng
        idle = [r for r in self.all if r.cursor is None]
        if not idle and len(self.all) < MAX_READERS:
            idle = [SimReader(f"R{len(self.all) + 1}")]
            self.all.append(idle[0])
        up = [sk for sk in self.safekeepers if sk.acceptor is not None and sk.disk.start is not None]
        if not idle or not up:
            return False
        r, sk = rng.choice(idle), rng.choice(up)
        s = server_state(sk)
        assert s is not None and s.first_lsn is not None
        if not r.base:
            r.base = s.first_lsn
        r.cut_to_records()
        start = r.resume_lsn
        timeline = timeline_of(s.history, s.timeline, start)
        try:
            r.cursor = ReadCursor(start, timeline, s)
        except ReadRefused as e:
            self.ctx.count("reader requests refused")
            self.ctx.event(r.name, "refused by", sk.name, str(e))
            return True
        r.sk, r.acceptor, r.snapshot = sk, sk.acceptor, s
        self.ctx.count("reader connections")
        self.ctx.event(r.name, "reads from", sk.name, start, f"timeline={timeline}")
        return True

    def read(self) -> bool:
        """A connected reader takes the next step its cursor allows."""
        live = [r for r in self.all if r.cursor is not None]
        if not live:
            return False
        r = self.ctx.rng.choice(live)
        sk, cursor = r.sk, r.cursor
        assert sk is not None and cursor is not None
        if sk.acceptor is None or sk.acceptor is not r.acceptor:
            self._disconnect(r, f"{sk.name} went down")
            return True
        if self.ctx.rng.random() < 0.5 or r.snapshot is None:  # the latest push has reached the reader process
            r.snapshot = server_state(sk)
        s = r.snapshot
        assert s is not None and sk.acceptor is not None
        try:
            step = cursor.next(s)
        except ReadRefused as e:
            self.ctx.count("readers cut off by a new term")
            self._disconnect(r, str(e))
            return True
        if type(step) is Send:
            if self.ctx.cfg.reader_cut_check and sk.acceptor.cut_generation != s.generation:
                # Read, then thrown away: the generation written before a cut is not the snapshot's.
                self.ctx.count("reads thrown away after a cut")
                r.snapshot = server_state(sk)
                return True
            self.checker.served(r.name, sk, step.start, step.end)
            data = sk.disk.read(step.start, step.end)
            cursor.advance(step.end)
            self.ctx.count("WAL pieces sent to readers")
            records = r.receive(step.start, data)
            self.checker.reader_records(r.name, records, r.data, r.base)
            return True
        if type(step) is TimelineDone:
            self.ctx.count("reader timelines ended")
            self._disconnect(r, f"timeline {cursor.timeline} ends at {step.switch_lsn:#x}; "
                                f"timeline {step.next_timeline} follows")
            return True
        return False  # Wait: nothing to send until the positions move

"""An in-memory cluster: one Proposer and several Acceptors joined by FIFO message queues.

The harness executes the actions of both state machines the way the services do:
acceptor `Write`s go to an in-memory byte store that becomes durable on `fsync`,
`Truncate` cuts it, `Persist` records the last persisted state, `Reply`/`Send` messages
are queued per connection and delivered one at a time, in an order the test (or a seeded
random generator) chooses. `FetchWal` is served from the primary's WAL.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from sidecar.consensus.acceptor import (
    Acceptor, AcceptorAction, AcceptorError, Persist, RecordEnd, Reply, Truncate, Write,
)
from sidecar.consensus.messages import (
    Append, Elected, ElectedReply, Greeting, Message, Refusal, VoteReply, VoteRequest,
)
from sidecar.consensus.proposer import (
    Action, FetchWal, Note, Proposer, ReportStatus, Send, StartStreaming, TermLost, VerifyPrimary,
)
from sidecar.consensus.state import AcceptorState


class HarnessError(AssertionError):
    """The core asked the harness to do something a real service could not do."""


@dataclass
class Store:
    """WAL bytes [start, start + len(data)); bytes below `durable` survive a crash."""

    start: int = 0
    data: bytearray = field(default_factory=bytearray)
    durable: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.data)

    @property
    def empty(self) -> bool:
        return not self.data and self.start == 0

    def write(self, lsn: int, data: bytes) -> None:
        if lsn != self.end:
            raise HarnessError(f"write at {lsn} does not continue the store ending at {self.end}")
        self.data += data

    def truncate(self, lsn: int) -> None:
        if self.empty:
            self.start = self.durable = lsn
            return
        if not self.start <= lsn <= self.end:
            raise HarnessError(f"truncate at {lsn} outside the stored WAL [{self.start}, {self.end}]")
        del self.data[lsn - self.start:]
        self.durable = min(self.durable, lsn)

    def fsync(self) -> None:
        self.durable = self.end

    def read(self, start: int, end: int) -> bytes:
        if not self.start <= start <= end <= self.end:
            raise HarnessError(f"read [{start}, {end}) outside the stored WAL [{self.start}, {self.end})")
        return bytes(self.data[start - self.start:end - self.start])


@dataclass
class Node:
    name: str
    acceptor: Acceptor
    store: Store = field(default_factory=Store)
    persisted: AcceptorState = field(default_factory=AcceptorState)
    persist_count: int = 0
    truncations: list[int] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    connected: bool = False
    to_acceptor: deque[Message] = field(default_factory=deque)
    to_proposer: deque[Message] = field(default_factory=deque)


class Cluster:
    def __init__(self, proposer: Proposer, names: tuple[str, ...], primary_start: int,
                 seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.nodes = {n: Node(n, Acceptor(i + 1, AcceptorState(), 0)) for i, n in enumerate(names)}
        self.proposer = proposer
        # The primary's WAL: the source of every byte.
        self.primary_start = primary_start
        self.primary = bytearray()
        self.fetch_chunk = 4096
        self.auto_verify = True
        self.actions: list[Action] = []  # every proposer action, in order
        self.reports: list[ReportStatus] = []
        self.verify: list[VerifyPrimary] = []
        self.streaming: list[StartStreaming] = []
        self.term_lost: list[TermLost] = []
        self.fetches: list[FetchWal] = []
        self.primary_refusals: list[str] = []
        self.stream_pos: int | None = None  # next LSN the primary sends over replication
        self.stream_piece = 8192

    # ---- the primary ------------------------------------------------------------------------

    @property
    def primary_end(self) -> int:
        return self.primary_start + len(self.primary)

    def primary_rewrite_from(self, lsn: int) -> None:
        """The primary crashed and discarded its WAL from `lsn` (it will write new WAL there)."""
        del self.primary[lsn - self.primary_start:]

    def check_primary(self, v: VerifyPrimary) -> str | None:
        """The safety check against the primary: it must hold the donor's WAL up to E."""
        if self.primary_end < v.start_lsn:
            return f"the primary ends at {self.primary_end}, below E {v.start_lsn}"
        store = self.nodes[v.donor].store
        if store.empty:
            return None
        lo = max(store.start, self.primary_start)
        if store.read(lo, v.start_lsn) != self.primary_read(lo, v.start_lsn):
            return f"the primary's WAL differs from the donor's below E {v.start_lsn}"
        return None

    def primary_read(self, start: int, end: int) -> bytes:
        return bytes(self.primary[start - self.primary_start:end - self.primary_start])

    def produce(self, data: bytes) -> None:
        """The primary writes `data` and, once streaming, the proposer receives it."""
        self.primary += data
        self._send_primary_wal(self.primary_end)

    def _send_primary_wal(self, upto: int) -> None:
        """Stream the primary's WAL [stream_pos, upto) in pieces, while the stream lasts."""
        while self.stream_pos is not None and self.stream_pos < upto:
            lsn = self.stream_pos
            n = min(self.stream_piece, upto - lsn)
            self.stream_pos = lsn + n
            self.execute(self.proposer.wal_received(lsn, self.primary_read(lsn, lsn + n)))

    # ---- connections ------------------------------------------------------------------------

    def new_proposer(self, proposer: Proposer) -> None:
        """The old proposer is gone: every connection it had is closed."""
        for node in self.nodes.values():
            node.connected = False
            node.to_acceptor.clear()
            node.to_proposer.clear()
        self.proposer = proposer
        self.stream_pos = None

    def connect(self, name: str) -> None:
        node = self.nodes[name]
        node.connected = True
        node.to_acceptor.clear()
        node.to_proposer.clear()
        self.execute(self.proposer.peer_connected(name))

    def crash(self, name: str) -> None:
        """The safekeeper restarts: unsynced WAL is lost, state comes from the control file."""
        node = self.nodes[name]
        if node.connected:
            self.disconnect(name)
        del node.store.data[node.store.durable - node.store.start:]
        write_lsn = 0 if node.store.empty else node.store.end
        node.acceptor = Acceptor(node.acceptor.node_id, node.persisted, write_lsn)

    def disconnect(self, name: str) -> None:
        node = self.nodes[name]
        node.connected = False
        node.to_acceptor.clear()
        node.to_proposer.clear()
        self.execute(self.proposer.peer_disconnected(name))

    # ---- delivery ---------------------------------------------------------------------------

    def pending(self) -> list[tuple[str, str]]:
        """Deliverable steps: (node, 'to_acceptor' | 'to_proposer' | 'fsync')."""
        steps: list[tuple[str, str]] = []
        for n, node in self.nodes.items():
            if not node.connected:
                continue
            if node.to_acceptor:
                steps.append((n, "to_acceptor"))
            if node.to_proposer:
                steps.append((n, "to_proposer"))
            if node.store.durable < node.store.end:
                steps.append((n, "fsync"))
        return steps

    def step(self, name: str, kind: str) -> None:
        node = self.nodes[name]
        if kind == "to_acceptor":
            self._deliver_to_acceptor(node, node.to_acceptor.popleft())
        elif kind == "to_proposer":
            self.execute(self.proposer.peer_message(name, node.to_proposer.popleft()))
        elif kind == "fsync":
            self.fsync(name)
        else:
            raise ValueError(kind)

    def run(self, max_steps: int = 10_000_000) -> None:
        """Deliver everything in a random order (FIFO per connection) until quiet."""
        for _ in range(max_steps):
            steps = self.pending()
            if not steps:
                return
            self.step(*self.rng.choice(steps))
        raise HarnessError("the cluster did not go quiet")

    def run_in_order(self) -> None:
        """Deliver everything, always taking the first deliverable step."""
        while steps := self.pending():
            self.step(*steps[0])

    def fsync(self, name: str) -> None:
        node = self.nodes[name]
        node.store.fsync()
        self._run_acceptor(node, node.acceptor.on_flushed(node.store.durable))

    # ---- acceptor side ----------------------------------------------------------------------

    def _record_end(self, node: Node) -> RecordEnd:
        # Before a vote or Elected the safekeeper flushes what it has; every write is whole records.
        node.store.fsync()
        return RecordEnd(node.store.durable if not node.store.empty else 0)

    def _deliver_to_acceptor(self, node: Node, msg: Message) -> None:
        a = node.acceptor
        try:
            match msg:
                case Greeting():
                    actions = a.on_greeting(msg)
                case VoteRequest():
                    actions = a.on_vote(msg, self._record_end(node))
                case Elected():
                    actions = a.on_elected(msg, self._record_end(node))
                case Append():
                    actions = a.on_append(msg)
                case _:
                    raise HarnessError(f"unexpected message for an acceptor: {msg!r}")
        except AcceptorError as e:
            node.refusals.append(str(e))
            node.to_acceptor.clear()
            node.to_proposer.append(Refusal(str(e)))
            return
        self._run_acceptor(node, actions)

    def _run_acceptor(self, node: Node, actions: list[AcceptorAction]) -> None:
        for act in actions:
            match act:
                case Persist():
                    node.persisted = act.state
                    node.persist_count += 1
                case Truncate():
                    node.truncations.append(act.lsn)
                    node.store.truncate(act.lsn)
                case Write():
                    # Invariant 3: WAL is accepted only from the term this safekeeper promised.
                    if node.acceptor.elected_term != node.persisted.term:
                        raise HarnessError(f"{node.name} writes WAL of term {node.acceptor.elected_term} "
                                           f"while promised to term {node.persisted.term}")
                    node.store.write(act.lsn, act.data)
                case Reply():
                    self._check_durable_before_reply(node, act.message)
                    if node.connected:
                        node.to_proposer.append(act.message)
                case _:
                    raise HarnessError(f"unknown acceptor action {act!r}")

    @staticmethod
    def _check_durable_before_reply(node: Node, msg: Message) -> None:
        """A vote or Elected is answered only once the state behind it is persisted."""
        p = node.persisted
        if isinstance(msg, VoteReply) and msg.granted and p.term < msg.term:
            raise HarnessError(f"{node.name} granted term {msg.term} before persisting it (persisted {p.term})")
        if isinstance(msg, ElectedReply) and msg.term == node.acceptor.elected_term:
            last = p.term_history[-1].term if p.term_history else 0
            if last != msg.term:
                raise HarnessError(f"{node.name} answered Elected({msg.term}) before persisting its history")

    # ---- proposer side ----------------------------------------------------------------------

    def execute(self, actions: list[Action]) -> None:
        """Carry out proposer actions (and whatever they lead to on the proposer's side)."""
        work = deque(actions)
        while work:
            act = work.popleft()
            self.actions.append(act)
            match act:
                case Send():
                    node = self.nodes[act.peer]
                    if node.connected:
                        node.to_acceptor.append(act.message)
                case VerifyPrimary():
                    self.verify.append(act)
                    if self.auto_verify:
                        problem = self.check_primary(act)
                        if problem:
                            self.primary_refusals.append(problem)
                        work.extend(self.proposer.primary_refused(problem) if problem
                                    else self.proposer.primary_verified())
                case StartStreaming():
                    self.streaming.append(act)
                    self.stream_pos = act.start_lsn
                    self._send_primary_wal(self.primary_end)
                case ReportStatus():
                    self.reports.append(act)
                case FetchWal():
                    self.fetches.append(act)
                    lsn = act.start
                    while lsn < act.end:
                        n = min(self.fetch_chunk, act.end - lsn)
                        work.extend(self.proposer.catchup_data(act.peer, lsn, self.primary_read(lsn, lsn + n)))
                        lsn += n
                    work.extend(self.proposer.catchup_done(act.peer))
                case TermLost():
                    self.term_lost.append(act)
                    self.stream_pos = None  # the service ends the replication stream
                case Note():
                    pass
                case _:
                    raise HarnessError(f"unknown proposer action {act!r}")

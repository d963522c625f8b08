"""The simulated processes and links, as state: a safekeeper, a connection, a proposer service.

What they do lives with their actor (`safekeepers`, `network`, `services`); the checker reads
these records and nothing else.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import cast

from sidecar.consensus.acceptor import Acceptor, RecordEnd
from sidecar.consensus.degraded import DegradedCarry
from sidecar.consensus.groupcommit import GroupCommit
from sidecar.consensus.messages import Message
from sidecar.consensus.proposer import FetchWal, Proposer, ReportStatus, VerifyPrimary
from sidecar.consensus.session import AcceptorSession
from sidecar.consensus.state import AcceptorState
from sidecar.consensus.statusschedule import StatusSchedule
from sidecar.sim.wal import Disk, Primary


# The simulator's clock is its step count: the oldest unsynced byte waits at most this many steps.
SIM_MAX_DELAY = 4


@dataclass(eq=False)
class SimSafekeeper:
    """One safekeeper process: its disk and control file survive a crash, its acceptor does not."""

    name: str
    node_id: int
    disk: Disk = field(default_factory=Disk)
    persisted: AcceptorState = field(default_factory=AcceptorState)  # the control file
    wiped: bool = False  # its disk was lost: no control file until the acceptor persists one
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
        return cast(Connection, owner.conn) if isinstance(owner, AcceptorSession) else None

    def changed(self) -> None:
        self.version += 1


@dataclass(eq=False)
class Connection:
    """One TCP connection: FIFO both ways; each end closes on its own and sees EOF later."""

    label: str
    sender: str  # label of the Proposer instance this connection was opened for
    svc: Service | None  # None for a hostile connection that belongs to no proposer
    sk: SimSafekeeper
    slow: bool
    session: AcceptorSession
    to_sk: deque[Message] = field(default_factory=deque)
    to_prop: deque[Message] = field(default_factory=deque)
    prop_open: bool = True
    sk_open: bool = True
    # The proposer closed its writer at the end of a term but its reader still holds
    # replies already received, which the next term's core will read before the EOF.
    lingering: bool = False
    # The safekeeper's thread for this connection (proposerport.py), between the steps of one
    # message: group commit's policy, a sync it decided on, the flush it got and has yet to
    # acknowledge under the lock, a vote's scan not yet applied (only with the one-step rule off).
    commit: GroupCommit = field(default_factory=lambda: GroupCommit(max_delay=SIM_MAX_DELAY))
    sync_wanted: bool = False
    flushed: int | None = None
    scanned: tuple[Message, RecordEnd] | None = None

    @property
    def busy(self) -> bool:
        """True while its thread is between the steps of one message: it reads nothing meanwhile."""
        return self.sync_wanted or self.flushed is not None or self.scanned is not None

    @property
    def carries_replies(self) -> bool:
        return self.prop_open and self.sk_open and not self.lingering


@dataclass(eq=False)
class Stream:
    """The replication stream from the primary to one term's core."""

    start: int
    pos: int
    flushed: int = 0  # highest flush reported back on it
    # When a status goes back to the primary, as the real stream decides it; time is the step number. A
    # write or apply alone waits a few steps; repeating the positions without news checks nothing here.
    schedule: StatusSchedule = field(
        default_factory=lambda: StatusSchedule(delay=3, keepalive_interval=float("inf")))


@dataclass(eq=False)
class Fetch:
    """A catch-up of one safekeeper from the primary's WAL: [pos, end) still to send."""

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
    # A `walsidecar failover` (sim/failovers.py): its core runs a fence term for the standby `primary`,
    # streams nothing, recovers voters from `donor`, and is not restarted when its term ends.
    fence: bool = False
    donor: str = ""
    # degrade-after: the open range the next core must close; a failover's gate and whether its last broker
    # transaction went through.
    carry: DegradedCarry | None = None
    gate_final: bool | None = None
    closing: set = field(default_factory=set)  # ranges its cores closed (a delete may still be queued)

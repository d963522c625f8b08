"""The proposer's state machine, sans IO: election, term start, fan-out and the commit rule.

"Proposer" is the protocol role; this module plays it inside the core, and `sidecar.proposer`
(the package) runs it as a process, as `consensus.acceptor` and `sidecar.safekeeper` do for
the safekeeper's role.

One instance lives for one term attempt: a new replication stream from the primary is a
new term, so the service builds a new `Proposer` (with `min_term`) after a stream ends.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, ClassVar

from sidecar.consensus import codec, degraded, limits, lineage
from sidecar.consensus import history as hist
from sidecar.consensus.degraded import DegradedCarry
from sidecar.consensus.messages import (
    NO_DEGRADED, NO_FENCE, PROTOCOL_VERSION, Append, AppendReply, DegradedRange, DegradedRecord,
    DegradedRecordReply, Elected, ElectedReply, Greeting, GreetingReply, Message, Refusal, TermHistory,
    TimelineFence, VoteReply, VoteRequest,
)
from sidecar.timelines import TimelineHistory
from sidecar.consensus.quorum import quorum_position
from sidecar.consensus.walbuffer import WalBuffer

MAX_APPEND = 1024 * 1024


class FailoverTerm(enum.Enum):
    """What a term does to the failover fence (consensus/lineage.py)."""

    NONE = "none"  # a primary's term: carries the voters' latest fence on, and stops if it fences this primary
    END = "end"  # `failover`'s fence term: ends the voters' timeline at the term start, before promoting
    LIFT = "lift"  # `failover --undo`: lifts the fence of a failover that never promoted


@dataclass(frozen=True)
class ProposerConfig:
    proposer_id: str
    peers: tuple[str, ...]
    quorum: int
    system_id: int
    timeline: int
    wal_seg_size: int
    pg_version: int
    bootstrap_lsn: int  # where the first term starts when every safekeeper is empty
    # The primary's timeline switches (its TIMELINE_HISTORY), sent with Elected to every safekeeper.
    timeline_history: TimelineHistory = ()
    max_inflight: int = 32 * 1024 * 1024
    # Beyond this a lagging safekeeper is fed from the primary's pg_wal instead of memory.
    buffer_limit: int = 64 * 1024 * 1024
    failover: FailoverTerm = FailoverTerm.NONE
    # --commit-wait degrade-after=T: seconds the quorum commit may stall before acknowledging with the
    # safekeepers that are up (0: never; consensus/degraded.py). Time comes from the service (`tick`).
    degrade_after: float = 0.0
    # An open degraded range this core must close before it may degrade on its own.
    carried: DegradedCarry | None = None
    # A failover's term (FailoverTerm.END): the open range the broker holds, which its votes must cover.
    gate: DegradedRange = NO_DEGRADED


# Actions the service executes.
@dataclass(frozen=True)
class Send:
    peer: str
    message: Message


@dataclass(frozen=True)
class VerifyPrimary:
    """Check that the primary holds the donor's WAL up to `start_lsn`, then call back."""

    term: int
    start_lsn: int
    donor: str
    tail_lsn: int
    tail_crc: int
    timeline_history: TimelineHistory


@dataclass(frozen=True)
class StartStreaming:
    start_lsn: int


@dataclass(frozen=True)
class ReportStatus:
    write_lsn: int
    flush_lsn: int
    apply_lsn: int


@dataclass(frozen=True)
class FetchWal:
    """`peer` needs WAL [start, end) that is no longer (or not yet) in the buffer."""

    peer: str
    start: int
    end: int


@dataclass(frozen=True)
class TermLost:
    term: int
    reason: str


@dataclass(frozen=True)
class LineageEnded:
    """A failover ended this primary's timeline and promoted a standby: this primary must never stream again.

    Retrying cannot fix it; rejoining the primary as a standby, or undoing a failover that never
    promoted, does. Its commits are never acknowledged.
    """

    term: int
    fence: TimelineFence
    reason: str


@dataclass(frozen=True)
class GreetingsRefused:
    """So many safekeepers refuse our greeting that no quorum can form: stop and say why.

    A refused greeting is a static mismatch (another cluster's primary, another segment size,
    major version or protocol version); retrying does not fix it, an operator must.
    """

    reasons: dict[str, str]  # peer -> the safekeeper's reason


@dataclass(frozen=True)
class DropPeer:
    """`peer` broke the protocol (a position it cannot hold, a field out of bounds): close its link.

    The link reconnects and greets afresh; nothing the peer said in the bad reply was adopted.
    """

    peer: str
    reason: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TermsExhausted:
    """The next term would exceed limits.MAX_TERM: no election is possible, an operator must act."""

    term: int  # the highest term seen
    peer: str | None  # the safekeeper that reported it, if one did


@dataclass(frozen=True)
class StoreDegraded:
    """Record `record` durably in the broker, in place of `previous` (NO_DEGRADED: where no range is open), then
    call `degraded_stored(record.version)`: no acknowledgement above the quorum is made before that call."""

    record: DegradedRange
    previous: DegradedRange = NO_DEGRADED


@dataclass(frozen=True)
class CloseDegraded:
    """A quorum holds every acknowledgement of `record`: delete it from the broker if it is still that version."""

    record: DegradedRange


@dataclass(frozen=True)
class GateRefused:
    """A failover's votes do not cover an open degraded range: starting a new timeline could lose commits."""

    term: int
    record: DegradedRange
    reason: str


# Events: what happened, for the service's log and the observers. Each names itself in the log.
@dataclass(frozen=True)
class ProposerEvent:
    name: ClassVar[str]
    level: ClassVar[str] = "info"  # the log level the services say it at

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclass_fields(self)}


@dataclass(frozen=True)
class Campaign(ProposerEvent):
    name: ClassVar[str] = "campaign"
    term: int


@dataclass(frozen=True)
class ElectionWon(ProposerEvent):
    name: ClassVar[str] = "elected"
    term: int
    donor: str
    start_lsn: int
    voters: list[str]  # sorted; a list, as the log line has always shown it


@dataclass(frozen=True)
class Streaming(ProposerEvent):
    name: ClassVar[str] = "streaming"
    term: int
    start_lsn: int


@dataclass(frozen=True)
class TermEnded(ProposerEvent):
    name: ClassVar[str] = "term ended"
    term: int
    commit_lsn: int


@dataclass(frozen=True)
class PeerJoined(ProposerEvent):
    """A safekeeper acknowledged our Elected: it is in the term from `flush_lsn` on."""

    name: ClassVar[str] = "safekeeper joined term"
    peer: str
    term: int
    flush_lsn: int


@dataclass(frozen=True)
class VoteWithheld(ProposerEvent):
    """A safekeeper promised our term without granting it: it lost its disk, learned `lost_disk_term` from its
    peers, and votes again once its WAL holds the start of a later term. It is sent Elected once we are elected."""

    name: ClassVar[str] = "vote withheld: the safekeeper lost its disk and may lack commits; it is caught up in our term"
    level: ClassVar[str] = "warning"
    peer: str
    term: int
    lost_disk_term: int


@dataclass(frozen=True)
class PrimaryRefused(ProposerEvent):
    name: ClassVar[str] = "primary refused"
    term: int
    reason: str


@dataclass(frozen=True)
class UnexpectedMessage(ProposerEvent):
    name: ClassVar[str] = "unexpected message"
    peer: str
    message: str  # its type's name


@dataclass(frozen=True)
class DegradeBegan(ProposerEvent):
    """No quorum for `after` seconds: from `start_lsn` on, commits are acknowledged by `members` once recorded."""

    name: ClassVar[str] = "degraded: acknowledging commits without a quorum of safekeepers once the range is recorded"
    level: ClassVar[str] = "warning"
    term: int
    start_lsn: int
    members: list[str]
    after: float


@dataclass(frozen=True)
class DegradeMembers(ProposerEvent):
    """The members of the open range changed: a new version, recorded before the next degraded acknowledgement."""

    name: ClassVar[str] = "degraded range members changed"
    level: ClassVar[str] = "warning"
    term: int
    version: int
    members: list[str]


@dataclass(frozen=True)
class DegradeEnded(ProposerEvent):
    """A quorum holds every degraded acknowledgement of the range of `range_term` (`commit_lsn`): it is closed."""

    name: ClassVar[str] = "degraded range closed: a quorum holds every acknowledged commit again"
    level: ClassVar[str] = "warning"
    term: int
    range_term: int
    commit_lsn: int


Action = (Send | VerifyPrimary | StartStreaming | ReportStatus | FetchWal | TermLost | LineageEnded
          | GreetingsRefused | DropPeer | TermsExhausted | StoreDegraded | CloseDegraded | GateRefused
          | ProposerEvent)


class Phase(enum.Enum):
    GREETING = "greeting"
    PROBING = "probing"  # collecting logs with VoteRequest(0): promises nothing, persists nothing
    PRECHECK = "precheck"  # checking the primary against the probed donor before any vote
    VOTING = "voting"
    VERIFYING = "verifying"
    STREAMING = "streaming"
    STOPPED = "stopped"


@dataclass
class PeerState:
    name: str
    connected: bool = False
    greeted_term: int | None = None
    node_id: int | None = None
    reader_port: int = 0  # where it serves WAL to readers, from its greeting (0: nowhere)
    vote: VoteReply | None = None
    withheld: VoteReply | None = None  # a vote in our term withheld by a lost disk: sent Elected once we win
    probe: VoteReply | None = None
    elected: bool = False  # Elected acknowledged on the current connection
    flush_lsn: int = 0  # flushed, as acknowledged in this term
    sent_lsn: int = 0
    sent_max: int = 0  # the end of all WAL sent to it in this term, on any connection
    fetching: bool = False
    refused: str | None = None  # why it refused our greeting; survives reconnects, cleared by a reply
    degraded_version: int = -1  # the version of our degraded range it stored on this connection (-1: none)


class Proposer:
    def __init__(self, config: ProposerConfig, min_term: int = 0) -> None:
        self.config = config
        self.min_term = min_term
        self.term = 0
        self.phase = Phase.GREETING
        self.peers = {name: PeerState(name) for name in config.peers}
        self.term_start = 0
        self.history: TermHistory = ()
        self.fence = NO_FENCE  # the fence this term's Elected carries (sets, in a failover's term)
        self.commit_lsn = 0
        self.buffer: WalBuffer | None = None
        self._reported = (0, 0, 0)
        self._checked: tuple[int, int, int] | None = None  # (start, tail_lsn, tail_crc) the primary passed
        self._precheck: tuple[int, int, int] | None = None
        self._highest: tuple[int, str | None] = (min_term, None)  # highest term seen, and who reported it
        # --commit-wait degrade-after (consensus/degraded.py): the open range of this term (maybe not yet
        # recorded), the version the broker confirmed, the members by node id, the highest degraded report,
        # and since when (the service's clock) the quorum commit stalled where.
        self.degraded = NO_DEGRADED
        self._stored = 0
        # Versions only grow in this core, over every range it opens (and above an inherited one): a member's reply
        # names the version it stored, and must never be taken for another range's.
        self._version = config.carried.record.version if config.carried else 0
        self._members: dict[int, str] = {}
        self._degraded_high = 0
        self._stall: tuple[int, float] | None = None
        self.carried = config.carried
        self.gate_waiting: str | None = None  # why a failover's term waits for more votes
        self._gate = config.gate  # a failover's: the range its votes must cover, until E is on a quorum

    # ---- events -------------------------------------------------------------------------

    def peer_connected(self, name: str) -> list[Action]:
        p = self._reset(name)
        p.connected = True
        c = self.config
        return self._member_left(name) + [Send(name, Greeting(PROTOCOL_VERSION, c.proposer_id, c.system_id,
                                                              c.timeline, c.wal_seg_size, c.pg_version, len(c.peers)))]

    def peer_disconnected(self, name: str) -> list[Action]:
        # Flushes acknowledged in this term stay valid: only a later term can truncate them.
        self._reset(name)
        return self._member_left(name)

    def peer_message(self, name: str, msg: Message) -> list[Action]:
        p = self.peers[name]
        if not p.connected or self.phase is Phase.STOPPED:
            return []
        try:
            codec.check_bounds(msg)  # the codec's checks, also when the core is driven without it
        except limits.LimitError as e:
            return self._drop(p, f"{type(msg).__name__}: {e}")
        match msg:
            case GreetingReply():
                return self._on_greeting(p, msg)
            case VoteReply():
                return self._on_vote(p, msg)
            case ElectedReply():
                return self._on_elected_reply(p, msg)
            case AppendReply():
                return self._on_append_reply(p, msg)
            case DegradedRecordReply():
                return self._on_degraded_reply(p, msg)
            case Refusal():
                return self._on_refusal(p, msg)
        return [UnexpectedMessage(name, type(msg).__name__)]

    def election_timeout(self) -> list[Action]:
        """No quorum of votes in time: try again one term higher."""
        if self.phase is not Phase.VOTING:
            return []
        return self._campaign(self.term + 1)

    def primary_verified(self) -> list[Action]:
        if self.phase is Phase.PRECHECK:
            self._checked = self._precheck
            # Every peer may have disconnected during the check: campaign anyway; a peer that
            # greets again is asked for its vote then (and a higher term restarts the campaign).
            greeted = [q.greeted_term for q in self.peers.values() if q.greeted_term is not None]
            return self._campaign(max(max(greeted, default=0), self.min_term) + 1)
        if self.phase is not Phase.VERIFYING:
            return []
        return self._start_streaming()

    def _start_streaming(self) -> list[Action]:
        self.phase = Phase.STREAMING
        self.buffer = WalBuffer(self.term_start)
        actions: list[Action] = [Streaming(self.term, self.term_start), StartStreaming(self.term_start)]
        for p in self.peers.values():
            if p.connected and p.vote is None and p.withheld is not None:
                p.vote = p.withheld  # not counted (we are elected already): what its Elected reply is held to
            if p.connected and p.vote is not None:
                actions.append(self._elected_msg(p))
        return actions

    def primary_refused(self, reason: str) -> list[Action]:
        self.phase = Phase.STOPPED
        return [PrimaryRefused(self.term, reason)]

    def wal_received(self, lsn: int, data: bytes) -> list[Action]:
        if self.buffer is None or self.phase is not Phase.STREAMING:
            return []  # the stream of an ended term may still deliver a batch before it closes
        self.buffer.append(lsn, data)
        actions: list[Action] = []
        for p in self.peers.values():
            actions += self._pump(p)
        # Bounded even when no safekeeper answers; whoever was not sent the WAL forgotten here
        # reads it from the primary's pg_wal when its window opens.
        self.buffer.bound(self.config.buffer_limit)
        return actions

    def catchup_data(self, name: str, lsn: int, data: bytes) -> list[Action]:
        """WAL fetched for one lagging peer (see `FetchWal`)."""
        p = self.peers[name]
        if not (p.elected and p.fetching and lsn == p.sent_lsn and data):
            return []
        p.sent_lsn += len(data)
        p.sent_max = max(p.sent_max, p.sent_lsn)
        return [Send(name, self._append(p.sent_lsn - len(data), data))]

    def catchup_done(self, name: str) -> list[Action]:
        p = self.peers[name]
        p.fetching = False
        return self._pump(p)

    def heartbeat(self) -> list[Action]:
        """Empty Appends carry commit_lsn and keep idle safekeepers informed."""
        if self.phase is not Phase.STREAMING:
            return []
        return [Send(p.name, self._append(p.sent_lsn, b"")) for p in self.peers.values()
                if p.elected and not p.fetching]

    def stream_ended(self) -> list[Action]:
        self.phase = Phase.STOPPED
        return [TermEnded(self.term, self.commit_lsn)]

    # ---- degrade-after (consensus/degraded.py) ------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        """The service's clock: degrade once the quorum commit stalled below the WAL we hold for degrade_after."""
        after = self.config.degrade_after
        if not after or self.phase is not Phase.STREAMING or self.buffer is None or self.degraded or self.carried:
            self._stall = None
            return []
        if self.commit_lsn >= self.buffer.end:
            self._stall = None
            return []
        if self._stall is None or self._stall[0] != self.commit_lsn:
            self._stall = (self.commit_lsn, now)
            return []
        if now - self._stall[1] < after:
            return []
        start = self.commit_lsn
        members = {p.node_id: p.name for p in self.peers.values()
                   if p.elected and p.node_id is not None and self._in_term(p) >= start}
        if not members:
            return []  # nobody to acknowledge with: keep waiting, and try again at the next tick
        self._degraded_high = start
        return [DegradeBegan(self.term, start, sorted(members.values()), after)] + self._record(members)

    def degraded_stored(self, version: int) -> list[Action]:
        """The broker holds `version` of our open range (StoreDegraded done)."""
        if not self.degraded or version != self.degraded.version or self.phase is not Phase.STREAMING:
            return []
        self._stored = version
        return self._progress()

    def open_range(self) -> DegradedCarry | None:
        """What the next term must close: this term's open range, or the one it inherited and did not close."""
        if self.degraded:
            return DegradedCarry(self.degraded, self._degraded_high)
        return self.carried

    @property
    def degraded_confirmed(self) -> bool:
        """The latest version of the open range is recorded in the broker and on every member."""
        d = self.degraded
        return bool(d) and self._stored == d.version and all(
            self.peers[n].degraded_version == d.version for n in self._members.values())

    def _record(self, members: dict[int, str]) -> list[Action]:
        """A new version of the open range with `members`: to the broker and to every member."""
        d = self.degraded
        start = d.start_lsn if d else self.commit_lsn
        self._members = dict(members)
        self._version += 1
        self.degraded = DegradedRange(self.term, start, self._version, frozenset(members))
        return [StoreDegraded(self.degraded, d)] + [Send(n, DegradedRecord(self.term, self.degraded))
                                                     for n in sorted(members.values())]

    def _member_left(self, name: str) -> list[Action]:
        if not self.degraded or name not in self._members.values():
            return []
        members = {node: n for node, n in self._members.items() if n != name}
        return self._record(members) + [DegradeMembers(self.term, self.degraded.version, sorted(members.values()))]

    def _on_degraded_reply(self, p: PeerState, msg: DegradedRecordReply) -> list[Action]:
        if self.term == 0:
            return []
        self._saw_term(msg.term, p.name)
        if msg.term > self.term:
            return self._higher_term(msg.term, p.name)
        if msg.term < self.term or not p.elected:
            return []
        p.degraded_version = msg.version
        return self._progress()

    def _degraded_progress(self) -> list[Action]:
        """Close what a quorum now holds; take in a safekeeper that holds every degraded acknowledgement."""
        actions: list[Action] = []
        carried = self.carried
        if carried is not None and self.phase is Phase.STREAMING and self.commit_lsn >= carried.close_at:
            self.carried = None
            actions += [CloseDegraded(carried.record), DegradeEnded(self.term, carried.record.term, self.commit_lsn)]
            actions += self._clear_copies()
        d = self.degraded
        if not d:
            return actions
        if self.commit_lsn >= self._degraded_high and self.commit_lsn > d.start_lsn:
            self.degraded, self._members, self._stored, self._stall = NO_DEGRADED, {}, 0, None
            return actions + [CloseDegraded(d), DegradeEnded(self.term, d.term, self.commit_lsn)] + \
                self._clear_copies()
        position = max(self._reported[1], d.start_lsn)
        joining = {p.node_id: p.name for p in self.peers.values()
                   if p.elected and p.node_id is not None and p.name not in self._members.values()
                   and self._in_term(p) >= position}
        if joining:
            members = {**self._members, **joining}
            actions += self._record(members) + [DegradeMembers(self.term, self.degraded.version,
                                                               sorted(members.values()))]
        return actions

    def _clear_copies(self) -> list[Action]:
        return [Send(p.name, DegradedRecord(self.term, NO_DEGRADED)) for p in self.peers.values() if p.elected]

    # ---- election -------------------------------------------------------------------------

    def _on_refusal(self, p: PeerState, msg: Refusal) -> list[Action]:
        """The safekeeper closes the connection (the service logs the reason as an error)."""
        if p.greeted_term is not None:
            return []  # a refusal later in the conversation: the link reconnects and greets again
        p.refused = msg.reason
        refused = {q.name: q.refused for q in self.peers.values() if q.refused is not None}
        if len(self.peers) - len(refused) >= self.config.quorum:
            return []  # a quorum can still greet us
        self.phase = Phase.STOPPED
        return [GreetingsRefused(refused)]

    def _on_greeting(self, p: PeerState, msg: GreetingReply) -> list[Action]:
        self._saw_term(msg.term, p.name)
        p.greeted_term, p.node_id, p.refused, p.reader_port = msg.term, msg.node_id, None, msg.reader_port
        if self.phase is Phase.GREETING:
            if sum(q.greeted_term is not None for q in self.peers.values()) >= self.config.quorum:
                self.phase = Phase.PROBING
                return [Send(q.name, VoteRequest(0)) for q in self.peers.values() if q.greeted_term is not None]
            return []
        if self.phase is Phase.PROBING:
            return [Send(p.name, VoteRequest(0))]
        if self.phase is Phase.PRECHECK:
            return []  # the campaign that follows asks every greeted safekeeper
        if msg.term > self.term:
            return self._higher_term(msg.term, p.name)
        return [Send(p.name, VoteRequest(self.term))]

    def _campaign(self, term: int) -> list[Action]:
        if term > limits.MAX_TERM:
            self.phase = Phase.STOPPED
            return [TermsExhausted(*self._highest)]
        self.phase, self.term = Phase.VOTING, term
        for q in self.peers.values():
            q.vote = q.withheld = None
        return [Campaign(term)] + [
            Send(q.name, VoteRequest(term)) for q in self.peers.values() if q.greeted_term is not None]

    def _higher_term(self, term: int, peer: str) -> list[Action]:
        if self.phase is Phase.VOTING:
            return self._campaign(term + 1)
        self.phase = Phase.STOPPED
        return [TermLost(term, f"safekeeper {peer} is at term {term}, above our term {self.term}")]

    def _on_vote(self, p: PeerState, msg: VoteReply) -> list[Action]:
        self._saw_term(msg.term, p.name)
        last = msg.term_history[-1].term if msg.term_history else 0
        if last > msg.term or (msg.granted and last >= msg.term):
            # It cannot have accepted an Elected above the term it holds, nor grant a term it has written in.
            return self._drop(p, f"VoteReply for term {msg.term} (granted={msg.granted}) carries a history "
                                 f"with term {last}")
        if self.phase is Phase.PROBING:
            return self._on_probe(p, msg)
        if self.phase is Phase.PRECHECK:
            return []
        if msg.term > self.term:
            return self._higher_term(msg.term, p.name)
        if msg.term < self.term:
            return []  # a reply to an earlier campaign of ours
        withheld: list[Action] = [VoteWithheld(p.name, msg.term, msg.lost_disk_term)] \
            if msg.lost_disk_term and not msg.granted else []
        if self.phase is Phase.VOTING:
            if not msg.granted:
                if withheld:
                    p.withheld = msg
                return withheld
            p.vote = msg
            if sum(q.vote is not None for q in self.peers.values()) >= self.config.quorum:
                if self._gate and self._gate_votes_lack_member():
                    return []  # wait for a member's vote: the failover's timeout says which are missing
                return self._elect()
            return []
        # Already elected for this term: a reconnecting voter answers "not granted, same term" (or withholds
        # a vote it was asked for the first time, having lost its disk).
        p.vote = msg
        return withheld + ([self._elected_msg(p)] if self.phase is Phase.STREAMING else [])

    def _on_probe(self, p: PeerState, msg: VoteReply) -> list[Action]:
        """A quorum of logs, gathered without promises: check the primary before any vote."""
        p.probe = msg
        probed = {q.name: q.probe for q in self.peers.values() if q.probe is not None}
        if len(probed) < self.config.quorum:
            return []
        ended = self._lineage_ended(probed)
        if ended:
            return ended
        donor, reply, start = self._donor(probed)
        self._checked = None
        self._precheck = (start, reply.tail_lsn, reply.tail_crc)
        self.phase = Phase.PRECHECK
        return [VerifyPrimary(0, start, donor, reply.tail_lsn, reply.tail_crc, reply.timeline_history)]

    def _donor(self, replies: dict[str, VoteReply]) -> tuple[str, VoteReply, int]:
        """The most advanced log by (last log term, flush), and where a new term would start."""
        name = max(replies, key=lambda n: hist.donor_key(replies[n].term_history, replies[n].flush_lsn))
        reply = replies[name]
        return name, reply, reply.flush_lsn or self.config.bootstrap_lsn

    def _lineage_ended(self, replies: dict[str, VoteReply]) -> list[Action]:
        """Stop, before any promise (or before any Elected), if a failover fenced this primary out."""
        if self.config.failover is not FailoverTerm.NONE:
            return []
        c = self.config
        fence = lineage.latest(*(r.fence for r in replies.values()))
        problem = lineage.fenced_out(fence, c.timeline, c.timeline_history)
        if problem is None:
            return []
        self.phase = Phase.STOPPED
        return [LineageEnded(self.term, fence, problem)]

    def _gate_votes(self) -> dict[str, tuple[int | None, VoteReply]]:
        return {q.name: (q.node_id, q.vote) for q in self.peers.values() if q.vote is not None}

    def _gate_votes_lack_member(self) -> bool:
        votes = self._gate_votes()
        if degraded.holding_members(self._gate, votes):
            self.gate_waiting = None
            return False
        self.gate_waiting = degraded.gate_problem(self._gate, votes, 0)
        return True

    def _elect(self) -> list[Action]:
        votes = {q.name: q.vote for q in self.peers.values() if q.vote is not None}
        ended = self._lineage_ended(votes)
        if ended:
            return ended
        donor, dv, start = self._donor(votes)
        if self._gate:
            problem = degraded.gate_problem(self._gate, self._gate_votes(), start)
            if problem is not None:
                # Before any Elected: no fence is set, nothing is cut; the old primary's sidecar campaigns again.
                self.phase = Phase.STOPPED
                return [GateRefused(self.term, self._gate, problem)]
        self.fence = self._fence_of_term(votes, start)
        self.term_start = start
        self.history = hist.extend(dv.term_history if dv.flush_lsn else (), self.term, start)
        self.phase = Phase.VERIFYING
        actions: list[Action] = [ElectionWon(self.term, donor, start, sorted(votes))]
        if self._checked == (start, dv.tail_lsn, dv.tail_crc):
            return actions + self._start_streaming()  # the probe already checked this very log
        return actions + [VerifyPrimary(self.term, start, donor, dv.tail_lsn, dv.tail_crc, dv.timeline_history)]

    def _fence_of_term(self, votes: dict[str, VoteReply], start: int) -> TimelineFence:
        """The voters' latest fence, carried on; or the one a failover's term sets: the timeline of the standby it
        promotes ends at E, so that only that standby (which switches away from it at E or above) and its
        descendants stream again. Not the voters' timeline: a standby may be a sibling of it, equal below E."""
        match self.config.failover:
            case FailoverTerm.END:
                return TimelineFence(self.term, self.config.timeline, start)
            case FailoverTerm.LIFT:
                return TimelineFence(self.term)
        return lineage.latest(*(v.fence for v in votes.values()))

    def _elected_msg(self, p: PeerState) -> Send:
        c = self.config
        # An undo streams for no primary: it names no timeline, and each safekeeper keeps the one it has.
        timeline, timelines = (0, ()) if c.failover is FailoverTerm.LIFT else (c.timeline, c.timeline_history)
        return Send(p.name, Elected(self.term, self.term_start, self.history, timeline, timelines, self.fence))

    # ---- streaming ------------------------------------------------------------------------

    def _on_elected_reply(self, p: PeerState, msg: ElectedReply) -> list[Action]:
        if self.term == 0:
            return []  # a late reply to an earlier proposer on this connection
        self._saw_term(msg.term, p.name)
        if msg.term > self.term:
            return self._higher_term(msg.term, p.name)
        if msg.term < self.term or self.phase is not Phase.STREAMING:
            return []
        if p.vote is None:
            return self._drop(p, "ElectedReply without an Elected on this connection")
        if msg.flush_lsn > self._elected_cap(p, p.vote):
            return self._drop(p, "ElectedReply claims WAL beyond what it voted with",
                              flush_lsn=msg.flush_lsn, voted_flush_lsn=p.vote.flush_lsn,
                              sent_lsn=p.sent_max, term_start_lsn=self.term_start)
        p.elected = True
        p.flush_lsn = p.sent_lsn = msg.flush_lsn
        # A copy of a range closed while it was away would read as open in `check`: clear it.
        clear: list[Action] = [Send(p.name, DegradedRecord(self.term, NO_DEGRADED))] \
            if self.config.degrade_after and not self.degraded and not self.carried else []
        return [PeerJoined(p.name, self.term, msg.flush_lsn)] + clear + self._progress() + self._pump(p)

    def _on_append_reply(self, p: PeerState, msg: AppendReply) -> list[Action]:
        if self.term == 0:
            return []  # a late reply to an earlier proposer on this connection
        self._saw_term(msg.term, p.name)
        if msg.term > self.term:
            return self._higher_term(msg.term, p.name)
        if not p.elected or msg.term != self.term:
            return []
        if msg.flush_lsn > self._append_cap(p):
            return self._drop(p, "AppendReply acknowledges WAL it was never sent",
                              flush_lsn=msg.flush_lsn, sent_lsn=p.sent_lsn)
        p.flush_lsn = max(p.flush_lsn, msg.flush_lsn)
        return self._progress() + self._pump(p)

    def _pump(self, p: PeerState) -> list[Action]:
        buf = self.buffer
        if buf is None or not p.elected or p.fetching:
            return []
        if p.sent_lsn < buf.start:
            p.fetching = True
            return [FetchWal(p.name, p.sent_lsn, buf.start)]
        actions: list[Action] = []
        while p.sent_lsn < buf.end and p.sent_lsn - p.flush_lsn < self.config.max_inflight:
            data = buf.read(p.sent_lsn, MAX_APPEND)
            actions.append(Send(p.name, self._append(p.sent_lsn, data)))
            p.sent_lsn += len(data)
        p.sent_max = max(p.sent_max, p.sent_lsn)
        return actions

    def _append(self, begin: int, data: bytes) -> Append:
        return Append(self.term, begin, self.commit_lsn, self._peer_horizon_lsn(), data)

    def _in_term(self, p: PeerState) -> int:
        return p.flush_lsn if p.flush_lsn >= self.term_start else 0

    def _peer_horizon_lsn(self) -> int:
        """What every safekeeper has flushed in this term, up to commit_lsn (an Append's `peer_horizon_lsn`)."""
        return min(min(self._in_term(p) for p in self.peers.values()), self.commit_lsn)

    def _progress(self) -> list[Action]:
        """Recompute commit_lsn; report to the primary when anything moved."""
        flushes = [self._in_term(p) for p in self.peers.values()]
        commit = quorum_position(flushes, self.config.quorum, self.term_start)
        self.commit_lsn = max(self.commit_lsn, commit)
        if self.buffer is not None:
            self.buffer.trim(self._trim_point())
            self.buffer.bound(self.config.buffer_limit)
        actions = self._degraded_progress() if self.degraded or self.carried else []
        if self._gate and self.phase is Phase.STREAMING and self.commit_lsn >= self.term_start > 0:
            # E, which holds every degraded acknowledgement (the gate checked the votes), is on a quorum.
            gate, self._gate = self._gate, NO_DEGRADED
            actions += [CloseDegraded(gate), DegradeEnded(self.term, gate.term, self.commit_lsn)] + \
                self._clear_copies()
        status = self.status(flushes)
        if status == self._reported:
            return actions
        self._reported = status
        if status[1] > self.commit_lsn:
            self._degraded_high = max(self._degraded_high, status[1])
        return actions + [ReportStatus(*status)]

    def status(self, flushes: list[int] | None = None) -> tuple[int, int, int]:
        """(write, flush, apply) for the primary: any, quorum (or, degraded, every member) and all safekeepers."""
        if flushes is None:
            flushes = [self._in_term(p) for p in self.peers.values()]
        write = max(self._reported[0], max(flushes), self.commit_lsn)
        apply = max(self._reported[2], min(min(flushes), self.commit_lsn))
        flush = max(self.commit_lsn, self._reported[1])
        if self._members and self.degraded_confirmed:
            flush = max(flush, min(self._in_term(self.peers[n]) for n in self._members.values()))
        return max(write, flush), flush, apply

    def _trim_point(self) -> int:
        """Below this every safekeeper of the term has flushed (or will be fed from the primary)."""
        return min(p.flush_lsn if p.elected or p.flush_lsn >= self.term_start else self.term_start
                   for p in self.peers.values())

    def _elected_cap(self, p: PeerState, vote: VoteReply) -> int:
        """The highest flush `p` may answer our Elected with.

        It truncates to where its log and ours agree: at most what it voted with (an empty one
        starts at our history's first entry) and never past our term's start, unless WAL we sent
        it in this term (on an earlier connection, maybe after the vote) took it further.
        """
        return max(min(vote.flush_lsn or self.history[0].start_lsn, self.term_start), p.sent_max)

    def _append_cap(self, p: PeerState) -> int:
        """The highest flush `p` may acknowledge: counting WAL it was never sent would commit on
        fewer copies than a quorum."""
        return p.sent_lsn

    def _saw_term(self, term: int, peer: str) -> None:
        if term > self._highest[0]:
            self._highest = (term, peer)

    def _drop(self, p: PeerState, reason: str, **lsns: int) -> list[Action]:
        """A protocol error on `p`'s link: ignore it until it reconnects, and have it closed."""
        self._reset(p.name)
        return [DropPeer(p.name, reason, {"term": self.term, **lsns})] + self._member_left(p.name)

    def _reset(self, name: str) -> PeerState:
        p = self.peers[name]
        p.connected, p.greeted_term, p.node_id, p.vote, p.probe = False, None, None, None, None
        p.withheld = None
        p.elected, p.fetching = False, False
        p.degraded_version = -1
        p.sent_lsn = p.flush_lsn
        return p


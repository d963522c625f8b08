"""Messages between proposer and safekeepers (docs/protocol.md, "Messages").

The wire encoding lives in `sidecar/consensus/codec.py`; these are plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.timelines import TimelineHistory

# 2: Elected carries the primary's timeline and history, VoteReply the voter's timeline, GreetingReply
# and InfoReply the safekeeper's reader port.
# 3: VoteReply and Elected carry the timeline fence of a failover (TimelineFence).
# 4: Greeting carries the proposer's number of safekeepers; InfoReply the member count the safekeeper knows and
# whether it lost its disk (amnesic, or not yet holding a later term); VoteReply why a vote was withheld.
# 5: DegradedRecord and its reply (--commit-wait degrade-after); InfoReply carries the safekeeper's copy.
PROTOCOL_VERSION = 5


@dataclass(frozen=True)
class TermEntry:
    """WAL from `start_lsn` up to the next entry's start was written by `term`'s proposer."""

    term: int
    start_lsn: int


TermHistory = tuple[TermEntry, ...]


@dataclass(frozen=True)
class TimelineFence:
    """A failover's end of a timeline: from term `term` on, `timeline` ends at `lsn` (E).

    Set by the Elected of a failover's fence term, before it promotes a standby: no later term may
    stream from a primary still on `timeline` (the old primary, alive or not), only from one whose
    history switches away from it at `lsn` or above (the promoted standby and its descendants).
    A `timeline` of 0 ends none: no failover yet, or its undo (`failover --undo`) in term `term`.
    The fence of the highest term wins, as voters report theirs and each Elected carries it on.
    """

    term: int = 0
    timeline: int = 0
    lsn: int = 0


NO_FENCE = TimelineFence()


@dataclass(frozen=True)
class DegradedRange:
    """An open degraded range of `--commit-wait degrade-after` (consensus/degraded.py).

    From `start_lsn` on, term `term`'s proposer acknowledged commits flushed by the safekeepers
    `members` (node ids) only, not by a quorum: each acknowledgement made under this `version` of
    the record is on every member's disk in `term`. A failover may start a new timeline only from
    voters of whom one is a member still holding its WAL of `term`. Term 0 is no range.
    """

    term: int = 0
    start_lsn: int = 0
    version: int = 0
    members: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return self.term != 0


NO_DEGRADED = DegradedRange()


@dataclass(frozen=True)
class Greeting:
    protocol_version: int
    proposer_id: str
    system_id: int
    timeline: int
    wal_seg_size: int
    pg_version: int
    members: int = 0  # the proposer's number of safekeepers (--safekeepers): the cluster's membership


@dataclass(frozen=True)
class GreetingReply:
    """`reader_port`: where the safekeeper serves WAL over PostgreSQL's replication protocol (0: nowhere)."""

    node_id: int
    term: int
    reader_port: int = 0


@dataclass(frozen=True)
class VoteRequest:
    term: int


@dataclass(frozen=True)
class VoteReply:
    """`flush_lsn` is the end of the last complete record; `tail_*` fingerprint the bytes before it."""

    term: int
    granted: bool
    flush_lsn: int
    term_history: TermHistory
    timeline_history: TimelineHistory
    # crc32c of the raw stored bytes [tail_lsn, flush_lsn): lets the proposer check that the
    # primary holds the same WAL before flush_lsn without shipping it.
    tail_lsn: int = 0
    tail_crc: int = 0
    timeline: int = 0  # the timeline the voter's WAL was last written on (0: never greeted)
    fence: TimelineFence = NO_FENCE  # the voter's
    # Not 0: the vote was withheld (granted is false, the term promised all the same): the voter lost its disk,
    # learned this term from its peers, and grants none until its WAL holds the start of a later term.
    lost_disk_term: int = 0


@dataclass(frozen=True)
class Elected:
    """`timeline` and `timeline_history` are the primary's, for every safekeeper to lay its WAL out by.

    A timeline of 0 names none: the safekeeper keeps the one it has. `fence` is the highest-term fence
    of the voters, carried on; a fence of this very term is set by it (a failover's fence term, which
    streams no WAL beyond its start).
    """

    term: int
    start_lsn: int
    term_history: TermHistory
    timeline: int = 0
    timeline_history: TimelineHistory = ()
    fence: TimelineFence = NO_FENCE


@dataclass(frozen=True)
class ElectedReply:
    term: int
    flush_lsn: int


@dataclass(frozen=True)
class Append:
    """WAL bytes [begin_lsn, begin_lsn + len(data)); an empty Append is a heartbeat."""

    term: int
    begin_lsn: int
    commit_lsn: int
    peer_horizon_lsn: int
    data: bytes = field(default=b"", repr=False)

    @property
    def end_lsn(self) -> int:
        return self.begin_lsn + len(self.data)


@dataclass(frozen=True)
class AppendReply:
    term: int
    flush_lsn: int
    commit_lsn: int


@dataclass(frozen=True)
class DegradedRecord:
    """From the connection holding `term`: store `record` (NO_DEGRADED: clear the copy) durably, then reply."""

    term: int
    record: DegradedRange


@dataclass(frozen=True)
class DegradedRecordReply:
    """`record` is persisted in the control file (`term` is the safekeeper's: above ours, we lost it)."""

    term: int
    version: int


@dataclass(frozen=True)
class Refusal:
    """The safekeeper closes the connection after this: bad greeting or a protocol violation."""

    reason: str


@dataclass(frozen=True)
class InfoRequest:
    """A read-only question from operator tooling; allowed before a Greeting and changes nothing."""


@dataclass(frozen=True)
class InfoReply:
    """What a safekeeper is: identity (0 until its first proposer) and positions, for `check`/`status`."""

    node_id: int
    system_id: int
    wal_seg_size: int
    pg_version: int
    timeline: int
    term: int
    last_log_term: int
    flush_lsn: int
    commit_lsn: int
    proposer_connected: bool
    reader_port: int = 0  # where it serves WAL to readers (0: nowhere)
    backup_lsn: int = 0  # the archive holds every segment below it
    # Reader slots holding WAL, and the bound on what one may hold (--max-slot-wal-keep-size; 0: none).
    slot_wal_limit: int = 0
    slots: tuple[SlotHold, ...] = ()
    archive_mismatch: str = ""  # an archived object that is not this safekeeper's WAL of its segment ("": none)
    fence: TimelineFence = NO_FENCE  # the failover fence it holds (consensus/lineage.py)
    members: int = 0  # the cluster's safekeepers as it knows them (0: unknown)
    amnesic: bool = False  # a lost disk that has not learned its term yet: its term (0) is no knowledge
    # A lost disk that learned this term and does not vote until its WAL holds the start of a later one (0: none).
    lost_disk_term: int = 0
    degraded: DegradedRange = NO_DEGRADED  # its copy of an open degraded range (NO_DEGRADED: none)
    degrade_term: int = 0  # the last term whose proposer ran --commit-wait degrade-after (0: none)


@dataclass(frozen=True)
class SlotHold:
    """A reader slot in an InfoReply: how much WAL behind the flush it holds, or that it was invalidated."""

    name: str
    wal_bytes: int
    invalidated: bool = False


@dataclass(frozen=True)
class AuthChallenge:
    """`--link-security auth-only`: the safekeeper's first message, fresh random bytes to sign and its
    certificate (DER), which the dialler's signature then covers; empty from an older safekeeper."""

    nonce: bytes
    certificate: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class AuthResponse:
    """The dialler's proof: its certificate (DER) and a signature over both certificates, both nonces and
    the host and port it dialled (linkauth.transcript)."""

    certificate: bytes = field(repr=False)
    nonce: bytes
    host: str
    signature: bytes = field(repr=False)
    port: int = 0


@dataclass(frozen=True)
class AuthConfirm:
    """The safekeeper's proof, sent only once the dialler's checked out: its certificate and signature."""

    certificate: bytes = field(repr=False)
    signature: bytes = field(repr=False)


Message = (
    Greeting | GreetingReply | VoteRequest | VoteReply | Elected | ElectedReply
    | Append | AppendReply | Refusal | InfoRequest | InfoReply | DegradedRecord | DegradedRecordReply
    | AuthChallenge | AuthResponse | AuthConfirm
)

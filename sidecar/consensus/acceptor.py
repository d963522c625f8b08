"""The safekeeper's acceptor state machine, sans IO.

The service feeds it decoded messages plus what it learned from storage (the end of
the last complete record) and executes the returned actions in order: a `Persist`
must be durable before any later `Reply` is sent, and a failed `Persist` must stop
the process, since the in-memory state has already moved on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from sidecar.consensus import history as hist
from sidecar.consensus import limits, lineage
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, DegradedRecord, DegradedRecordReply, Elected, ElectedReply, Greeting,
    GreetingReply, InfoReply, Message, TermHistory, VoteReply, VoteRequest,
)
from sidecar.timelines import TimelineHistory
from sidecar.consensus.quorum import peers_needed_after_a_lost_disk
from sidecar.consensus.state import AcceptorState
from sidecar.lsn import format_lsn


CUT_WINDOW = 256  # cut positions remembered for readers (see Acceptor.cuts)


class AcceptorError(Exception):
    """A message the acceptor refuses: the connection is closed and no state changes."""


@dataclass(frozen=True)
class Persist:
    state: AcceptorState


@dataclass(frozen=True)
class Truncate:
    """Cut stored WAL at `lsn` (or, on an empty store, start it there)."""

    lsn: int


@dataclass(frozen=True)
class Write:
    lsn: int
    data: bytes


@dataclass(frozen=True)
class Reply:
    message: Message


@dataclass(frozen=True)
class AdoptTimeline:
    """The primary's timeline or its history changed: lay the stored WAL out as its pg_wal.

    Segments are named with the timeline that wrote them (the one holding their last byte), and
    every timeline of the history gets its `.history` file. Persisted with the state that follows.
    """

    timeline: int
    history: TimelineHistory


AcceptorAction = Persist | Truncate | AdoptTimeline | Write | Reply


@dataclass(frozen=True)
class PeerTerm:
    """A peer's answer to an amnesic safekeeper (its InfoReply): its term, the cluster's size as it knows it,
    and whether it lost its disk too (then its term is no knowledge, and it does not count)."""

    term: int
    members: int = 0
    amnesic: bool = False


@dataclass(frozen=True)
class RecordEnd:
    """What a scan of the stored WAL found: end of the last complete record and its fingerprint."""

    flush_lsn: int
    tail_lsn: int = 0
    tail_crc: int = 0


class Acceptor:
    """Votes, term history and append ordering for one safekeeper.

    Every field of a message is checked before anything changes: a refused message raises
    AcceptorError and leaves the state, the positions and the term's owner as they were.

    Not thread-safe, and sans IO: no method may run concurrently with another. The safekeeper calls
    every method from whichever thread under its one acceptor lock (`server.Safekeeper`); readers
    of its fields without the lock (views, the reader port) see values replaced whole.
    """

    def __init__(self, node_id: int, state: AcceptorState, write_lsn: int,
                 min_seg_size: int = limits.MIN_SEG_SIZE, amnesic: bool = False, listed_members: int = 0) -> None:
        self.node_id = node_id
        self.state = state
        # An empty data directory (a lost disk: a new cluster's safekeepers are created with a control file)
        # forgot which terms it promised: until it learned its term from enough peers (on_peer_terms) it takes
        # nothing from greetings and refuses votes and Elected.
        self.amnesic = amnesic
        # Sizes of the cluster as told, besides the persisted one: len(--peers) + 1 (0 without --peers), and the
        # largest a greeting or a peer told while amnesic. The largest of them counts (members).
        self.listed_members = listed_members
        self.told_members = 0
        self.write_lsn = write_lsn  # end of WAL handed to storage
        self.flush_lsn = write_lsn  # end of WAL storage has fsynced
        self.elected_term = 0  # the term whose Elected this process has applied
        # Where the elected term's WAL must end: its start, in a failover's own term (it sets or lifts a
        # fence and streams nothing past E); unbounded otherwise.
        self.append_limit = limits.MAX_LSN
        # The connection (an opaque token from its session) whose Elected applied elected_term:
        # the only one whose Appends are accepted in that term.
        self.owner: object = None
        self.min_seg_size = min_seg_size  # lowered only by the simulator's tiny segments
        self.reader_port = 0  # where the service serves WAL to readers, told to proposers and clients
        self.archive_mismatch = ""  # set by the service's uploader; told to clients (`check`)
        self._persisted_commit = state.commit_lsn
        # Stored WAL changes (writes, truncations) bump the epoch; a scan is reused until then.
        self.wal_epoch = 0
        self.cut_generation = 0  # applied Elected messages: each may cut the stored WAL, moving flush_lsn back
        # Where each of the last CUT_WINDOW applied Elected messages cut the WAL (the last is this
        # generation's): a reader that missed some of them learns the lowest, and whether what it was
        # sent is still the stored WAL.
        self.cuts: tuple[int, ...] = ()
        self._end: RecordEnd | None = None
        self._end_epoch = -1

    def cached_end(self) -> RecordEnd | None:
        """The last scan's RecordEnd, if no WAL was written or cut since it began."""
        return self._end if self._end_epoch == self.wal_epoch else None

    def remember_end(self, epoch: int, end: RecordEnd) -> None:
        """Keep a scan that began at `epoch` (a later write makes it stale at once)."""
        self._end, self._end_epoch = end, epoch

    def info(self) -> InfoReply:
        """The answer to an InfoRequest: identity and positions, read-only."""
        s = self.state
        last_log_term = s.term_history[-1].term if s.term_history else 0
        return InfoReply(self.node_id, s.system_id, s.wal_seg_size, s.pg_version, s.timeline, s.term, last_log_term,
                         self.flush_lsn, s.commit_lsn, proposer_connected=self.owner is not None,
                         reader_port=self.reader_port, backup_lsn=s.backup_lsn,
                         archive_mismatch=self.archive_mismatch, fence=s.fence, members=self.members,
                         amnesic=self.amnesic, lost_disk_term=self.recovering_from, degraded=s.degraded,
                         degrade_term=s.degrade_term)

    @property
    def members(self) -> int:
        """The cluster's number of safekeepers, the largest this acceptor was told (0: unknown)."""
        return max(self.state.members, self.listed_members, self.told_members)

    @property
    def amnesic_peers(self) -> int:
        """How many peers that did not lose their disk must tell their term before this one votes (0: not amnesic).

        N-Q+1 of the N members: any term this safekeeper granted was granted by a quorum holding Q-1 of the
        others, and any N-Q+1 of the N-1 others include one of them. At least one, with N unknown."""
        return peers_needed_after_a_lost_disk(self.members) if self.amnesic else 0

    @property
    def recovering_from(self) -> int:
        """The term learned after a lost disk while the WAL holds no start of a later term (0: none)."""
        t = self.state.lost_disk_term
        return t if t and not holds_term_after(self.state.term_history, t, self.flush_lsn) else 0

    def amnesia_reason(self) -> str:
        return (f"safekeeper {self.node_id} started on an empty data directory (a lost disk) and has forgotten "
                f"which terms it promised: it votes only after learning the term of {self.amnesic_peers} of its "
                f"{max(self.members - 1, 1)} peers that did not lose their disk (see its log for whom it waits for)")

    def on_peer_terms(self, answers: Mapping[int, PeerTerm]) -> list[AcceptorAction]:
        """What peers answered (node id -> PeerTerm): with enough of them, adopt and persist the highest term.

        Only a peer that did not lose its disk knows its term: an amnesic one's answer does not count (two lost
        disks at once: this one waits until the other has learned). The cluster's size each tells counts.
        The learned term is kept as `lost_disk_term`: no vote until the WAL holds the start of a later term.
        """
        if not self.amnesic:
            return []
        heard = {node: a for node, a in answers.items() if node != self.node_id}
        for a in heard.values():
            _check(limits.check_term, a.term, "a peer's term")
            _check(limits.check_members, a.members, "a peer's member count")
        self.told_members = max(self.told_members, *(a.members for a in heard.values()), 0)
        knowing = [a.term for a in heard.values() if not a.amnesic]
        if len(knowing) < self.amnesic_peers:
            return []
        self.amnesic = False
        learned = max(self.state.term, *knowing)
        self.state = replace(self.state, term=learned, members=self.members, lost_disk_term=learned)
        return [Persist(self.state)]

    def on_greeting(self, msg: Greeting) -> list[AcceptorAction]:
        if self.amnesic:  # answered, not refused (a proposer takes refused greetings for another cluster),
            # but nothing persisted: a control file would end the amnesia at a restart; the vote is refused.
            # The proposer's number of safekeepers is the cluster's: it tells how many peers must answer.
            if msg.protocol_version == PROTOCOL_VERSION and 0 <= msg.members <= limits.MAX_MEMBERS:
                self.told_members = max(self.told_members, msg.members)
            return [Reply(GreetingReply(self.node_id, self.state.term, self.reader_port))]
        if msg.protocol_version != PROTOCOL_VERSION:
            raise AcceptorError(
                f"protocol version {msg.protocol_version} is not supported (this safekeeper speaks {PROTOCOL_VERSION}): "
                "run the same walsidecar release on the proposer and every safekeeper")
        try:
            limits.check_identity(msg.system_id, msg.timeline, msg.wal_seg_size, msg.pg_version, self.min_seg_size)
            limits.check_members(msg.members)
        except limits.LimitError as e:
            raise AcceptorError(f"Greeting refused: {e}") from None
        s = self.state
        # The proposer's --safekeepers is the cluster's membership: kept for the day a peer loses its disk.
        members = msg.members or s.members
        if s.system_id == 0:
            self.state = replace(s, system_id=msg.system_id, wal_seg_size=msg.wal_seg_size,
                                 pg_version=msg.pg_version, timeline=msg.timeline, members=members)
            return [Persist(self.state), Reply(GreetingReply(self.node_id, self.state.term, self.reader_port))]
        for name, mine, theirs in (("system id", s.system_id, msg.system_id),
                                   ("WAL segment size", s.wal_seg_size, msg.wal_seg_size),
                                   ("PostgreSQL major version", s.pg_version, msg.pg_version)):
            if mine != theirs:
                raise AcceptorError(
                    f"{name} {theirs} of the proposer's primary differs from this safekeeper's {mine}: "
                    "it belongs to another cluster")
        if members != s.members:
            self.state = replace(s, members=members)
            return [Persist(self.state), Reply(GreetingReply(self.node_id, s.term, self.reader_port))]
        return [Reply(GreetingReply(self.node_id, s.term, self.reader_port))]

    def on_vote(self, msg: VoteRequest, end: RecordEnd) -> list[AcceptorAction]:
        """Grant iff the term is new; the caller has flushed and scanned WAL into `end`."""
        _check(limits.check_term, msg.term, "VoteRequest term")
        if self.amnesic:
            raise AcceptorError(self.amnesia_reason())
        if not self.state.system_id:  # greeted while amnesic: the identity was never taken
            raise AcceptorError("this safekeeper learned its term after the greeting: greet it again")
        actions: list[AcceptorAction] = []
        granted = msg.term > self.state.term
        withheld = 0
        if granted and self.state.lost_disk_term:
            if holds_term_after(self.state.term_history, self.state.lost_disk_term, end.flush_lsn):
                # That later term's proposer recovered every commit from a quorum that did not count this
                # safekeeper, and this WAL holds its start: nothing acknowledged before the loss is missing.
                self.state = replace(self.state, lost_disk_term=0)
            else:
                # It may lack a commit it acknowledged before its disk was lost: a quorum counting it could
                # miss that commit. The term is promised all the same (nothing lower is taken from now on),
                # so that its proposer, elected by others, can send Elected and catch it up.
                granted, withheld = False, self.state.lost_disk_term
        if granted or withheld:
            self.state = replace(self.state, term=msg.term)
            actions.append(Persist(self.state))
        term = max(msg.term, self.state.term)
        actions.append(Reply(VoteReply(
            term=term, granted=granted, flush_lsn=end.flush_lsn,
            term_history=hist.up_to(self.state.term_history, end.flush_lsn),
            timeline_history=self.state.timeline_history,
            tail_lsn=end.tail_lsn, tail_crc=end.tail_crc, timeline=self.state.timeline, fence=self.state.fence,
            lost_disk_term=withheld)))
        return actions

    def on_elected(self, msg: Elected, end: RecordEnd, owner: object = None) -> list[AcceptorAction]:
        """Truncate at the divergence point, adopt the proposer's history; `owner` now holds the term."""
        _check(limits.check_term, msg.term, "Elected term")
        if self.amnesic:
            raise AcceptorError(self.amnesia_reason())
        if msg.term < self.state.term:
            return [Reply(ElectedReply(self.state.term, self.flush_lsn))]
        if msg.term > self.state.term:
            raise AcceptorError(f"Elected for term {msg.term} without a vote (this safekeeper is at term {self.state.term})")
        _check(limits.check_lsn, msg.start_lsn, "Elected start LSN")
        _check(limits.check_term_history, msg.term_history)
        _check(limits.check_timeline, msg.timeline, msg.timeline_history)
        _check(limits.check_fence, msg.fence, msg.term)
        failover_term = msg.fence.term == msg.term
        fence = msg.fence if failover_term else lineage.latest(self.state.fence, msg.fence)
        if not failover_term:
            ours = self.state
            timeline, timelines = ((msg.timeline, msg.timeline_history) if msg.timeline
                                   else (ours.timeline, ours.timeline_history))
            problem = lineage.fenced_out(fence, timeline, timelines)
            if problem is not None:
                raise AcceptorError(f"Elected for term {msg.term} refused: {problem}")
        last = msg.term_history[-1] if msg.term_history else None
        if last is None or (last.term, last.start_lsn) != (msg.term, msg.start_lsn):
            raise AcceptorError(f"Elected for term {msg.term}: history does not end with this term at its start LSN")
        try:
            point = hist.divergence_point(self.state.term_history, end.flush_lsn, msg.term_history)
        except hist.HistoryError as e:
            raise AcceptorError(f"Elected for term {msg.term}: {e}") from e
        point = min(point, end.flush_lsn) if end.flush_lsn else point
        commit = self.state.commit_lsn
        if cuts_committed(point, commit, end.flush_lsn):
            raise AcceptorError(
                f"Elected for term {msg.term} would truncate WAL at {format_lsn(point)}, below the "
                f"commit position {format_lsn(commit)} this safekeeper knows: acknowledged WAL is never cut")
        # A cut below commit_lsn (allowed only down to the end of the stored WAL's last complete
        # record) lowers it there: the new term writes those positions again, maybe with other bytes
        # (a torn record's, counted raw), and readers may have them only once it acknowledges them.
        commit = min(commit, point)
        new = replace(self.state, term_history=msg.term_history, commit_lsn=commit,
                      peer_horizon_lsn=min(self.state.peer_horizon_lsn, commit), fence=fence)
        adopt: list[AcceptorAction] = []
        if msg.timeline and (msg.timeline, msg.timeline_history) != (new.timeline, new.timeline_history):
            new = replace(new, timeline=msg.timeline, timeline_history=msg.timeline_history)
            adopt.append(AdoptTimeline(msg.timeline, msg.timeline_history))
        self.state = new
        self.write_lsn = self.flush_lsn = point
        self.elected_term = msg.term
        self.append_limit = msg.start_lsn if failover_term else limits.MAX_LSN
        self.owner = owner
        self.wal_epoch += 1
        self.cut_generation += 1
        self.cuts = (self.cuts + (point,))[-CUT_WINDOW:]
        self._persisted_commit = commit
        return [Truncate(point), *adopt, Persist(new), Reply(ElectedReply(msg.term, point))]

    def on_append(self, msg: Append, owner: object = None) -> list[AcceptorAction]:
        """Accept WAL in order from the term's owner; the reply waits for `on_flushed` unless empty."""
        s = self.state
        if msg.term < s.term:
            return [Reply(AppendReply(s.term, self.flush_lsn, s.commit_lsn))]
        if msg.term != self.elected_term:
            raise AcceptorError(f"Append for term {msg.term} before Elected (safekeeper term {s.term})")
        if owner is not self.owner:
            raise AcceptorError(f"Append for term {msg.term} on a connection that does not hold the term: "
                                "only the connection that sent its Elected may append")
        if msg.begin_lsn != self.write_lsn:
            raise AcceptorError(
                f"Append at {format_lsn(msg.begin_lsn)} does not continue the WAL written up to "
                f"{format_lsn(self.write_lsn)}")
        actions: list[AcceptorAction] = []
        if msg.data:
            end = msg.end_lsn
            if end > self.append_limit:
                if self.append_limit == limits.MAX_LSN:
                    raise AcceptorError(f"Append ending at {end:#x} runs past PostgreSQL's WAL range")
                raise AcceptorError(
                    f"Append ending at {format_lsn(end)} in term {msg.term}, a failover's term: it streams no WAL "
                    f"past its start {format_lsn(self.append_limit)}")
            actions.append(Write(msg.begin_lsn, msg.data))
            actions += self.appended(end, msg.commit_lsn, msg.peer_horizon_lsn)
            return actions
        actions += self._learn(msg.commit_lsn, msg.peer_horizon_lsn)
        actions.append(Reply(AppendReply(s.term, self.flush_lsn, self.state.commit_lsn)))
        return actions

    def appended(self, end: int, commit_lsn: int, horizon_lsn: int) -> list[AcceptorAction]:
        """An Append with data that `on_append` accepted is written up to `end`: its state change, after
        its Write (which the safekeeper's compiled stream loop makes itself, having checked what
        on_append checks)."""
        self.write_lsn = end
        self.wal_epoch += 1
        return self._learn(commit_lsn, horizon_lsn)

    def on_degraded(self, msg: DegradedRecord, owner: object = None) -> list[AcceptorAction]:
        """Store the term owner's degraded range (or clear it) durably; the reply says it is stored.

        The proposer acknowledges a commit that this safekeeper alone may hold only after this reply: a
        failover finds the range here even when the broker is out of reach.
        """
        _check(limits.check_term, msg.term, "DegradedRecord term")
        _check(lambda r: limits.check_degraded(r, msg.term), msg.record)
        s = self.state
        if msg.term < s.term:
            return [Reply(DegradedRecordReply(s.term, 0))]  # it lost its term: the reply says so, and stores nothing
        if msg.term != self.elected_term or owner is not self.owner:
            raise AcceptorError(f"DegradedRecord for term {msg.term} on a connection that does not hold the term")
        if (msg.record, msg.term) == (s.degraded, s.degrade_term):
            return [Reply(DegradedRecordReply(s.term, msg.record.version))]
        self.state = replace(s, degraded=msg.record, degrade_term=msg.term)
        return [Persist(self.state), Reply(DegradedRecordReply(s.term, msg.record.version))]

    def on_flushed(self, flush_lsn: int) -> list[AcceptorAction]:
        """Storage has fsynced up to `flush_lsn`: acknowledge it, in the term promised now.

        After a higher promise the reply is no acknowledgement in the elected term (the vote may have
        reported less than this): it tells that term's proposer that it lost.
        """
        self.flush_lsn = max(self.flush_lsn, min(flush_lsn, self.write_lsn))
        return [Reply(AppendReply(self.state.term, self.flush_lsn, self.state.commit_lsn))]

    def on_backed_up(self, backup_lsn: int) -> list[AcceptorAction]:
        """The archive holds every segment below `backup_lsn`: persist it (it bounds WAL removal)."""
        s = self.state
        lsn = min(backup_lsn, s.commit_lsn)
        if lsn <= s.backup_lsn:
            return []
        self.state = replace(s, backup_lsn=lsn)
        return [Persist(self.state)]

    def _learn(self, commit_lsn: int, horizon_lsn: int) -> list[AcceptorAction]:
        # commit_lsn here is "acknowledged by a quorum and present here", so cap it at our WAL.
        s = self.state
        commit = max(s.commit_lsn, min(commit_lsn, self.write_lsn))
        horizon = max(s.peer_horizon_lsn, min(horizon_lsn, commit))
        if (commit, horizon) == (s.commit_lsn, s.peer_horizon_lsn):
            return []
        # Positional construction: replace() costs several times more, and this runs per Append.
        self.state = AcceptorState(s.system_id, s.wal_seg_size, s.pg_version, s.timeline, s.term,
                                   s.term_history, s.timeline_history, commit, s.backup_lsn, horizon, s.fence,
                                   s.members, s.lost_disk_term, s.degraded, s.degrade_term)
        # commit_lsn is a hint: persist it lazily, once per segment of progress.
        if commit - self._persisted_commit >= max(s.wal_seg_size, 1):
            self._persisted_commit = commit
            return [Persist(self.state)]
        return []


def holds_term_after(history: TermHistory, term: int, flush_lsn: int) -> bool:
    """True if WAL ending at `flush_lsn` holds the start of a term above `term` (its history says where)."""
    return any(e.term > term and e.start_lsn <= flush_lsn for e in history)


def cuts_committed(point: int, commit_lsn: int, flush_lsn: int) -> bool:
    """True if truncating stored WAL ending at `flush_lsn` to `point` removes WAL below `commit_lsn`.

    A quorum acknowledged the WAL below commit_lsn: no legitimate term cuts into it.
    """
    return point < min(commit_lsn, flush_lsn)


def _check(check, value, *what: str) -> None:  # type: ignore[no-untyped-def]
    """Run a limits check; its LimitError becomes a refusal of the message."""
    try:
        check(value, *what)
    except limits.LimitError as e:
        raise AcceptorError(str(e)) from None

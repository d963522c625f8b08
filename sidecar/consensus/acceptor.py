"""The safekeeper's acceptor state machine, sans IO.

The service feeds it decoded messages plus what it learned from storage (the end of
the last complete record) and executes the returned actions in order: a `Persist`
must be durable before any later `Reply` is sent, and a failed `Persist` must stop
the process, since the in-memory state has already moved on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sidecar.consensus import history as hist
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, ElectedReply, Greeting, GreetingReply,
    Message, VoteReply, VoteRequest,
)
from sidecar.consensus.state import AcceptorState


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


AcceptorAction = Persist | Truncate | Write | Reply


@dataclass(frozen=True)
class RecordEnd:
    """What a scan of the stored WAL found: end of the last complete record and its fingerprint."""

    flush_lsn: int
    tail_lsn: int = 0
    tail_crc: int = 0


class Acceptor:
    """Votes, term history and append ordering for one safekeeper."""

    def __init__(self, node_id: int, state: AcceptorState, write_lsn: int) -> None:
        self.node_id = node_id
        self.state = state
        self.write_lsn = write_lsn  # end of WAL handed to storage
        self.flush_lsn = write_lsn  # end of WAL storage has fsynced
        self.elected_term = 0  # the term whose Elected this process has applied
        self._persisted_commit = state.commit_lsn

    def on_greeting(self, msg: Greeting) -> list[AcceptorAction]:
        if msg.protocol_version != PROTOCOL_VERSION:
            raise AcceptorError(
                f"protocol version {msg.protocol_version} is not supported (this safekeeper speaks {PROTOCOL_VERSION})")
        s = self.state
        if s.system_id == 0:
            self.state = replace(s, system_id=msg.system_id, wal_seg_size=msg.wal_seg_size,
                                 pg_version=msg.pg_version, timeline=msg.timeline)
            return [Persist(self.state), Reply(GreetingReply(self.node_id, self.state.term))]
        for name, mine, theirs in (("system id", s.system_id, msg.system_id),
                                   ("WAL segment size", s.wal_seg_size, msg.wal_seg_size),
                                   ("PostgreSQL major version", s.pg_version, msg.pg_version)):
            if mine != theirs:
                raise AcceptorError(
                    f"{name} {theirs} of the proposer's primary differs from this safekeeper's {mine}: "
                    "it belongs to another cluster")
        return [Reply(GreetingReply(self.node_id, s.term))]

    def on_vote(self, msg: VoteRequest, end: RecordEnd) -> list[AcceptorAction]:
        """Grant iff the term is new; the caller has flushed and scanned WAL into `end`."""
        actions: list[AcceptorAction] = []
        granted = msg.term > self.state.term
        if granted:
            self.state = replace(self.state, term=msg.term)
            actions.append(Persist(self.state))
        term = max(msg.term, self.state.term)
        actions.append(Reply(VoteReply(
            term=term, granted=granted, flush_lsn=end.flush_lsn,
            term_history=hist.up_to(self.state.term_history, end.flush_lsn),
            timeline_history=self.state.timeline_history,
            tail_lsn=end.tail_lsn, tail_crc=end.tail_crc)))
        return actions

    def on_elected(self, msg: Elected, end: RecordEnd) -> list[AcceptorAction]:
        """Truncate at the divergence point and adopt the proposer's history."""
        if msg.term < self.state.term:
            return [Reply(ElectedReply(self.state.term, self.flush_lsn))]
        if msg.term > self.state.term:
            raise AcceptorError(f"Elected for term {msg.term} without a vote (this safekeeper is at term {self.state.term})")
        last = msg.term_history[-1] if msg.term_history else None
        if last is None or (last.term, last.start_lsn) != (msg.term, msg.start_lsn):
            raise AcceptorError(f"Elected for term {msg.term}: history does not end with this term at its start LSN")
        try:
            point = hist.divergence_point(self.state.term_history, end.flush_lsn, msg.term_history)
        except hist.HistoryError as e:
            raise AcceptorError(f"Elected for term {msg.term}: {e}") from e
        point = min(point, end.flush_lsn) if end.flush_lsn else point
        new = replace(self.state, term_history=msg.term_history, commit_lsn=min(self.state.commit_lsn, point))
        self.state = new
        self.write_lsn = self.flush_lsn = point
        self.elected_term = msg.term
        self._persisted_commit = new.commit_lsn
        return [Truncate(point), Persist(new), Reply(ElectedReply(msg.term, point))]

    def on_append(self, msg: Append) -> list[AcceptorAction]:
        """Accept WAL in order; the reply waits for `on_flushed` unless there is nothing to write."""
        s = self.state
        if msg.term < s.term:
            return [Reply(AppendReply(s.term, self.flush_lsn, s.commit_lsn))]
        if msg.term != self.elected_term:
            raise AcceptorError(f"Append for term {msg.term} before Elected (safekeeper term {s.term})")
        if msg.begin_lsn != self.write_lsn:
            raise AcceptorError(
                f"Append at {msg.begin_lsn} does not continue the WAL written up to {self.write_lsn}")
        actions: list[AcceptorAction] = []
        if msg.data:
            actions.append(Write(msg.begin_lsn, msg.data))
            self.write_lsn = msg.end_lsn
        actions += self._learn(msg.commit_lsn, msg.peer_horizon_lsn)
        if not msg.data:
            actions.append(Reply(AppendReply(s.term, self.flush_lsn, self.state.commit_lsn)))
        return actions

    def on_flushed(self, flush_lsn: int) -> list[AcceptorAction]:
        """Storage has fsynced up to `flush_lsn`: acknowledge it."""
        self.flush_lsn = max(self.flush_lsn, min(flush_lsn, self.write_lsn))
        return [Reply(AppendReply(self.state.term, self.flush_lsn, self.state.commit_lsn))]

    def _learn(self, commit_lsn: int, horizon_lsn: int) -> list[AcceptorAction]:
        # commit_lsn here is "acknowledged by a quorum and present here", so cap it at our WAL.
        s = self.state
        commit = max(s.commit_lsn, min(commit_lsn, self.write_lsn))
        horizon = max(s.peer_horizon_lsn, min(horizon_lsn, commit))
        if (commit, horizon) == (s.commit_lsn, s.peer_horizon_lsn):
            return []
        # Positional construction: replace() costs several times more, and this runs per Append.
        self.state = AcceptorState(s.system_id, s.wal_seg_size, s.pg_version, s.timeline, s.term,
                                   s.term_history, s.timeline_history, commit, s.backup_lsn, horizon)
        # commit_lsn is a hint: persist it lazily, once per segment of progress.
        if commit - self._persisted_commit >= max(s.wal_seg_size, 1):
            self._persisted_commit = commit
            return [Persist(self.state)]
        return []

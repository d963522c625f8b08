"""What a safekeeper may send one reader next (docs/protocol.md, "Reading"), sans IO.

A reader is sent WAL up to the safekeeper's commit position and no further (invariant 5): WAL
above it may still be cut by a later term. A reader that names the current term (the proposer's
recovery of a lagging voter, or `failover`) may read up to the flush position instead, for as
long as that term lasts. The walsender (`safekeeper/walsender.py`) and the simulator both ask
`ReadCursor.next()` and do what it says.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.timelines import TimelineHistory
from sidecar.lsn import format_lsn
from sidecar.pgrepl import MAX_SEND_SIZE, timeline_end


# SQLSTATEs of the refusals, as PostgreSQL's walsender uses them.
UNDEFINED_FILE = "58P01"          # the WAL was removed (or never stored here)
INVALID_PARAMETER = "22023"       # a position or timeline that cannot be served
NOT_IN_PREREQUISITE = "55000"     # the term or the stored WAL changed under the reader


@dataclass(frozen=True)
class ServerState:
    """What the safekeeper holds now, as a reader sees it."""

    term: int
    flush_lsn: int
    commit_lsn: int
    generation: int       # bumped by every truncation (acceptor.cut_generation)
    timeline: int         # the timeline the current WAL is written on
    history: TimelineHistory  # switch points leading to `timeline`
    first_lsn: int | None  # start of the lowest stored segment; None when nothing is stored
    # Where the last cuts went, the last one this generation's (acceptor.cuts); () when not known.
    cuts: tuple[int, ...] = ()


@dataclass(frozen=True)
class Send:
    """Send the stored WAL [start, end) as XLogData."""

    start: int
    end: int


@dataclass(frozen=True)
class Wait:
    """Nothing to send until the positions change; `wal_end` is what a keepalive reports."""

    wal_end: int


@dataclass(frozen=True)
class TimelineDone:
    """The reader's timeline ends here: CopyDone, then (next timeline, switch LSN)."""

    next_timeline: int
    switch_lsn: int


class ReadRefused(Exception):
    """The request cannot be served, or can no longer be: an ERROR with `sqlstate` for the reader."""

    def __init__(self, message: str, sqlstate: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


Step = Send | Wait | TimelineDone


def readable_end(s: ServerState, term: int = 0) -> int:
    """How far a reader may read: the commit position, or the flush for a reader of the current term."""
    if term:
        return s.flush_lsn
    return min(s.commit_lsn, s.flush_lsn)


class ReadCursor:
    """One START_REPLICATION: where the reader is and what it may be sent next."""

    def __init__(self, start_lsn: int, timeline: int, s: ServerState, term: int = 0) -> None:
        """Check the request against `s`; raise ReadRefused when it cannot be served."""
        if term and term != s.term:
            # Not which term it is: a reader guessing terms learns nothing from the refusal.
            raise ReadRefused(f"term {term} is not this safekeeper's current term: the reader's term has ended "
                              "or has not begun", NOT_IN_PREREQUISITE)
        tli = timeline or s.timeline
        if tli != s.timeline and timeline_end(s.history, s.timeline, tli) is None:
            raise ReadRefused(f"requested timeline {tli} is not in this server's history "
                              f"(its timeline is {s.timeline})", INVALID_PARAMETER)
        switch = timeline_end(s.history, s.timeline, tli)
        if switch is not None and start_lsn > switch.switch_lsn:
            raise ReadRefused(
                f"requested starting point {format_lsn(start_lsn)} on timeline {tli} is not in this server's "
                f"history: timeline {tli} ends at {format_lsn(switch.switch_lsn)}", INVALID_PARAMETER)
        if s.first_lsn is None or start_lsn < s.first_lsn:
            held = "no WAL" if s.first_lsn is None else f"WAL from {format_lsn(s.first_lsn)}"
            raise ReadRefused(f"requested WAL at {format_lsn(start_lsn)} is not stored here "
                              f"(this safekeeper holds {held})", UNDEFINED_FILE)
        end = readable_end(s, term)
        if switch is None and start_lsn > end:
            raise ReadRefused(f"requested starting point {format_lsn(start_lsn)} is ahead of the WAL this "
                              f"safekeeper can serve ({format_lsn(end)})", INVALID_PARAMETER)
        self.sent = start_lsn
        self.timeline = tli
        self.term = term
        self.generation = s.generation

    def next(self, s: ServerState) -> Step:
        """What to do now; raises ReadRefused when the reader's term ended or its WAL was cut."""
        if self.term and s.term != self.term:
            raise ReadRefused(f"term {self.term} ended (this safekeeper is at term {s.term}); "
                              "the WAL read in it may be cut", NOT_IN_PREREQUISITE)
        end = readable_end(s, self.term)
        if s.generation != self.generation:
            # A truncation happened: what was sent must still be stored. The lowest cut since the
            # reader last looked counts, not the flush now: a new term may have written other bytes
            # over the cut since (a torn record's, counted raw) and never two versions of one
            # position may reach a reader.
            cut = _lowest_cut(s, s.generation - self.generation)
            if self.sent > cut:
                raise ReadRefused(f"the WAL this reader was sent up to {format_lsn(self.sent)} was cut at "
                                  f"{format_lsn(cut)} by a new term", NOT_IN_PREREQUISITE)
            self.generation = s.generation
        switch = timeline_end(s.history, s.timeline, self.timeline) if self.timeline != s.timeline else None
        if switch is not None:
            end = min(end, switch.switch_lsn)
        if self.sent < end:
            return Send(self.sent, min(end, self.sent + MAX_SEND_SIZE))
        if switch is not None and self.sent >= switch.switch_lsn:
            return TimelineDone(switch.timeline, switch.switch_lsn)
        return Wait(end)

    def advance(self, end: int) -> None:
        """The WAL up to `end` was handed to the reader's socket."""
        self.sent = max(self.sent, end)


def _lowest_cut(s: ServerState, missed: int) -> int:
    """The lowest position the last `missed` cuts went to; 0 when they are not all known, the flush without any."""
    if not s.cuts:
        return s.flush_lsn
    if not 0 < missed <= len(s.cuts):
        return 0
    return min(s.cuts[-missed:])

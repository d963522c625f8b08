"""The proposer's "limbo": WAL received from the primary and not yet acknowledged by a quorum.

Pure bookkeeping with caller-supplied timestamps (the service owns the clock), so it can be
tested without sleeping. Positions are end LSNs of what the primary sent; an entry leaves the
limbo once `commit_lsn` reaches it, and the time it spent there is the commit-ack latency.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class _Entry:
    end_lsn: int
    received_at: float


class Limbo:
    """Pending positions with their arrival times, plus a coarse arrival history for lag in seconds."""

    def __init__(self, max_entries: int = 4096, history_step: float = 0.1, history_seconds: float = 3600.0) -> None:
        self.max_entries = max_entries
        self.history_step = history_step
        self.history_seconds = history_seconds
        self._pending: deque[_Entry] = deque()
        # (end_lsn, first time WAL up to it was seen), one sample per history_step at most.
        self._history: deque[tuple[int, float]] = deque()
        self.received_lsn = 0
        self.acknowledged_lsn = 0

    def received(self, end_lsn: int, now: float) -> None:
        """WAL up to `end_lsn` arrived at `now` (called once per batch from the primary)."""
        if end_lsn <= self.received_lsn:
            return
        self.received_lsn = end_lsn
        if end_lsn > self.acknowledged_lsn:
            # Past the cap, extend the newest entry: its earlier timestamp over-states the wait of the
            # bytes merged into it a little, but memory stays bounded while a quorum is missing.
            if len(self._pending) >= self.max_entries:
                self._pending[-1].end_lsn = end_lsn
            else:
                self._pending.append(_Entry(end_lsn, now))
        h = self._history
        if h and now - h[-1][1] < self.history_step:
            h[-1] = (end_lsn, h[-1][1])
        else:
            h.append((end_lsn, now))
        while h and now - h[0][1] > self.history_seconds and len(h) > 1:
            h.popleft()

    def acknowledged(self, commit_lsn: int, now: float) -> list[float]:
        """A quorum now holds WAL up to `commit_lsn`: release entries, return how long each waited."""
        if commit_lsn <= self.acknowledged_lsn:
            return []
        self.acknowledged_lsn = commit_lsn
        waits: list[float] = []
        p = self._pending
        while p and p[0].end_lsn <= commit_lsn:
            waits.append(now - p.popleft().received_at)
        return waits

    @property
    def pending_bytes(self) -> int:
        """Received but not yet quorum-acknowledged."""
        return max(self.received_lsn - self.acknowledged_lsn, 0) if self._pending else 0

    def oldest(self, now: float) -> tuple[int, float] | None:
        """(end LSN, seconds waited) of the oldest unacknowledged entry, or None when all are acknowledged."""
        if not self._pending:
            return None
        e = self._pending[0]
        return e.end_lsn, max(now - e.received_at, 0.0)

    def lag_seconds(self, flush_lsn: int, now: float) -> float:
        """How long ago the first WAL beyond `flush_lsn` arrived: 0 when `flush_lsn` is fully caught up."""
        if flush_lsn >= self.received_lsn:
            return 0.0
        if flush_lsn >= self.acknowledged_lsn:
            for e in self._pending:  # exact arrival times, finer than the history samples
                if e.end_lsn > flush_lsn:
                    return max(now - e.received_at, 0.0)
        return max(now - self._history_time(flush_lsn, now), 0.0)

    def _history_time(self, flush_lsn: int, now: float) -> float:
        for end, at in self._history:
            if end > flush_lsn:
                return at
        return now

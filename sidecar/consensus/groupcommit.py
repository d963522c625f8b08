"""When to fdatasync received WAL: group commit as a sans-IO policy.

One fdatasync per Append would cost a disk round trip per commit; one per socket drain covers
every Append that arrived while the previous sync ran, as pg_receivewal and Neon's WalAcceptor
(`FlushWAL` once the inbound channel is empty) do it. The safekeeper's proposer connection thread
asks `decide()` after every batch it received, and the simulator asks the same object, so the
policy it checks is the one that runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Unsynced WAL is synced once this much waits, even while more input keeps arriving: a proposer
# that never lets the socket drain still gets acknowledgements.
SYNC_AT = 1 << 20
# ...and once the oldest unsynced byte has waited this long (seconds).
MAX_DELAY = 0.002


class Decision(enum.Enum):
    SYNC_NOW = "sync now"  # sync, then acknowledge
    LATER = "later"  # read what is waiting first: the sync after it covers both
    WAIT = "wait"  # nothing unsynced (or a sync under way covers it): block on input


@dataclass
class GroupCommit:
    """One connection's group-commit policy: bytes written and flushed in, a `Decision` out.

    Not thread-safe: owned by the one executor that writes and syncs a connection's WAL.
    """

    sync_at: int = SYNC_AT
    max_delay: float = MAX_DELAY
    _unsynced_since: float | None = None  # when WAL first waited unsynced, since the last sync

    def decide(self, written: int, flushed: int, more_waiting: bool, syncing: bool, now: float) -> Decision:
        """`written`: the end of the WAL written; `flushed`: the end acknowledged as synced;
        `more_waiting`: input already received and not yet read; `syncing`: a sync is under way
        (its completion is followed by another decision); `now`: a monotonic clock."""
        if written <= flushed:
            self._unsynced_since = None
            return Decision.WAIT
        if self._unsynced_since is None:
            self._unsynced_since = now
        if syncing:
            return Decision.LATER if more_waiting else Decision.WAIT
        if more_waiting and written - flushed < self.sync_at and now - self._unsynced_since < self.max_delay:
            return Decision.LATER
        return Decision.SYNC_NOW

    def synced(self) -> None:
        """A sync covered everything written so far: what is written next waits from then on."""
        self._unsynced_since = None

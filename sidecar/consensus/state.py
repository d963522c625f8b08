"""The persistent state of a safekeeper (what its control file holds)."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.consensus.messages import NO_FENCE, TermHistory, TimelineFence
from sidecar.timelines import TimelineHistory


@dataclass(frozen=True)
class AcceptorState:
    """Persisted fields of docs/protocol.md "Safekeeper state"; `flush_lsn` is deliberately absent."""

    system_id: int = 0
    wal_seg_size: int = 0
    pg_version: int = 0
    timeline: int = 0
    term: int = 0
    term_history: TermHistory = ()
    timeline_history: TimelineHistory = ()
    commit_lsn: int = 0
    backup_lsn: int = 0
    peer_horizon_lsn: int = 0
    fence: TimelineFence = NO_FENCE  # the highest-term failover fence this safekeeper accepted

"""The persistent state of a safekeeper (what its control file holds)."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.consensus.messages import NO_DEGRADED, NO_FENCE, DegradedRange, TermHistory, TimelineFence
from sidecar.timelines import TimelineHistory


@dataclass(frozen=True)
class AcceptorState:
    """Persisted fields of docs/protocol.md "Safekeeper state"; `flush_lsn` is deliberately absent.

    `acceptor._learn` builds it positionally on the hot path: a new field goes there too.
    """

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
    # How many safekeepers the cluster has, as `safekeeper-init` or the last proposer's Greeting said (0:
    # unknown): a lost disk of this cluster learns its term from N-Q+1 of the others (acceptor.on_peer_terms).
    members: int = 0
    # The term this safekeeper learned from its peers after a lost disk: until its WAL holds the start of a
    # later term it promises terms without granting them, since it may lack commits it acknowledged before
    # the loss (acceptor.on_vote). 0: no lost disk, or the WAL holds such a start.
    lost_disk_term: int = 0
    # The open degraded range the proposer recorded here before acknowledging with fewer than a quorum
    # (--commit-wait degrade-after): what `check` and a failover without the broker read (NO_DEGRADED: none).
    degraded: DegradedRange = NO_DEGRADED
    # The last term whose proposer ran degrade-after (it sent a DegradedRecord, if only to clear a copy; 0: none):
    # a failover without the broker refuses then, since a range may be open on safekeepers it does not hear.
    degrade_term: int = 0

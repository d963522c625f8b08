"""What a safekeeper shows its observers: one snapshot, so they never walk its internals."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.broker import SafekeeperState
from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.diskguard import DiskUsage
from sidecar.safekeeper.horizon import Horizon
from sidecar.safekeeper.positions import Positions


@dataclass(frozen=True)
class SlotView:
    """A reader slot: where its reader flushed to."""

    name: str
    restart_lsn: int  # 0: none yet
    timeline: int
    temporary: bool
    active: bool  # a reader streams with it now


@dataclass(frozen=True)
class BrokerView:
    """What the safekeeper publishes to the broker and sees there of its peers (itself included)."""

    endpoints: tuple[str, ...]
    cluster: str | None  # None until the system id is known (no --cluster)
    timeline: int
    connected: bool | None  # None: not tried yet
    error: str | None  # why the last attempt failed
    published_ago: float | None  # seconds since the last publish that etcd took
    peers: tuple[SafekeeperState, ...] = ()
    uploader: int | None = None  # the id holding the upload lease, as last read
    leading: bool = False  # this safekeeper may upload now


@dataclass(frozen=True)
class SafekeeperView:
    """A safekeeper at one moment: identity, state, published positions, links and why it stopped."""

    node_id: int
    listen: str  # HOST:PORT proposers connect to
    link_security: str | None  # "tls", "auth-only", or None under --insecure
    state: AcceptorState  # identity, term history, peer horizon
    positions: Positions  # term, flush and commit as published
    elected_term: int
    write_lsn: int
    proposer_connected: bool  # an elected proposer's connection holds the term
    disk_full: bool  # a full disk fenced it: up, refusing everything
    fatal: str | None  # type of the error that stops the process
    stopped: bool  # no longer acknowledging WAL (disk_full, or fatal)
    reader_listen: str | None = None  # HOST:PORT of the reader port (--pg-listen), if any
    readers: int = 0  # reader connections now
    streaming_readers: int = 0  # of which in START_REPLICATION
    slots: tuple[SlotView, ...] = ()
    archive: str | None = None  # where committed segments are uploaded (--archive), if anywhere
    archive_error: str | None = None  # the last archiving failure, until an upload succeeds
    archive_mismatch: str | None = None  # an archived object that is not our WAL of its segment: backup_lsn stops
    broker: BrokerView | None = None  # with --broker
    removal_horizon: Horizon = Horizon(0, "nothing stored yet")  # WAL below it is removed
    removal_stopped_by: str | None = None  # a pin that kept removal below the horizon
    disk_guard: str | None = None  # why new WAL is not taken now (--max-disk-usage)
    disk_usage: DiskUsage = DiskUsage(0, 0, 0)
    learning_term_from: int = 0  # an empty data directory: peers whose terms it still needs before voting
    members: int = 0  # the cluster's safekeepers as this one knows them (0: unknown)
    lost_disk_term: int = 0  # learned after a lost disk: no vote until the WAL holds the start of a later term

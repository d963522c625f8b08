"""What the proposer service publishes: a read-only view for observers, and the hooks it calls on them.

Observers (the monitor, tests) hold these, never the service: the service calls `ProposerObserver`
hooks as things happen and answers `ProposerView` reads when an observer asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sidecar.consensus.messages import DegradedRange
from sidecar.consensus.proposer import Phase, ProposerEvent
from sidecar.proposer.options import StartOptions
from sidecar.proposer.primary import PrimarySnapshot


@dataclass(frozen=True)
class PeerView:
    """One configured safekeeper: its link, and what the current term knows of it (defaults between terms)."""

    name: str
    connected: bool
    reconnects: int
    node_id: int | None = None
    greeted_term: int | None = None
    elected: bool = False  # in the current term
    flush_lsn: int = 0  # acknowledged in the current term
    fetching: bool = False  # catching up from the primary's pg_wal


class ProposerView(Protocol):
    """Term, phase, positions, peers and options of a running proposer."""

    @property
    def options(self) -> StartOptions: ...

    @property
    def term(self) -> int:
        """The current term, or the last one between terms."""
        ...

    @property
    def phase(self) -> Phase | None:
        """None between terms."""
        ...

    @property
    def term_start(self) -> int: ...

    @property
    def commit_lsn(self) -> int: ...

    @property
    def degraded(self) -> DegradedRange:
        """The open degraded range (--commit-wait degrade-after), NO_DEGRADED when none."""
        ...

    @property
    def degraded_acknowledging(self) -> bool:
        """Whether commits are acknowledged above the quorum right now."""
        ...

    @property
    def primary_poll(self) -> PrimarySnapshot:
        """What the last poll of the primary saw."""
        ...

    def peers(self) -> list[PeerView]:
        """Every configured safekeeper, in the configured order."""
        ...

    def peer(self, name: str) -> PeerView | None:
        """None if `name` is not a configured safekeeper."""
        ...


class ProposerObserver(Protocol):
    """The hooks the service calls on its hot path, and the observer's own background work."""

    def wal_received(self, end_lsn: int, nbytes: int) -> None: ...

    def committed(self, commit_lsn: int) -> None: ...

    def peer_contact(self, peer: str) -> None: ...

    def event(self, event: ProposerEvent) -> None: ...

    def term_lost(self) -> None: ...

    async def run(self) -> None:
        """Runs as long as the service does."""
        ...

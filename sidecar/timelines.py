"""PostgreSQL timelines as values: where the primary switched from one timeline to the next.

A leaf: the consensus core (whose messages and state carry a timeline history) and the replication
protocol (`pgrepl.py`, which reads and writes `.history` files) both import it, and neither imports the other
for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimelineEntry:
    """The primary switched away from `timeline` at `switch_lsn` (a PostgreSQL .history line)."""

    timeline: int
    switch_lsn: int


TimelineHistory = tuple[TimelineEntry, ...]

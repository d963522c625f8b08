"""The check behind `VerifyPrimary`, sans IO: does the primary hold the donor's WAL up to the term start?

The caller reads the primary's flush position, its timeline history and the CRC of the donor's
tail range from the primary (the service from PostgreSQL), and this module says what is wrong.
"""

from __future__ import annotations

from sidecar.consensus.messages import TimelineHistory
from sidecar.consensus.proposer import VerifyPrimary
from sidecar.lsn import format_lsn


def switches_below(history: TimelineHistory, lsn: int) -> tuple[tuple[int, int], ...]:
    """The timeline switches at or below `lsn`: two histories that agree on these agree up to `lsn`."""
    return tuple((e.timeline, e.switch_lsn) for e in history if e.switch_lsn <= lsn)


def lineage_mismatch(a: VerifyPrimary, flush_lsn: int, history: TimelineHistory) -> str | None:
    """Why a primary at `flush_lsn` with `history` cannot hold the donor's WAL; None if it may."""
    start = format_lsn(a.start_lsn)
    if flush_lsn < a.start_lsn:
        return (f"the primary lacks quorum-committed WAL between {format_lsn(flush_lsn)} and {start}: "
                "catch it up from the safekeepers before promoting it, or it is a stale primary")
    ours, theirs = switches_below(history, a.start_lsn), switches_below(a.timeline_history, a.start_lsn)
    if ours != theirs:
        return f"the primary's timeline history {ours} leaves the safekeepers' WAL ({theirs}) before {start}"
    return None


def tail_mismatch(a: VerifyPrimary, tail_crc: int) -> str | None:
    """Why the primary's WAL in [tail_lsn, start_lsn), with CRC `tail_crc`, is not the donor's; None if it is."""
    if tail_crc == a.tail_crc:
        return None
    return (f"the primary's WAL between {format_lsn(a.tail_lsn)} and {format_lsn(a.start_lsn)} differs from "
            f"safekeeper {a.donor}'s: it is a different or stale primary")

"""The check behind `VerifyPrimary`, sans IO: does the primary hold the donor's WAL up to the term start?

The caller reads the primary's flush position, its timeline history and the CRC of the donor's
tail range from the primary (the service from PostgreSQL), and this module says what is wrong.

A promoted standby is a primary like any other: its timeline switches away from the donor's at
its promotion point. If that point is at or above the term start E, its WAL below E is the
donor's (the tail check then compares the bytes), so it holds every committed byte; a switch
below E means it lacks some, or holds other WAL there.
"""

from __future__ import annotations

from sidecar.timelines import TimelineHistory
from sidecar.consensus.proposer import VerifyPrimary
from sidecar.lsn import format_lsn


def switches_below(history: TimelineHistory, lsn: int) -> tuple[tuple[int, int], ...]:
    """The timeline switches strictly below `lsn`: two histories that agree on these agree below `lsn`.

    A switch at `lsn` itself leaves the WAL below it on the old timeline, unchanged.
    """
    return tuple((e.timeline, e.switch_lsn) for e in history if e.switch_lsn < lsn)


def lineage_mismatch(a: VerifyPrimary, flush_lsn: int, history: TimelineHistory) -> str | None:
    """Why a primary at `flush_lsn` with `history` cannot hold the donor's WAL; None if it may."""
    start = format_lsn(a.start_lsn)
    if flush_lsn < a.start_lsn:
        return (f"the primary lacks quorum-committed WAL between {format_lsn(flush_lsn)} and {start}: "
                "catch it up from the safekeepers before promoting it, or it is a stale primary")
    ours, theirs = switches_below(history, a.start_lsn), switches_below(a.timeline_history, a.start_lsn)
    if ours != theirs:
        where = _first_difference(ours, theirs)
        return (f"the primary's timeline history {_show(ours)} leaves the safekeepers' WAL (history {_show(theirs)}) "
                f"at {format_lsn(where)}, below the quorum-committed position {start}: it was promoted (or restored) "
                "before it had received every committed byte; promote a standby that replayed up to "
                f"{start}, or rewind this server (pg_rewind) and let it follow the safekeepers")
    return None


def tail_mismatch(a: VerifyPrimary, tail_crc: int) -> str | None:
    """Why the primary's WAL in [tail_lsn, start_lsn), with CRC `tail_crc`, is not the donor's; None if it is."""
    if tail_crc == a.tail_crc:
        return None
    return (f"the primary's WAL between {format_lsn(a.tail_lsn)} and {format_lsn(a.start_lsn)} differs from "
            f"safekeeper {a.donor}'s: it is a different or stale primary")


def tail_removed(a: VerifyPrimary, error: str) -> str:
    """The primary no longer has the WAL of the donor's tail (a promoted standby recycled it): refuse, saying how to fix."""
    return (f"the primary no longer holds its WAL between {format_lsn(a.tail_lsn)} and {format_lsn(a.start_lsn)} "
            f"({error}), so it cannot be checked against the safekeepers' quorum-committed WAL: copy that WAL back "
            "into its pg_wal (walsidecar restore-wal fetches it from the safekeepers), or start the sidecar with "
            "--allow-primary-mismatch once you know it holds every committed transaction")


def _first_difference(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> int:
    for x, y in zip(a, b):
        if x != y:
            return min(x[1], y[1])
    longer = a if len(a) > len(b) else b
    return longer[min(len(a), len(b))][1]


def _show(switches: tuple[tuple[int, int], ...]) -> str:
    return "[" + ", ".join(f"timeline {t} until {format_lsn(lsn)}" for t, lsn in switches) + "]" if switches \
        else "[no switch]"

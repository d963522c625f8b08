"""A failover is final: once a fence term ends a timeline at E, only primaries that left it at E or above stream.

`walsidecar failover` wins a term from a quorum, brings a standby to the quorum's commit position E
and promotes it. Before it promotes, its Elected sets a `TimelineFence` on that quorum: the old
primary's timeline ends at E. Any later quorum holds one safekeeper that accepted it, and that
safekeeper refuses the Elected of a proposer whose primary is still on the fenced timeline (the old
primary, alive on the far side of a partition, or merely not yet stopped), so the old primary can
never have another commit acknowledged. The promoted standby switched away from that timeline at
its promotion point, at or above E; it and its descendants pass.

A failover's own term (a fence that ends or lifts a timeline) is exempt: a failover that stopped
before promoting can be run again, or undone (`failover --undo`), from the same lineage. Its term
streams no WAL beyond its start, so the exemption lets the old primary acknowledge nothing.
"""

from __future__ import annotations

from sidecar.consensus.messages import NO_FENCE, TimelineFence
from sidecar.timelines import TimelineHistory
from sidecar.lsn import format_lsn


def latest(*fences: TimelineFence) -> TimelineFence:
    """The fence of the highest term: a later failover (or its undo) decides, whatever came before."""
    return max(fences, key=lambda f: f.term, default=NO_FENCE)


def fenced_out(fence: TimelineFence, timeline: int, history: TimelineHistory) -> str | None:
    """Why a primary on `timeline` with `history` may not stream after `fence`; None if it may."""
    if not fence.timeline:
        return None
    if timeline != fence.timeline and any(e.timeline == fence.timeline and e.switch_lsn >= fence.lsn
                                          for e in history):
        return None
    where = "is still on it" if timeline == fence.timeline else \
        f"is on timeline {timeline}, which does not descend from the standby promoted there"
    return (f"a failover in term {fence.term} ended timeline {fence.timeline} at {format_lsn(fence.lsn)} to "
            f"promote a standby; this primary {where}: it must not take commits again. Rejoin it as a standby "
            "of the new primary (pg_rewind), or, if that failover never promoted, undo it with "
            "`walsidecar failover --undo`")

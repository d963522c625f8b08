"""`--commit-wait degrade-after=T`: acknowledging with the safekeepers that are up, and the failover's gate.

Pure rules the proposer core (`consensus/proposer.py`), the failover (`ops/failover.py` through the
core's failover term) and the simulator share. The safety argument (docs/protocol.md, "Degraded
acknowledgements"): a commit acknowledged by fewer than a quorum is lost only if a new timeline is
started from voters that lack it. Every such acknowledgement is on every member of the open range's
latest version, in its term, and the range is recorded (in etcd and on the members) before it is
made; a failover starts a new timeline only from voters of whom one is such a member and whose start
E holds that member's WAL. A sidecar restarted on the same primary is safe by itself: it streams the
primary's WAL, which holds every commit the old one acknowledged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.consensus.messages import DegradedRange, VoteReply
from sidecar.lsn import format_lsn


@dataclass(frozen=True)
class DegradedCarry:
    """An open range a proposer core inherits: it closes it once its quorum commit reaches `close_at`.

    From the previous term of the same sidecar: `close_at` is the highest degraded acknowledgement. From
    a dead sidecar on the same primary (found in etcd at start): the primary's flush LSN then, at or
    above anything the dead one acknowledged. Until it is closed the core does not degrade on its own:
    a new range would not name the members holding the inherited one's acknowledgements.
    """

    record: DegradedRange
    close_at: int


def describe(record: DegradedRange) -> str:
    members = ", ".join(str(n) for n in sorted(record.members)) or "none"
    return (f"degraded range of term {record.term} from {format_lsn(record.start_lsn)} (version {record.version}, "
            f"members: safekeepers {members})")


def holding_members(record: DegradedRange, votes: Mapping[str, tuple[int | None, VoteReply]]) -> list[str]:
    """The voters (name -> (node id, vote)) that are members of `record` and still hold their WAL of its term.

    A member whose log ends in a later term may have been cut by that term's Elected: its flush no
    longer proves that it holds the acknowledgements.
    """
    out = []
    for name, (node, vote) in votes.items():
        last = vote.term_history[-1].term if vote.term_history else 0
        if node is not None and node in record.members and last == record.term:
            out.append(name)
    return sorted(out)


def gate_problem(record: DegradedRange, votes: Mapping[str, tuple[int | None, VoteReply]],
                 start_lsn: int) -> str | None:
    """Why a new timeline from these votes, starting at `start_lsn` (E), could lose a degraded acknowledgement.

    None when a member of the range that still holds its WAL of the range's term voted, and E is at or
    above its flush: the term's recovery then carries every degraded acknowledgement to a quorum.
    """
    members = holding_members(record, votes)
    if not members:
        heard = sorted(n for n, (node, _) in votes.items() if node is not None and node in record.members)
        why = (f" (safekeepers {', '.join(heard)} are members, but a later term wrote over their WAL of term "
               f"{record.term})") if heard else ""
        return f"no voter is a member of the {describe(record)}{why}"
    best = max(members, key=lambda n: votes[n][1].flush_lsn)
    if start_lsn < votes[best][1].flush_lsn:
        return (f"the voters' log ends at {format_lsn(start_lsn)}, below the flush {format_lsn(votes[best][1].flush_lsn)} "
                f"of {best}, a member of the {describe(record)}: a later term's log would cut its acknowledgements")
    return None

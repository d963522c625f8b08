"""Bounds on every value a peer may send: checked before anything is acted on or stored.

A value outside them is a protocol error on that connection; nothing a peer sends may
make a safekeeper or the proposer store a number it cannot encode, name or move past.
"""

from __future__ import annotations

from sidecar.consensus.messages import DegradedRange, TermHistory, TimelineFence
from sidecar.timelines import TimelineHistory

# Terms fit a signed 64-bit integer, so a proposer can always campaign one above any term a
# safekeeper has accepted and still encode it: a huge term can no longer end every election.
MAX_TERM = 2**63 - 1
# PostgreSQL's WAL positions are 64-bit; the last segment of the largest size is left free so that
# the end of any write (and the segment after it) still has a name.
MAX_LSN = 2**64 - 2**30
# Entries in a term or timeline history. Each term adds at most one; far more than any
# deployment makes, far less than a frame or a control file can carry cheaply.
MAX_HISTORY = 10_000
# PostgreSQL's WAL segment sizes: powers of two from 1 MiB to 1 GiB (initdb --wal-segsize).
MIN_SEG_SIZE, MAX_SEG_SIZE = 1 << 20, 1 << 30
# Frames a connection may send before it is a greeted proposer: no Greeting, vote or info
# request is this long, so nobody unauthenticated makes a safekeeper allocate more.
PREAUTH_MAX_FRAME = 64 * 1024
# Frames of a greeted proposer that does not hold the term: votes and Elected, whose histories
# are bounded by MAX_HISTORY. Only the connection holding the term may send codec.MAX_FRAME.
CONTROL_MAX_FRAME = 1024 * 1024

# The link authentication handshake (sidecar/linkauth.py): nonces are exactly this long; a
# certificate, a host name and a signature at most this long (ours are ~600 and ~72 bytes).
AUTH_NONCE = 32
MAX_AUTH_CERT = 8 * 1024
MAX_AUTH_HOST = 255
MAX_AUTH_SIGNATURE = 256
# The archived object a safekeeper reports as not its WAL (InfoReply): a segment's name, or a partial's.
MAX_OBJECT_NAME = 255


class LimitError(ValueError):
    """A value a peer sent is outside what the protocol allows."""


def check_term(term: int, what: str = "term") -> int:
    if not 0 <= term <= MAX_TERM:
        raise LimitError(f"{what} {term} is outside 0..{MAX_TERM}")
    return term


def check_lsn(lsn: int, what: str = "LSN") -> int:
    if not 0 <= lsn <= MAX_LSN:
        raise LimitError(f"{what} {lsn:#x} is outside PostgreSQL's WAL range (at most {MAX_LSN:#x})")
    return lsn


def check_term_history(history: TermHistory) -> TermHistory:
    """Terms strictly ascending, start positions never going back, bounded length."""
    _check_ascending("term history", "term", [(e.term, e.start_lsn) for e in history], -1)
    for e in history:
        check_term(e.term, "history term")
    return history


def check_timeline_history(history: TimelineHistory) -> TimelineHistory:
    """Timelines strictly ascending from 1, switch positions never going back, bounded length."""
    _check_ascending("timeline history", "timeline", [(e.timeline, e.switch_lsn) for e in history], 0)
    return history


def _check_ascending(what: str, key: str, entries: list[tuple[int, int]], floor: int) -> None:
    if len(entries) > MAX_HISTORY:
        raise LimitError(f"{what} of {len(entries)} entries exceeds {MAX_HISTORY}")
    prev_key, prev_lsn = floor, 0
    for k, lsn in entries:
        check_lsn(lsn, f"{what} LSN")
        if k <= prev_key or lsn < prev_lsn:
            raise LimitError(f"{what} is not ascending at {key} {k} starting at {lsn:#x}")
        prev_key, prev_lsn = k, lsn


MAX_TIMELINE = 2**32 - 1
MAX_PORT = 65535
MAX_MEMBERS = 1000  # safekeepers in one cluster


def check_members(members: int, what: str = "member count") -> int:
    """0 (unknown) up to MAX_MEMBERS."""
    if not 0 <= members <= MAX_MEMBERS:
        raise LimitError(f"{what} {members} is outside 0..{MAX_MEMBERS}")
    return members



def check_timeline(timeline: int, history: TimelineHistory, what: str = "timeline") -> int:
    """A timeline (0: none named) whose history leads to it: every switch is away from a lower one."""
    if not 0 <= timeline <= MAX_TIMELINE:
        raise LimitError(f"{what} {timeline} is outside 0..{MAX_TIMELINE}")
    check_timeline_history(history)
    if history and (not timeline or history[-1].timeline >= timeline):
        raise LimitError(f"{what} {timeline} does not follow its history's last timeline {history[-1].timeline}")
    return timeline


def check_fence(fence: TimelineFence, term: int) -> TimelineFence:
    """A fence set in a term at or below `term` (the message's): no term sets what a later one decides."""
    check_term(fence.term, "fence term")
    if fence.term > term:
        raise LimitError(f"fence of term {fence.term} is above the message's term {term}")
    check_timeline(fence.timeline, (), "fenced timeline")
    check_lsn(fence.lsn, "fence LSN")
    if not fence.timeline and fence.lsn:
        raise LimitError("a fence that ends no timeline has no LSN")
    if not fence.term and fence.timeline:
        raise LimitError("a fence that ends a timeline was set in a term")
    return fence


def check_degraded(record: DegradedRange, term: int) -> DegradedRange:
    """An open degraded range of a term at or below `term`, or none (every field 0)."""
    check_term(record.term, "degraded range term")
    if record.term > term:
        raise LimitError(f"degraded range of term {record.term} is above the message's term {term}")
    check_lsn(record.start_lsn, "degraded range start LSN")
    check_term(record.version, "degraded range version")
    if len(record.members) > MAX_MEMBERS:
        raise LimitError(f"degraded range of {len(record.members)} members, the limit is {MAX_MEMBERS}")
    for node in record.members:
        if not 0 < node < 2**64:
            raise LimitError(f"degraded range member {node} is not a safekeeper node id")
    if not record.term and (record.start_lsn or record.version or record.members):
        raise LimitError("no degraded range (term 0) carries no start, version or members")
    return record


def check_port(port: int, what: str = "reader port") -> int:
    if not 0 <= port <= MAX_PORT:
        raise LimitError(f"{what} {port} is outside 0..{MAX_PORT}")
    return port


def check_object_name(name: str) -> str:
    if len(name) > MAX_OBJECT_NAME:
        raise LimitError(f"object name of {len(name)} characters, the limit is {MAX_OBJECT_NAME}")
    return name


def check_nonce(nonce: bytes) -> None:
    if len(nonce) != AUTH_NONCE:
        raise LimitError(f"nonce of {len(nonce)} bytes, expected {AUTH_NONCE}")


def check_auth_field(what: str, value: bytes, most: int) -> None:
    """A certificate, host or signature of a link authentication message: not empty, at most `most` bytes."""
    if not 1 <= len(value) <= most:
        raise LimitError(f"{what} of {len(value)} bytes is outside 1..{most}")


def check_seg_size(size: int, minimum: int = MIN_SEG_SIZE) -> int:
    """A power of two in PostgreSQL's range; `minimum` is lowered only by the simulator's tiny disks."""
    if size & (size - 1) or not minimum <= size <= MAX_SEG_SIZE:
        raise LimitError(f"WAL segment size {size} is not a power of two between {minimum} and {MAX_SEG_SIZE}")
    return size


def check_identity(system_id: int, timeline: int, wal_seg_size: int, pg_version: int,
                   min_seg_size: int = MIN_SEG_SIZE) -> None:
    """What a first Greeting would make a fresh safekeeper adopt for good."""
    if not 0 < system_id < 2**64:
        raise LimitError(f"system id {system_id} is not a PostgreSQL system identifier")
    if not 1 <= timeline < 2**32:
        raise LimitError(f"timeline {timeline} is outside 1..{2**32 - 1}")
    check_seg_size(wal_seg_size, min_seg_size)
    # The proposer sends the major version (server_version_num // 10000, e.g. 15).
    if not 10 <= pg_version <= 99:
        raise LimitError(f"PostgreSQL major version {pg_version} is not one PostgreSQL uses")

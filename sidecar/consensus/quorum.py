"""Quorum size and the commit rule."""

from __future__ import annotations

from collections.abc import Iterable


class QuorumError(ValueError):
    """A quorum configuration under which two quorums need not intersect."""


def majority(n: int) -> int:
    return n // 2 + 1


def peers_to_learn_from(n: int) -> int:
    """How many of the other n-1 safekeepers an amnesic one must hear before it votes: N-Q+1.

    Every quorum it could have voted in holds Q-1 others, and any N-Q+1 of the others meet
    those Q-1; Q is a majority, the smallest quorum allowed, so this is enough for any quorum.
    """
    return min(n - majority(n) + 1, n - 1) if n > 1 else 0


def peers_needed_after_a_lost_disk(n: int) -> int:
    """How many peers that kept their disk a safekeeper that lost its own must hear: N-Q+1, and at least one
    (with N unknown, or alone, it has nobody else to learn from)."""
    return max(peers_to_learn_from(n), 1)


def validate_quorum(n: int, quorum: int | None) -> int:
    """Return the quorum to use for `n` safekeepers, refusing one that is not a majority."""
    if n < 1:
        raise QuorumError("at least one safekeeper is needed")
    q = majority(n) if quorum is None else quorum
    if q > n:
        raise QuorumError(f"quorum {q} is larger than the {n} safekeepers given")
    if q * 2 <= n:
        raise QuorumError(
            f"quorum {q} of {n} safekeepers is refused: two quorums must intersect, "
            f"so the quorum must be more than half ({majority(n)} or more)"
        )
    return q


def quorum_position(positions: Iterable[int], quorum: int, term_start: int) -> int:
    """The `quorum`-th highest position, counting positions below the term start as zero."""
    counted = sorted((p if p >= term_start else 0 for p in positions), reverse=True)
    return counted[quorum - 1] if len(counted) >= quorum else 0

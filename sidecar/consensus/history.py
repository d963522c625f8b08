"""Term history arithmetic: last log term, divergence point (docs/protocol.md)."""

from __future__ import annotations

from sidecar.consensus.messages import TermEntry, TermHistory


class HistoryError(ValueError):
    """Two histories contradict each other: the same term starts at different LSNs."""


def up_to(history: TermHistory, lsn: int) -> TermHistory:
    """The part of `history` that describes WAL at or below `lsn`."""
    return tuple(e for e in history if e.start_lsn <= lsn)


def last_log_term(history: TermHistory, flush_lsn: int) -> int:
    cut = up_to(history, flush_lsn)
    return cut[-1].term if cut else 0


def donor_key(history: TermHistory, flush_lsn: int) -> tuple[int, int]:
    """Order of candidate donors: the term comparison keeps a stale long log from winning."""
    return last_log_term(history, flush_lsn), flush_lsn


def extend(history: TermHistory, term: int, start_lsn: int) -> TermHistory:
    """The history of a new term: `history` cut at `start_lsn`, then (term, start_lsn)."""
    base = up_to(history, start_lsn)
    if base and base[-1].term >= term:
        raise HistoryError(f"term {term} is not above the last term {base[-1].term} of the history")
    return base + (TermEntry(term, start_lsn),)


def divergence_point(sk_history: TermHistory, sk_flush: int, proposer_history: TermHistory) -> int:
    """Highest position up to which the safekeeper's WAL agrees with the proposer's history."""
    if not proposer_history:
        raise HistoryError("the proposer's history is empty")
    sk = up_to(sk_history, sk_flush)
    common = 0
    while common < min(len(sk), len(proposer_history)) and sk[common].term == proposer_history[common].term:
        if sk[common].start_lsn != proposer_history[common].start_lsn:
            raise HistoryError(
                f"term {sk[common].term} starts at {sk[common].start_lsn} on the safekeeper "
                f"but at {proposer_history[common].start_lsn} on the proposer"
            )
        common += 1
    if common == 0:
        return proposer_history[0].start_lsn
    prop_next = proposer_history[common].start_lsn if common < len(proposer_history) else None
    sk_next = sk[common].start_lsn if common < len(sk) else sk_flush
    return sk_next if prop_next is None else min(prop_next, sk_next)

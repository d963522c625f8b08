"""Term history arithmetic: last log term, donor order, extension and the divergence point."""

from __future__ import annotations

import pytest

from sidecar.consensus.history import (
    HistoryError, divergence_point, donor_key, extend, last_log_term, up_to,
)
from sidecar.consensus.messages import TermEntry, TermHistory


def h(*pairs: tuple[int, int]) -> TermHistory:
    return tuple(TermEntry(t, s) for t, s in pairs)


def test_up_to_keeps_entries_starting_at_or_below_lsn() -> None:
    history = h((1, 100), (2, 500), (4, 900))
    assert up_to(history, 499) == h((1, 100))
    assert up_to(history, 500) == h((1, 100), (2, 500))
    assert up_to(history, 10_000) == history
    assert up_to(history, 99) == ()


def test_last_log_term_is_the_term_of_the_last_entry_holding_flush() -> None:
    history = h((1, 100), (2, 500), (4, 900))
    assert last_log_term(history, 600) == 2
    assert last_log_term(history, 900) == 4
    assert last_log_term(history, 50) == 0
    assert last_log_term((), 1000) == 0


def test_donor_key_newer_term_beats_longer_log() -> None:
    stale_long = donor_key(h((1, 100), (2, 500)), 9000)
    fresh_short = donor_key(h((1, 100), (3, 600)), 700)
    assert fresh_short > stale_long
    # Same last log term: the longer log wins.
    assert donor_key(h((1, 100), (3, 600)), 800) > fresh_short


def test_extend_cuts_at_start_and_appends_the_new_term() -> None:
    donor = h((1, 100), (2, 500), (3, 900))
    assert extend(donor, 7, 700) == h((1, 100), (2, 500), (7, 700))
    assert extend(donor, 7, 900) == h((1, 100), (2, 500), (3, 900), (7, 900))
    assert extend((), 1, 100) == h((1, 100))


def test_extend_refuses_a_term_not_above_the_history() -> None:
    with pytest.raises(HistoryError):
        extend(h((1, 100), (3, 500)), 3, 600)
    with pytest.raises(HistoryError):
        extend(h((1, 100), (3, 500)), 2, 600)


def test_divergence_no_common_term_is_the_proposer_history_start() -> None:
    proposer = h((2, 100), (5, 800))
    # An empty safekeeper: its WAL starts where the proposer's history starts.
    assert divergence_point((), 0, proposer) == 100
    # A safekeeper whose only term the proposer never saw keeps nothing above that start.
    assert divergence_point(h((1, 100)), 4000, proposer) == 100


def test_divergence_same_last_term_as_proposer_is_the_safekeeper_flush() -> None:
    proposer = h((1, 100), (3, 800))
    sk = h((1, 100), (3, 800))
    assert divergence_point(sk, 1234, proposer) == 1234
    assert divergence_point(sk, 800, proposer) == 800


def test_divergence_cuts_a_stale_tail_at_the_next_term_start() -> None:
    # The safekeeper wrote term 2 from 500 that the proposer's history does not have.
    proposer = h((1, 100), (3, 400))
    assert divergence_point(h((1, 100), (2, 500)), 900, proposer) == 400
    # The safekeeper kept writing term 1 past the proposer's start of term 3.
    assert divergence_point(h((1, 100)), 900, proposer) == 400
    # The safekeeper's term 2 started below the proposer's next term: cut there.
    assert divergence_point(h((1, 100), (2, 300)), 900, proposer) == 300
    # Two shared terms, then diverging.
    assert divergence_point(h((1, 100), (2, 300), (4, 700)), 900,
                            h((1, 100), (2, 300), (5, 600))) == 600


def test_divergence_safekeeper_behind_is_its_flush() -> None:
    proposer = h((1, 100), (3, 800))
    assert divergence_point(h((1, 100)), 450, proposer) == 450


def test_divergence_ignores_history_entries_above_the_flush() -> None:
    # Term 2 was adopted at 700 but the safekeeper only holds WAL up to 600 (all term 1).
    proposer = h((1, 100), (3, 650))
    assert divergence_point(h((1, 100), (2, 700)), 600, proposer) == 600


def test_divergence_contradicting_histories_raise() -> None:
    with pytest.raises(HistoryError, match="term 2"):
        divergence_point(h((1, 100), (2, 300)), 900, h((1, 100), (2, 350), (3, 800)))
    with pytest.raises(HistoryError):
        divergence_point(h((1, 100)), 900, h((1, 200), (3, 800)))


def test_divergence_refuses_an_empty_proposer_history() -> None:
    with pytest.raises(HistoryError):
        divergence_point(h((1, 100)), 900, ())

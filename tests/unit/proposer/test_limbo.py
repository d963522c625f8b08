"""The limbo: pending positions, their waits, the oldest one, and lag in seconds (explicit clock)."""

from __future__ import annotations

from sidecar.proposer.limbo import Limbo


def test_acknowledgement_releases_entries_with_their_waits() -> None:
    lb = Limbo()
    lb.received(100, now=1.0)
    lb.received(200, now=1.5)
    lb.received(300, now=2.0)
    assert lb.pending_bytes == 300 and lb.oldest(2.5) == (100, 1.5)
    assert lb.acknowledged(200, now=3.0) == [2.0, 1.5]
    assert lb.oldest(3.0) == (300, 1.0) and lb.pending_bytes == 100
    assert lb.acknowledged(150, now=4.0) == []  # never backwards
    assert lb.acknowledged(300, now=4.0) == [2.0]
    assert lb.oldest(5.0) is None and lb.pending_bytes == 0


def test_repeated_positions_keep_their_first_arrival() -> None:
    lb = Limbo()
    lb.received(100, now=1.0)
    lb.received(100, now=5.0)  # a new term re-streams the same WAL
    lb.received(80, now=6.0)
    assert lb.oldest(6.0) == (100, 5.0)


def test_memory_stays_bounded_and_the_oldest_wait_stays_exact() -> None:
    lb = Limbo(max_entries=10)
    for i in range(1, 1001):
        lb.received(i * 10, now=float(i))
    assert len(lb._pending) == 10
    assert lb.oldest(2000.0) == (10, 1999.0)
    waits = lb.acknowledged(10_000, now=2000.0)
    assert len(waits) == 10 and lb.oldest(2000.0) is None


def test_lag_seconds_of_a_safekeeper() -> None:
    lb = Limbo(history_step=1.0)
    for t in range(10):
        lb.received((t + 1) * 100, now=float(t))
    lb.acknowledged(500, now=9.0)
    assert lb.lag_seconds(1000, now=10.0) == 0.0  # caught up
    assert lb.lag_seconds(900, now=10.0) == 1.0  # missing what arrived at t=9
    assert lb.lag_seconds(550, now=10.0) == 5.0  # within the pending entries: exact
    assert lb.lag_seconds(250, now=10.0) == 8.0  # behind the commit: from the history
    assert lb.lag_seconds(0, now=10.0) == 10.0

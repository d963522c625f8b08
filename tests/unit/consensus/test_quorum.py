"""Quorum size validation and the commit rule's quorum position."""

from __future__ import annotations

import pytest

from sidecar.consensus.quorum import QuorumError, majority, quorum_position, validate_quorum


@pytest.mark.parametrize(("n", "q"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (7, 4)])
def test_majority(n: int, q: int) -> None:
    assert majority(n) == q


@pytest.mark.parametrize(("n", "quorum", "expected"), [
    (1, None, 1), (3, None, 2), (3, 2, 2), (3, 3, 3), (4, 3, 3), (5, 3, 3), (5, 5, 5),
])
def test_validate_quorum_accepts_a_majority(n: int, quorum: int | None, expected: int) -> None:
    assert validate_quorum(n, quorum) == expected


@pytest.mark.parametrize(("n", "quorum"), [(3, 1), (4, 2), (2, 1), (5, 2), (6, 3)])
def test_validate_quorum_refuses_half_or_less(n: int, quorum: int) -> None:
    with pytest.raises(QuorumError, match="two quorums must intersect") as exc:
        validate_quorum(n, quorum)
    assert f"quorum {quorum} of {n}" in str(exc.value)
    assert str(majority(n)) in str(exc.value)


def test_validate_quorum_refuses_more_than_n_and_no_safekeepers() -> None:
    with pytest.raises(QuorumError, match="larger"):
        validate_quorum(3, 4)
    with pytest.raises(QuorumError):
        validate_quorum(0, None)


def test_quorum_position_is_the_qth_highest() -> None:
    assert quorum_position([300, 100, 200], 2, 0) == 200
    assert quorum_position([300, 100, 200], 1, 0) == 300
    assert quorum_position([300, 100, 200], 3, 0) == 100
    assert quorum_position([500, 500, 100, 100, 100], 3, 0) == 100
    assert quorum_position([500, 500, 400, 100, 100], 3, 0) == 400


def test_quorum_position_counts_positions_below_term_start_as_zero() -> None:
    # Two safekeepers hold an older term's WAL up to 900 but only one has reached the
    # term start 1000: nothing is committed in this term yet.
    assert quorum_position([900, 900, 1500], 2, 1000) == 0
    assert quorum_position([1000, 900, 1500], 2, 1000) == 1000
    assert quorum_position([1200, 900, 1500], 2, 1000) == 1200


def test_quorum_position_without_enough_positions_is_zero() -> None:
    assert quorum_position([500], 2, 0) == 0
    assert quorum_position([], 1, 0) == 0


def test_an_amnesic_safekeeper_hears_n_minus_q_plus_1_others() -> None:
    from sidecar.consensus.quorum import peers_to_learn_from
    assert [peers_to_learn_from(n) for n in (1, 2, 3, 4, 5, 7)] == [0, 1, 2, 2, 3, 4]

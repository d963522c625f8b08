"""--commit-wait: parsing the policy, since when each commit waits, and which waits terminate-after ends."""

from __future__ import annotations

import pytest

from sidecar.consensus.commitwait import (
    CommitWait, SyncRepWaiters, TerminateAfter, Waiter, WaiterKey, parse_commit_wait, parse_duration,
)

A = WaiterKey(101, "2026-01-01 00:00:00+00", "2026-01-01 00:00:05+00")
B = WaiterKey(102, "2026-01-01 00:00:00+00", "2026-01-01 00:00:07+00")


def test_parse_policies() -> None:
    assert parse_commit_wait("wait") == CommitWait()
    assert parse_commit_wait("terminate-after=30s") == CommitWait("terminate", 30.0)
    assert parse_commit_wait(" terminate-after = 500ms ") == CommitWait("terminate", 0.5)
    assert parse_commit_wait("terminate-after=2m").after == 120.0
    assert parse_commit_wait("terminate-after=1h").after == 3600.0
    assert parse_commit_wait("terminate-after=45").after == 45.0
    assert str(parse_commit_wait("terminate-after=2m")) == "terminate-after=120s"
    assert str(CommitWait()) == "wait"
    assert parse_commit_wait("degrade-after=30s") == CommitWait("degrade", 30.0)
    assert parse_commit_wait(" degrade-after = 1m ").after == 60.0
    assert str(parse_commit_wait("degrade-after=500ms")) == "degrade-after=0.5s"


@pytest.mark.parametrize("text", ["", "waits", "terminate-after", "terminate-after=", "terminate-after=0s",
                                  "terminate-after=-1s", "terminate-after=10 days", "degrade-after",
                                  "degrade-after=0", "degrade-after=soon", "cancel-after=10s"])
def test_refuses_what_it_does_not_know(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_commit_wait(text)
    assert "terminate-after" in str(e.value) or "degrade-after" in str(e.value)


def test_parse_duration_refuses_garbage() -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def test_a_wait_is_dated_from_when_it_was_first_seen_and_forgotten_once_it_ends() -> None:
    waits = SyncRepWaiters()
    assert waits.observe(10.0, [A]) == [Waiter(A, 10.0)]
    assert sorted(waits.observe(11.0, [A, B]), key=lambda w: w.key.pid) == [Waiter(A, 10.0), Waiter(B, 11.0)]
    assert waits.observe(12.0, [B]) == [Waiter(B, 11.0)]
    # The same pid waiting again (its next commit, or a new session given the pid) is a new wait.
    again = WaiterKey(A.pid, A.backend_start, "2026-01-01 00:00:12+00")
    assert waits.observe(13.0, [again, B]) == [Waiter(again, 13.0), Waiter(B, 11.0)]
    assert waits.observe(14.0, []) == []
    assert waits.observe(15.0, [B]) == [Waiter(B, 15.0)]


def test_nothing_is_terminated_while_there_is_a_quorum() -> None:
    policy = TerminateAfter(5.0)
    assert policy.decide(100.0, [Waiter(A, 0.0)], quorum=True) == []
    assert policy.no_quorum_since is None


def test_a_wait_is_ended_once_it_lasted_t_without_a_quorum() -> None:
    policy = TerminateAfter(5.0)
    old, young = Waiter(A, 0.0), Waiter(B, 12.0)
    # The quorum is lost at 10: the long wait before it does not count.
    assert policy.decide(10.0, [old, young], quorum=False) == []
    assert policy.decide(14.9, [old, young], quorum=False) == []
    assert policy.decide(15.0, [old, young], quorum=False) == [old]
    assert policy.decide(17.0, [young], quorum=False) == [young]


def test_a_quorum_back_resets_the_count() -> None:
    policy = TerminateAfter(5.0)
    w = Waiter(A, 0.0)
    assert policy.decide(10.0, [w], quorum=False) == []
    assert policy.decide(14.0, [w], quorum=True) == []
    assert policy.decide(15.0, [w], quorum=False) == []  # lost again at 15: counts from there
    assert policy.decide(19.0, [w], quorum=False) == []
    assert policy.decide(20.0, [w], quorum=False) == [w]


def test_the_wait_must_be_positive() -> None:
    with pytest.raises(ValueError):
        TerminateAfter(0)

"""Group commit's policy (consensus/groupcommit.py): one fdatasync for all the WAL that arrived together."""

from __future__ import annotations

from sidecar.consensus.groupcommit import Decision, GroupCommit

SYNC_AT = 1000
DELAY = 5.0


def _policy() -> GroupCommit:
    return GroupCommit(sync_at=SYNC_AT, max_delay=DELAY)


def test_nothing_unsynced_waits_for_input() -> None:
    g = _policy()
    assert g.decide(100, 100, more_waiting=True, syncing=False, now=0) is Decision.WAIT
    assert g.decide(100, 100, more_waiting=False, syncing=False, now=0) is Decision.WAIT


def test_input_already_here_is_read_before_the_sync_that_covers_it() -> None:
    g = _policy()
    assert g.decide(200, 100, more_waiting=True, syncing=False, now=0) is Decision.LATER
    assert g.decide(300, 100, more_waiting=True, syncing=False, now=1) is Decision.LATER
    assert g.decide(400, 100, more_waiting=False, syncing=False, now=2) is Decision.SYNC_NOW


def test_a_socket_that_never_drains_still_gets_a_sync_by_size() -> None:
    g = _policy()
    assert g.decide(100 + SYNC_AT - 1, 100, more_waiting=True, syncing=False, now=0) is Decision.LATER
    assert g.decide(100 + SYNC_AT, 100, more_waiting=True, syncing=False, now=0) is Decision.SYNC_NOW


def test_a_socket_that_never_drains_still_gets_a_sync_by_age() -> None:
    g = _policy()
    assert g.decide(150, 100, more_waiting=True, syncing=False, now=10) is Decision.LATER
    assert g.decide(160, 100, more_waiting=True, syncing=False, now=10 + DELAY - 1) is Decision.LATER
    assert g.decide(170, 100, more_waiting=True, syncing=False, now=10 + DELAY) is Decision.SYNC_NOW


def test_the_age_counts_from_the_first_byte_left_unsynced_after_a_sync() -> None:
    g = _policy()
    assert g.decide(150, 100, more_waiting=True, syncing=False, now=0) is Decision.LATER
    g.synced()
    # Synced up to 150 at now=0; WAL written after it waits from when it was first seen.
    assert g.decide(200, 150, more_waiting=True, syncing=False, now=DELAY + 1) is Decision.LATER
    assert g.decide(250, 150, more_waiting=True, syncing=False, now=2 * DELAY + 1) is Decision.SYNC_NOW
    # Everything acknowledged: the clock starts again with the next unsynced byte.
    assert g.decide(250, 250, more_waiting=False, syncing=False, now=100) is Decision.WAIT
    assert g.decide(300, 250, more_waiting=True, syncing=False, now=101) is Decision.LATER


def test_a_sync_under_way_is_not_doubled() -> None:
    g = _policy()
    assert g.decide(200, 100, more_waiting=False, syncing=True, now=0) is Decision.WAIT
    assert g.decide(200, 100, more_waiting=True, syncing=True, now=0) is Decision.LATER
    assert g.decide(200, 100, more_waiting=False, syncing=False, now=0) is Decision.SYNC_NOW

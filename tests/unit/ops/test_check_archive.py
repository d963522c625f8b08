"""check's archive line: each safekeeper's backup_lsn against its commit_lsn, as InfoReply gives them."""

from __future__ import annotations

from dataclasses import replace

from sidecar.config import CheckSettings
from sidecar.consensus.messages import InfoReply
from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG
from sidecar.ops.check import ARCHIVE_LAG_FAILED, ARCHIVE_LAG_WARNING, SetupChecker


def reply(node_id: int, commit: int, backup: int) -> InfoReply:
    return InfoReply(node_id=node_id, system_id=7, wal_seg_size=SEG, pg_version=15, timeline=1, term=3,
                     last_log_term=3, flush_lsn=commit, commit_lsn=commit, proposer_connected=True, backup_lsn=backup)


def archive_lines(*replies: InfoReply) -> list[tuple[str, str]]:
    checker = SetupChecker(CheckSettings(pg_dsn="host=127.0.0.1", safekeepers=("127.0.0.1:1",), insecure=True))
    checker._archive(list(replies))
    return [(c.status, c.detail) for c in checker.checks if c.name == "archive"]


def test_a_safekeeper_whose_archive_lags_warns_then_fails() -> None:
    commit = 200 * SEG + 100
    lines = archive_lines(reply(1, commit, commit - commit % SEG),
                          reply(2, commit, commit - (ARCHIVE_LAG_WARNING + 1) * SEG),
                          reply(3, commit, commit - (ARCHIVE_LAG_FAILED + 1) * SEG))
    assert [s for s, _ in lines] == ["OK", "WARNING", "FAILED"]
    assert "safekeeper 3:" in lines[2][1] and f"{ARCHIVE_LAG_FAILED + 1} segment(s) behind" in lines[2][1]


def test_no_archived_wal_anywhere_is_a_warning_that_names_both_causes() -> None:
    (status, detail), = archive_lines(reply(1, 5 * SEG, 0), reply(2, 5 * SEG, 0))
    assert status == "WARNING" and "without --archive" in detail and "nothing was uploaded yet" in detail
    assert archive_lines() == []


def test_before_a_segment_can_be_complete_there_is_nothing_to_archive_yet() -> None:
    # A fresh cluster (`walsidecar up`): WAL begins in segment 1, the first whole segment is 2 or later.
    (status, detail), = archive_lines(reply(1, SEG + 0x52F510, 0), reply(2, 3 * SEG - 1, 0))
    assert (status, detail) == ("OK", "nothing to archive yet: commit_lsn 0/2FFFFFF is below 0/3000000, the earliest "
                                      "end of the first segment the safekeepers hold whole")
    (status, _), = archive_lines(reply(1, 3 * SEG, 0))
    assert status == "WARNING"  # segment 2 may be complete: it should have been uploaded


def test_an_archived_object_that_is_not_a_safekeeper_s_wal_fails_by_name() -> None:
    name = "000000010000000000000002"
    lines = archive_lines(replace(reply(1, 5 * SEG, 0), archive_mismatch=name), reply(2, 5 * SEG, 4 * SEG))
    assert [s for s, _ in lines] == ["FAILED", "OK"]
    assert lines[0][1].startswith(f"safekeeper 1: the archived object {name} is not its WAL")
    (status, detail), = archive_lines(replace(reply(1, 5 * SEG, 0), archive_mismatch=name))
    assert status == "FAILED" and name in detail  # not "nothing uploaded yet": it says what holds it

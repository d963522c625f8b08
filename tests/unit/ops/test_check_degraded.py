"""`check`'s degraded range line: FAILED while a range is open, from the proposer's endpoint or a safekeeper's copy."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from sidecar.consensus.messages import NO_DEGRADED, DegradedRange
from sidecar.ops.check import SetupChecker

RANGE = DegradedRange(4, 0x3000000, 2, frozenset({1, 3}))


def lines(prop: dict | None, copies: dict[str, DegradedRange], seen: bool = True) -> list[tuple[str, str]]:
    checker = SetupChecker.__new__(SetupChecker)
    checker._degrade_seen = seen  # noqa: SLF001
    checker.checks = []
    checker.s = SimpleNamespace(broker=(), cluster=None, proposer_metrics="127.0.0.1:9")  # no etcd asked
    checker.system_id = None
    checker._proposer_doc = prop  # noqa: SLF001
    checker._degraded_copies = copies  # noqa: SLF001
    asyncio.run(checker._degraded())  # noqa: SLF001
    return [(c.status, c.detail) for c in checker.checks]


def test_an_open_range_fails_the_check() -> None:
    status, detail = lines({"degraded": {"term": 4, "start_lsn": "0/3000000", "version": 2, "members": [1, 3]}},
                           {})[0]
    assert status == "FAILED" and "the proposer at 127.0.0.1:9" in detail and "term 4 from 0/3000000" in detail
    status, detail = lines(None, {"127.0.0.1:7601": RANGE, "127.0.0.1:7602": NO_DEGRADED})[0]
    assert status == "FAILED" and detail.startswith("safekeeper 127.0.0.1:7601 holds an open degraded range of term 4")
    assert "members: safekeepers 1, 3" in detail


def test_no_range_is_ok_and_a_cluster_that_never_degraded_gets_no_line() -> None:
    assert lines({"degraded": None}, {"127.0.0.1:7601": NO_DEGRADED}) == [
        ("OK", "none open: every acknowledged commit is on a quorum")]
    assert lines(None, {"127.0.0.1:7601": NO_DEGRADED}, seen=False) == []
    assert lines({"degraded": None, "commit_wait": "wait"}, {}, seen=False) == []

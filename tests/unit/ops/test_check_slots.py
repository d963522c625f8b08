"""`check`'s reader slot lines, from the slot report a safekeeper adds to its InfoReply."""

from __future__ import annotations

from sidecar.consensus import codec
from sidecar.consensus.messages import InfoReply, SlotHold
from sidecar.ops.check import SetupChecker

GB = 1 << 30


def lines(*slots: SlotHold) -> list[tuple[str, str]]:
    reply = InfoReply(1, 7, 16 << 20, 15, 1, 3, 3, 20 * GB, 20 * GB, True, 5432, 0, 10 * GB, slots)
    checker = SetupChecker.__new__(SetupChecker)
    checker.checks = []
    checker._reader_slots("127.0.0.1:7601", reply)  # noqa: SLF001
    return [(c.status, c.detail) for c in checker.checks]


def test_slots_holding_wal_are_reported_warning_at_half_the_bound_failed_at_it_or_invalidated() -> None:
    assert lines() == []
    assert lines(SlotHold("standby1", GB))[0][0] == "OK"
    status, detail = lines(SlotHold("standby1", GB), SlotHold("pin", 6 * GB))[0]
    assert status == "WARNING" and detail.startswith(f"pin holds {6 * GB} bytes")
    assert lines(SlotHold("pin", 10 * GB))[0][0] == "FAILED"
    status, detail = lines(SlotHold("pin", 0, invalidated=True))[0]
    assert status == "FAILED" and "pin invalidated" in detail


def test_the_slot_report_survives_the_wire() -> None:
    m = InfoReply(1, 7, 16 << 20, 15, 1, 3, 3, 8, 8, False, 0, 0, 10 * GB, (SlotHold("a", 5), SlotHold("b", 0, True)))
    frame = codec.encode(m)
    assert codec.decode(frame[4], frame[5:]) == m

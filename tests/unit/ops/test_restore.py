"""restore-wal's pieces that need no safekeeper: names, exit codes, unreachable safekeepers, the atomic write."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from sidecar.config import RestoreWalSettings
from sidecar.ops.restore import Exit, restore_wal, stops_recovery, write_atomically


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings(*ports: int, **kw: object) -> RestoreWalSettings:
    return RestoreWalSettings(safekeeper_readers=tuple(f"127.0.0.1:{p}" for p in ports), insecure=True,
                              reader_timeout=2, **kw)


def test_names_the_safekeepers_do_not_serve_are_not_found_without_asking(tmp_path: Path) -> None:
    s = settings(closed_port())
    for name in ("000000010000000000000003.partial", "000000010000000000000003.00000028.backup", "RECOVERYHISTORY",
                 "0000002.history"):
        assert restore_wal(s, name, tmp_path / "out") == Exit.NOT_FOUND, name
    assert not (tmp_path / "out").exists()


def test_unreachable_safekeepers_are_said_to_be_unreachable(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    s = settings(closed_port(), closed_port(), closed_port())
    assert restore_wal(s, "000000010000000000000003", tmp_path / "out", stop=False) == Exit.UNREACHABLE
    assert restore_wal(s, "00000002.history", tmp_path / "out", stop=False) == Exit.UNREACHABLE
    assert not (tmp_path / "out").exists()


class Clock:
    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_under_archive_recovery_what_cannot_be_decided_is_asked_again_then_stops_recovery(tmp_path: Path) -> None:
    s = settings(closed_port(), closed_port(), closed_port(), retry_for=6)
    clock = Clock()
    for name in ("000000010000000000000003", "00000002.history"):
        clock.slept.clear()
        code = restore_wal(s, name, tmp_path / "out", stop=True, sleep=clock.sleep, clock=clock)
        # Above 125: PostgreSQL stops archive recovery instead of opening without WAL that may exist.
        assert code == Exit.STOP + Exit.UNREACHABLE == 131
        assert clock.slept == [0.5, 1.0, 2.0] and sum(clock.slept) <= 6
    assert not (tmp_path / "out").exists()
    # A name that is no WAL file is known not to be there: "not found" stops nothing.
    assert restore_wal(s, "RECOVERYHISTORY", tmp_path / "out", stop=True, sleep=clock.sleep,
                       clock=clock) == Exit.NOT_FOUND


def test_archive_recovery_is_told_from_standby_mode_by_the_signal_files(tmp_path: Path) -> None:
    s = settings(closed_port())
    assert stops_recovery(s, tmp_path) is False  # run by hand
    (tmp_path / "recovery.signal").touch()
    assert stops_recovery(s, tmp_path) is True
    (tmp_path / "standby.signal").touch()  # a standby streams and asks again: it never opens short
    assert stops_recovery(s, tmp_path) is False
    assert stops_recovery(settings(closed_port(), on_error="stop"), tmp_path) is True
    (tmp_path / "standby.signal").unlink()
    assert stops_recovery(settings(closed_port(), on_error="continue"), tmp_path) is False


def test_the_write_is_all_or_nothing(tmp_path: Path) -> None:
    target = tmp_path / "RECOVERYXLOG"
    target.write_bytes(b"old")
    write_atomically(target, b"new" * 1000)
    assert target.read_bytes() == b"new" * 1000
    assert sorted(os.listdir(tmp_path)) == ["RECOVERYXLOG"]
    with pytest.raises(OSError):
        write_atomically(tmp_path / "missing" / "RECOVERYXLOG", b"x")
    assert sorted(os.listdir(tmp_path)) == ["RECOVERYXLOG"]


def test_only_the_stop_codes_stop_recovery() -> None:
    # PostgreSQL aborts recovery when restore_command exits above 125 or by a signal.
    failures = [c for c in Exit if c is not Exit.STOP]
    assert all(0 <= c < 126 for c in failures) and len(set(Exit)) == len(list(Exit))
    assert all(125 < Exit.STOP + c < 256 for c in failures if c > Exit.NOT_FOUND)

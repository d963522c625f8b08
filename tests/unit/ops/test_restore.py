"""restore-wal's pieces that need no safekeeper: names, exit codes, unreachable safekeepers, the atomic write."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from sidecar.config import RestoreWalSettings
from sidecar.ops.restore import Exit, restore_wal, write_atomically


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
    assert restore_wal(s, "000000010000000000000003", tmp_path / "out") == Exit.UNREACHABLE
    assert restore_wal(s, "00000002.history", tmp_path / "out") == Exit.UNREACHABLE
    assert not (tmp_path / "out").exists()


def test_the_write_is_all_or_nothing(tmp_path: Path) -> None:
    target = tmp_path / "RECOVERYXLOG"
    target.write_bytes(b"old")
    write_atomically(target, b"new" * 1000)
    assert target.read_bytes() == b"new" * 1000
    assert sorted(os.listdir(tmp_path)) == ["RECOVERYXLOG"]
    with pytest.raises(OSError):
        write_atomically(tmp_path / "missing" / "RECOVERYXLOG", b"x")
    assert sorted(os.listdir(tmp_path)) == ["RECOVERYXLOG"]


def test_the_exit_codes_stay_below_what_stops_recovery() -> None:
    # PostgreSQL aborts recovery when restore_command exits above 125 or by a signal.
    assert all(0 <= c < 126 for c in Exit) and len(set(Exit)) == len(list(Exit))

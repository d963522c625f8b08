"""The check of tests/conftest.py that no walsidecar process a test started left a traceback in its log."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from support.tracebacks import is_walsidecar, report, tracebacks, walsidecar_logs

CRASH = ("2026-11-27 09:00:00 [info     ] streaming\nException in thread stream-1:\nTraceback (most recent call last):\n"
         '  File "server.py", line 1, in _serve\nasyncio.exceptions.IncompleteReadError: 0 bytes read\n')


def proc(path: Path, argv: list[str], text: str) -> SimpleNamespace:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return SimpleNamespace(log_path=path, argv=argv)


def test_it_finds_an_injected_traceback_in_a_walsidecar_log_and_nothing_in_clean_ones(tmp_path: Path) -> None:
    clean = proc(tmp_path / "procs" / "safekeeper1-0.log", [sys.executable, "-m", "sidecar", "safekeeper"], "ok\n")
    assert tracebacks(walsidecar_logs(tmp_path, [clean])) == {}
    crashed = proc(tmp_path / "procs" / "proposer-1.log", ["/opt/v/bin/walsidecar", "start"], CRASH)
    found = tracebacks(walsidecar_logs(tmp_path, [clean, crashed]))
    assert list(found) == [crashed.log_path]
    assert found[crashed.log_path].startswith("Traceback (most recent call last):")
    assert "IncompleteReadError" in report(found) and str(crashed.log_path) in report(found)


def test_it_reads_the_member_logs_of_an_up_but_not_the_logs_of_other_programs(tmp_path: Path) -> None:
    # `walsidecar up` writes its members' logs beside it; the test tracks only `up` itself.
    member = tmp_path / "up" / "safekeeper2.log"
    member.parent.mkdir()
    member.write_text(CRASH)
    etcd = proc(tmp_path / "procs" / "etcd-0.log", ["etcd", "--data-dir", "x"], CRASH)
    (tmp_path / "moto-4567.log").write_text(CRASH)  # moto_server's, started untracked by support/s3.py
    assert walsidecar_logs(tmp_path, [etcd]) == [member]
    assert list(tracebacks(walsidecar_logs(tmp_path, [etcd]))) == [member]


def test_what_counts_as_walsidecar() -> None:
    assert is_walsidecar(["/usr/local/bin/walsidecar", "restore-wal"])
    assert is_walsidecar([sys.executable, "-m", "sidecar", "start"])
    assert not is_walsidecar(["etcd", "--data-dir", "x"])
    assert not is_walsidecar([sys.executable, "-m", "moto.server"])

"""A short run of scripts/chaos.py: kills under load, then no acknowledged write is lost."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CHAOS = Path(__file__).resolve().parent.parent / "scripts" / "chaos.py"


def test_no_acknowledged_write_is_lost_under_chaos(test_dir: Path) -> None:
    base = test_dir / "chaos"
    out = subprocess.run([sys.executable, str(CHAOS), "--rounds", "6", "--seed", "1", "--dir", str(base)],
                         check=False, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    report = f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-6000:]}"
    assert out.returncode == 0, report
    summary = out.stdout.strip().splitlines()[-1]
    fields = dict(re.findall(r"(\w+)=(\S+)", summary))
    assert summary.startswith("summary:"), report
    assert fields["rounds"] == "6", report
    assert fields["lost"] == "0" and fields["wal_mismatches"] == "0", report
    assert int(fields["acknowledged"]) > 0, report
    assert fields["result"] == "ok", report
    assert not base.exists(), "the data directory is removed after a passing run"


def test_chaos_help() -> None:
    out = subprocess.run([sys.executable, str(CHAOS), "--help"], check=False, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--rounds" in out.stdout and "--seed" in out.stdout, out.stderr

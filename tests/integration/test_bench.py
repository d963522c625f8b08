"""The benchmark harness runs end to end (`scripts/bench.py --quick`); no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.pgcluster import ClusterError, find_bin_dir

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"async", "receivewal-1", "native-quorum", "walsidecar", "walsidecar-auth"}


def test_quick_benchmark_produces_every_output(test_dir: Path) -> None:
    try:
        find_bin_dir()
    except ClusterError as e:
        pytest.skip(str(e))
    out = test_dir / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--out", str(out),
                           "--workdir", str(test_dir)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    report = json.loads((out / "results.json").read_text())
    rows = report["rounds"]
    assert not [r for r in rows if r["workload"] == "error"]
    done = {(r["config"], r["workload"]) for r in rows}
    for config in CONFIGS:
        assert {(config, "pgbench-1"), (config, "pgbench-16"), (config, "bulk")} <= done
    assert {("native-quorum", "catchup"), ("walsidecar", "catchup")} <= done
    for r in rows:
        if r["workload"].startswith("pgbench"):
            assert r["tps"] > 0 and r["latency_p99_ms"] > 0 and r["transactions"] > 0
        if r["workload"] == "bulk":
            assert r["wal_bytes"] >= 32_000_000
    sidecar = next(r for r in rows if r["config"] == "walsidecar" and r["workload"] == "catchup")
    assert sidecar["catchup_bytes"] > 0 and sidecar["sidecar_peak_rss_mb_dead"] > 0

    table = (out / "results.md").read_text()
    assert table.startswith("| metric") and "walsidecar ÷ native-quorum" in table
    pytest.importorskip("matplotlib")
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_floor_safekeepers_carry_the_sidecar(test_dir: Path) -> None:
    """walsidecar-floor: the sidecar elects and commits against three scripts/floor_safekeeper.c."""
    try:
        find_bin_dir()
    except ClusterError as e:
        pytest.skip(str(e))
    out = test_dir / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--out", str(out),
                           "--workdir", str(test_dir), "--only", "walsidecar-floor,pgbench-1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    row, = json.loads((out / "results.json").read_text())["rounds"]
    assert (row["config"], row["workload"]) == ("walsidecar-floor", "pgbench-1")
    assert row["transactions"] > 0 and set(row["processes"]) == {"safekeeper1", "safekeeper2", "safekeeper3",
                                                                  "proposer"}

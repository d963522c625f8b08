"""The benchmark harness runs end to end (`scripts/bench.py --quick`); no timing is asserted."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.pgcluster import ClusterError, find_bin_dir

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"async", "receivewal-1", "native-quorum", "walsidecar", "walsidecar-auth"}


def quick_bench(test_dir: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`bench.py --quick ARGS` into test_dir/bench (skipped without PostgreSQL's binaries)."""
    try:
        find_bin_dir()
    except ClusterError as e:
        pytest.skip(str(e))
    out = test_dir / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--out", str(out),
                           "--workdir", str(test_dir), *args], capture_output=True, text=True, timeout=timeout)
    return proc, out


def test_quick_benchmark_produces_every_output(test_dir: Path) -> None:
    # --topology hosts where it can: the primary and the sidecar on one CPU, pgbench and the receivers on the others.
    pin = ["--topology", "hosts"] if len(os.sched_getaffinity(0)) > 1 else []
    proc, out = quick_bench(test_dir, *pin, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    report = json.loads((out / "results.json").read_text())
    rows = report["rounds"]
    assert not [r for r in rows if r["workload"] == "error"]
    done = {(r["config"], r["workload"]) for r in rows}
    for config in CONFIGS:
        assert {(config, w) for w in ("pgbench-1", "pgbench-16", "bulk", "pgbench-16-contended")} <= done
    for config in ("native-quorum", "walsidecar"):
        assert {(config, "catchup"), (config, "pgbench-16-one-down")} <= done
    for r in rows:
        if r["workload"].startswith("pgbench"):
            assert r["tps"] > 0 and r["latency_p99_ms"] > 0 and r["transactions"] > 0
        if r["workload"] == "bulk":
            assert r["wal_bytes"] >= 32_000_000
    sidecar = next(r for r in rows if r["config"] == "walsidecar" and r["workload"] == "catchup")
    assert sidecar["catchup_bytes"] > 0 and sidecar["sidecar_peak_rss_mb_dead"] > 0

    if pin:
        cpus = next(r for r in rows if r["config"] == "walsidecar" and r["workload"] == "pgbench-16")["cpus"]
        pinned = report["pinned"]
        assert pinned["topology"] == "hosts" and pinned["primary_cpus"] == cpus["postgres"] == cpus["proposer"]
        assert cpus["safekeeper1"] == pinned["receiver_cpus"] == pinned["pgbench_cpus"] != pinned["primary_cpus"]

    table = (out / "results.md").read_text()
    assert table.startswith("| metric") and "walsidecar ÷ native-quorum" in table
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("|")]
    rows_md = {r[0]: r for r in cells}
    head = rows_md["metric (median of rounds)"]
    one_down = rows_md["one receiver down: TPS ÷ all up (16 clients)"]
    assert float(one_down[head.index("walsidecar")]) > 0 and float(one_down[head.index("native-quorum")]) > 0
    assert "pgbench 16 clients, contended: TPS" in rows_md
    woken = rows_md["pgbench 1 client: wake-ups per transaction, each receiver"]
    assert float(woken[head.index("walsidecar")]) > 0 and float(woken[head.index("native-quorum")]) > 0
    assert "one safekeeper down: TPS ÷ all up (16 clients) ≥ 0.95" in table
    pytest.importorskip("matplotlib")
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_floors_carry_commits(test_dir: Path) -> None:
    """walsidecar-floor: the sidecar elects and commits against three scripts/floor_safekeeper.c;
    walsidecar-floor-all: scripts/floor_proposer.c does, in the sidecar's place, and over TLS in -tls."""
    floors = "walsidecar-floor,walsidecar-floor-all,walsidecar-floor-all-tls"
    proc, out = quick_bench(test_dir, "--only", f"{floors},pgbench-1", timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads((out / "results.json").read_text())["rounds"]
    assert [(r["config"], r["workload"]) for r in rows] == [("walsidecar-floor", "pgbench-1"),
                                                            ("walsidecar-floor-all", "pgbench-1"),
                                                            ("walsidecar-floor-all-tls", "pgbench-1")]
    for row in rows:
        assert row["transactions"] > 0 and set(row["processes"]) == {"safekeeper1", "safekeeper2", "safekeeper3",
                                                                      "proposer"}
        # Wake-ups (voluntary context switches) and read/write system calls per transaction, for each process;
        # the plain stand-in proposer makes only recv and send calls, which the kernel does not count among them
        # (over TLS, OpenSSL reads and writes).
        for name, p in row["processes"].items():
            counted = row["config"] != "walsidecar-floor-all" or name != "proposer"
            assert p["wakeups"] > 0 and p["wakeups_per_txn"] > 0 and (p["rw_syscalls"] > 0) == counted, (name, p)
        assert row["sidecar_wakeups_per_txn"] > 0 and row["receiver_rw_syscalls_per_txn"] > 0


def test_reader_flood_is_measured_beside_pgbench_1_as_a_ratio(test_dir: Path) -> None:
    """pgbench-1-reader-flood: strangers and readers on every reader port while pgbench-1 runs; the report holds
    the ratio of the mean latencies and the flood's own CPU."""
    # Two rounds: the second runs the flood first, right after the build.
    proc, out = quick_bench(test_dir, "--only", "walsidecar,pgbench-1-reader-flood", "--rounds", "2", timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads((out / "results.json").read_text())["rounds"]
    assert [(r["round"], r["workload"]) for r in rows] == [
        (1, "pgbench-1"), (1, "pgbench-1-reader-flood"), (2, "pgbench-1-reader-flood"), (2, "pgbench-1")]
    for flooded in (r for r in rows if r["workload"] == "pgbench-1-reader-flood"):
        assert flooded["transactions"] > 0 and flooded["safekeepers_cpu_cores"] > 0
        flood = flooded["flood"]
        assert flood["ports"] == 3 and flood["cpu_s"] > 0 and flood["read_mb_s"] > 0
        counts = flood["counts"]
        # Every kind happened, and the safekeepers answered each as the flood meant: a FATAL for the garbage,
        # a refused password; nobody logged in with the wrong one.
        assert counts.get("garbage startup: FATAL", 0) > 0, counts
        assert counts.get("wrong password: refused", 0) > 0, counts
        assert counts.get("reader pass", 0) >= 3, counts
        assert "wrong password: logged in" not in counts, counts

    table = (out / "results.md").read_text()
    cells = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")]
                               for line in table.splitlines() if line.startswith("|"))}
    head = cells["metric (median of rounds)"]
    ratio = float(cells["1 client: mean latency with a reader-port flood ÷ without"][head.index("walsidecar")])
    means = {w: statistics.median(r["latency_mean_ms"] for r in rows if r["workload"] == w)
             for w in ("pgbench-1", "pgbench-1-reader-flood")}
    assert ratio == pytest.approx(means["pgbench-1-reader-flood"] / means["pgbench-1"], abs=0.006)
    assert float(cells["reader-port flood: the flood's own CPU (cores)"][head.index("walsidecar")]) > 0
    assert "1 client: mean latency with a reader-port flood ÷ without ≤ 1.1" in table

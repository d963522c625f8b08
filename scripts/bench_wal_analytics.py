#!/usr/bin/env python3
"""Throughput of the WAL analytics next to pg_waldump, on a directory of WAL segments.

Measures `pg_waldump --stats=record` over all segments; walsidecar's segment scan in this process on one
core, from segments held in memory (decode, CRC and block references of every record, page header checks),
with the compiled kernel and with the Python reference decoder, and the compiled one in N processes at once;
and `analyze --stats` on Spark with local[N] for each N in --cores (a warm session: startup is excluded, one
warm-up run first). Each figure is the median
of --repeat runs; MB means 10^6 bytes of segment files. Prints a Markdown table; --json writes the rows.
--jit-times also measures, in fresh processes, the kernel's first call with an empty compile cache and with
a filled one.

    python3 tests/support/realwal.py /tmp/wal        # the test workload's WAL (needs PostgreSQL 15)
    python3 scripts/bench_wal_analytics.py /tmp/wal --cores 1,2 --repeat 3 --json bench.json

From other code: run(source, cores, repeat) returns the rows as dicts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Import this checkout's sidecar, not another installed copy.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.analytics.pipeline import analyze
from sidecar.analytics.session import StageProgress, spark_session
from sidecar.pgcluster import find_bin_dir
from sidecar.wal.archive import ArchivePlan, LocalStorage, plan_archive, scan_segment


class MemoryStorage:
    """Segment files held in memory, so that a scan measures decoding and not reading files."""

    def __init__(self, storage: LocalStorage) -> None:
        self.location = f"memory:{storage.location}"
        self.files = {name: storage.read(name) for name in storage.list_files()}

    def list_files(self) -> dict[str, int]:
        return {name: len(data) for name, data in self.files.items()}

    def read(self, name: str) -> bytes:
        return self.files[name]

    def read_range(self, name: str, start: int, length: int) -> bytes:
        return self.files.get(name, b"")[start : start + length]


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of repeat calls."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def scan_all(plan: ArchivePlan, engine: str, share: int = 0, shares: int = 1) -> None:
    """Scan every shares-th segment from the share-th on (all of them by default)."""
    by_segno = plan.by_segno()
    for seg in plan.segments[share::shares]:
        scan_segment(plan.storage, seg, by_segno, plan.seg_size, engine=engine)


_memory_plan: ArchivePlan | None = None


def _load(source: Path) -> None:
    """Process pool initializer: the segments in memory, and the kernel loaded."""
    global _memory_plan
    plan = plan_archive(LocalStorage(source))
    _memory_plan = ArchivePlan(MemoryStorage(LocalStorage(source)), plan.seg_size, plan.segments)
    scan_all(_memory_plan, "kernel", 0, 1)


def _scan_share(share: int, shares: int) -> None:
    assert _memory_plan is not None
    scan_all(_memory_plan, "kernel", share, shares)


def processes_seconds(source: Path, processes: int, repeat: int) -> float:
    """Median time of the compiled scan of all segments by `processes` processes, each taking every n-th one."""
    # forkserver, not fork: a caller such as scripts/bench.py may have threads running.
    context = multiprocessing.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(processes, context, initializer=_load, initargs=(source,)) as pool:
        def all_shares() -> None:
            list(pool.map(_scan_share, range(processes), [processes] * processes))

        all_shares()  # warm-up: every process has loaded its segments and the kernel
        return median_seconds(all_shares, repeat)


def row(what: str, cores: int, seconds: float, mb: float) -> dict[str, Any]:
    return {"what": what, "cores": cores, "seconds": round(seconds, 4), "mb_per_s": round(mb / seconds, 1),
            "mb_per_s_per_core": round(mb / seconds / cores, 1)}


def spark_seconds(plan: ArchivePlan, cores: int, repeat: int) -> float:
    """Median time of analyze --stats on a warm Spark session with local[cores]."""
    with spark_session(f"local[{cores}]") as spark:
        work = functools.partial(analyze, spark, plan, StageProgress(spark, None), out=None, want_stats=True)
        work()  # warm-up: Python workers start and load the compiled scan, the JVM compiles
        return median_seconds(work, repeat)


def run(source: Path, cores: list[int], repeat: int) -> list[dict[str, Any]]:
    """Rows (what, cores, seconds, mb_per_s, mb_per_s_per_core) for pg_waldump, the scan with each engine and Spark."""
    plan = plan_archive(LocalStorage(source))
    mb = sum(s.size for s in plan.segments) / 1e6
    first, last = plan.segments[0].name, plan.segments[-1].name
    waldump = [str(find_bin_dir() / "pg_waldump"), "--stats=record", "--path", str(source), first, last]
    rows = [row("pg_waldump --stats=record (C)", 1,
                median_seconds(lambda: subprocess.run(waldump, capture_output=True, check=False), repeat), mb)]
    memory = ArchivePlan(MemoryStorage(LocalStorage(source)), plan.seg_size, plan.segments)
    for engine, what in (("kernel", "segment scan, compiled kernel (numba)"),
                         ("python", "segment scan, Python reference decoder")):
        scan = functools.partial(scan_all, memory, engine)
        scan()  # warm-up: loads (or compiles) the kernel
        rows.append(row(what, 1, median_seconds(scan, repeat), mb))
    for n in cores:
        if n > 1:
            rows.append(row(f"segment scan, compiled kernel, {n} processes", n,
                            processes_seconds(source, n, repeat), mb))
    for n in cores:
        rows.append(row(f"analyze --stats on Spark local[{n}]", n, spark_seconds(plan, n, repeat), mb))
    return rows


# In a fresh process: seconds to import the kernel (and numba), then of a first scan of the first segment.
_FIRST_CALL = """
import sys, time
t = time.perf_counter()
import sidecar.wal.kernel
from sidecar.wal.archive import LocalStorage, plan_archive, scan_segment
imported = time.perf_counter() - t
plan = plan_archive(LocalStorage(sys.argv[1]))
t = time.perf_counter()
scan_segment(plan.storage, plan.segments[0], plan.by_segno(), plan.seg_size)
print(imported, time.perf_counter() - t)
"""


def jit_times(source: Path) -> dict[str, float]:
    """Seconds of importing the kernel and of its first call in a fresh process, first with an empty compile
    cache (it compiles), then with the cache that run filled (it loads)."""
    with tempfile.TemporaryDirectory(prefix="walsidecar-numba-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}

        def first_call() -> list[float]:
            out = subprocess.run([sys.executable, "-c", _FIRST_CALL, str(source)], env=env, capture_output=True,
                                 text=True, check=True).stdout
            return [round(float(v), 2) for v in out.split()]

        import_s, compile_s = first_call()
        _, cache_load_s = first_call()
        return {"import_s": import_s, "compile_s": compile_s, "cache_load_s": cache_load_s}


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| what | cores | seconds | MB/s | MB/s per core |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['what']} | {r['cores']} | {r['seconds']:.3f} | {r['mb_per_s']:.0f} | {r['mb_per_s_per_core']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="directory of WAL segment files")
    parser.add_argument("--cores", default="1,2", help="comma-separated local[N] core counts for Spark")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (the median is shown)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows (and --jit-times) as JSON")
    parser.add_argument("--jit-times", action="store_true", help="measure the kernel's compile and cache-load time")
    args = parser.parse_args()

    plan = plan_archive(LocalStorage(args.source))
    print(f"{len(plan.segments)} segments, {sum(s.size for s in plan.segments) / 1e6:.0f} MB", file=sys.stderr)
    rows = run(args.source, [int(c) for c in args.cores.split(",")], args.repeat)
    print_table(rows)
    result: dict[str, Any] = {"rows": rows}
    if args.jit_times:
        result["jit"] = jit_times(args.source)
        jit = result["jit"]
        print(f"\nfresh process: import {jit['import_s']} s; first scan {jit['compile_s']} s compiling,"
              f" {jit['cache_load_s']} s with the cache")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Throughput of the WAL analytics next to pg_waldump, on a directory of WAL segments.

Measures `pg_waldump --stats=record` over all segments, walsidecar's decoder in this process on one
core (decode, CRC and block references of every record), and `analyze --stats` on Spark with local[N]
for each N in --cores (a warm session: startup is excluded, one warm-up run first). MB means 10^6 bytes
of segment files. Prints a Markdown table.

    python3 scripts/bench_wal_analytics.py /path/to/archive --cores 1,2 --repeat 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Import this checkout's sidecar, not another installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sidecar.analytics.pipeline import analyze
from sidecar.analytics.session import StageProgress, spark_session
from sidecar.pgcluster import find_bin_dir
from sidecar.wal.archive import ArchivePlan, LocalStorage, plan_archive, scan_segment


def best(fn: object, repeat: int) -> float:
    """Median wall time of repeat calls."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode_all(plan: ArchivePlan) -> None:
    by_segno = plan.by_segno()
    for seg in plan.segments:
        scan_segment(plan.storage, seg, by_segno, plan.seg_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="directory of WAL segment files")
    parser.add_argument("--cores", default="1,2", help="comma-separated local[N] core counts for Spark")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (the median is shown)")
    args = parser.parse_args()

    plan = plan_archive(LocalStorage(args.source))
    mb = sum(s.size for s in plan.segments) / 1e6
    first, last = plan.segments[0].name, plan.segments[-1].name
    waldump = [str(find_bin_dir() / "pg_waldump"), "--stats=record", "--path", str(args.source), first, last]
    rows = [("pg_waldump --stats=record (C, 1 core)",
             best(lambda: subprocess.run(waldump, capture_output=True, check=False), args.repeat))]
    print(f"{len(plan.segments)} segments, {mb:.0f} MB", file=sys.stderr)
    rows.append(("walsidecar decoder in-process (Python, 1 core)", best(lambda: decode_all(plan), args.repeat)))
    for cores in (int(c) for c in args.cores.split(",")):
        with spark_session(f"local[{cores}]") as spark:
            quiet = StageProgress(spark, None)
            run = functools.partial(analyze, spark, plan, quiet, out=None, want_stats=True)
            run()  # warm-up: Python workers start, the JVM compiles
            rows.append((f"analyze --stats on Spark local[{cores}]", best(run, args.repeat)))
    print("| what | seconds | MB/s |")
    print("|---|---:|---:|")
    for what, seconds in rows:
        print(f"| {what} | {seconds:.2f} | {mb / seconds:.0f} |")


if __name__ == "__main__":
    main()

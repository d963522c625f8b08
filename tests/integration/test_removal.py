"""WAL removal and the disk guard on real safekeepers behind a real PostgreSQL 15 primary.

One deployment, three safekeepers, every one with --keep-wal 16MiB: safekeeper 2 keeps its wal/
bounded while WAL grows; a reader slot on safekeeper 1 pins its WAL until pg_receivewal moves it;
safekeeper 3 (--max-disk-usage 48MiB) has a slot that pins WAL past its limit, stops taking WAL
while commits go on with the other two, says why in /status, /metrics and `check`, and resumes
and catches up once the slot is dropped.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from support.backends import PgServer
from support.deployment import APP, Deployment, commit_lsn_of
from support.helpers import free_port, wait_for, walsidecar
from support.procs import ProcessTracker
from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG, format_lsn, parse_lsn
from sidecar.pgcluster import find_bin_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEEP = SEG  # --keep-wal 16MiB
# The retention, the segment the last record is in and the one a commit may still be in.
BOUND = KEEP + 2 * SEG
LIMIT = 3 * SEG  # safekeeper 3's --max-disk-usage


def wal_bytes(d: Deployment, i: int) -> int:
    return sum(p.stat().st_size for p in (d.sk_dir(i) / "wal").iterdir())


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def replication(d: Deployment, i: int) -> psycopg.Connection:
    return psycopg.connect(d.reader_dsn(i), replication="true", autocommit=True, prepare_threshold=None)


def next_segment(d: Deployment) -> int:
    """One acknowledged commit in a new segment (pg_switch_wal); its commit LSN."""
    with d.sql() as c:
        c.execute("INSERT INTO load SELECT g, repeat('r', 100) FROM generate_series(1, 100) g")
        c.execute("SELECT pg_switch_wal()")
        return commit_lsn_of(c, "INSERT INTO load VALUES (-1, 'after the switch')")


def test_removal_keeps_wal_bounded_slots_pin_it_and_the_disk_guard_stops_and_resumes(
        pg_factory: Callable[..., PgServer], procs: ProcessTracker, test_dir: Path) -> None:
    d = Deployment(pg_factory(settings={"synchronous_standby_names": APP}), procs, test_dir)
    ports = {i: free_port() for i in (1, 2, 3)}
    for i in (1, 2, 3):
        d.extra[f"safekeeper{i}"] = ["--keep-wal", "16MiB", "--metrics", f"127.0.0.1:{ports[i]}"] + \
            (["--max-disk-usage", "48MiB"] if i == 3 else [])
    d.start_all()

    def status(i: int) -> dict[str, Any]:
        return json.loads(get(f"http://127.0.0.1:{ports[i]}/status"))

    def metric(i: int, name: str) -> float:
        line = next(x for x in get(f"http://127.0.0.1:{ports[i]}/metrics").splitlines() if x.startswith(name + "{"))
        return float(line.rpartition(" ")[2])

    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
    # A slot reserves WAL from what its safekeeper knows is committed, which reaches it with the next Append.
    for i in (1, 3):
        wait_for(lambda: parse_lsn(status(i)["commit_lsn"]) > 0, timeout=30, what=f"safekeeper {i} to know a commit")
    with replication(d, 1) as r:
        r.execute("CREATE_REPLICATION_SLOT pin1 PHYSICAL RESERVE_WAL")
    with replication(d, 3) as r:
        pin3 = parse_lsn(r.execute("CREATE_REPLICATION_SLOT guard3 PHYSICAL RESERVE_WAL").fetchone()[1])
    first = pin3 - pin3 % SEG

    # Six segments of WAL, every commit acknowledged: once safekeeper 3 stops, by 1 and 2.
    for _ in range(6):
        end = next_segment(d)
    for i in (1, 2):
        wait_for(lambda: parse_lsn(status(i)["flush_lsn"]) >= end, timeout=60, what=f"safekeeper {i} to flush it all")
    wait_for(lambda: wal_bytes(d, 2) <= BOUND, timeout=30, what="safekeeper 2 to remove below its retention")
    assert end - first > 2 * BOUND
    assert status(2)["removal_held_by"] in ("the retention (--keep-wal)", "flush_lsn", "commit_lsn")
    wait_for(lambda: metric(2, "walsidecar_safekeeper_wal_disk_bytes") <= BOUND, timeout=10,
             what="the metric to show what is on disk")
    # Removed WAL is refused as PostgreSQL refuses a recycled segment.
    with replication(d, 2) as r, pytest.raises(psycopg.Error) as refused:
        r.execute(f"START_REPLICATION PHYSICAL {format_lsn(first)}")
    assert refused.value.sqlstate == "58P01", refused.value

    # Safekeeper 1's slot holds every segment from its own on.
    s1 = status(1)
    assert s1["removal_held_by"] == 'reader slot "pin1"' and parse_lsn(s1["removal_horizon"]) <= first
    assert wal_bytes(d, 1) >= end - first

    # Safekeeper 3's slot pinned WAL past --max-disk-usage: it stopped taking WAL, and says why.
    wait_for(lambda: metric(3, "walsidecar_safekeeper_disk_guard_active") == 1, timeout=30,
             what="safekeeper 3's disk guard")
    s3 = status(3)
    assert 'reader slot "guard3"' in s3["disk_guard"] and parse_lsn(s3["flush_lsn"]) < end
    assert LIMIT < s3["wal_bytes"] <= LIMIT + SEG  # measured as each segment is begun
    check = walsidecar("check", "--pg-dsn", d.pg.dsn(), "--safekeepers", ",".join(d.addresses), *d.tls("client"))
    assert check.returncode == 1, check.stdout
    line = next(x for x in check.stdout.splitlines() if f"safekeeper {d.addresses[2]}:" in x)
    assert "FAILED" in line and "disk guard" in line and 'reader slot "guard3"' in line, line
    assert "advance or drop that reader slot" in line, line
    assert "safekeeper quorum: OK (2 of 3 usable" in check.stdout, check.stdout

    # The slot goes: WAL is removed, the guard lets WAL in and safekeeper 3 catches up.
    with replication(d, 3) as r:
        r.execute("DROP_REPLICATION_SLOT guard3")
    end = next_segment(d)
    wait_for(lambda: metric(3, "walsidecar_safekeeper_disk_guard_active") == 0, timeout=30,
             what="safekeeper 3 to take WAL again")
    wait_for(lambda: parse_lsn(status(3)["flush_lsn"]) >= end, timeout=60, what="safekeeper 3 to catch up")
    wait_for(lambda: wal_bytes(d, 3) <= BOUND, timeout=30, what="safekeeper 3 to remove below its retention")

    # pg_receivewal moves safekeeper 1's slot; the WAL behind it goes.
    recv = test_dir / "recv"
    recv.mkdir()
    receiver = procs.start([str(find_bin_dir() / "pg_receivewal"), "-d", d.reader_dsn(1), "-D", str(recv),
                            "-S", "pin1", "--status-interval=1", "--synchronous", "--no-loop"], name="pg_receivewal")
    wait_for(lambda: parse_lsn(status(1)["slots"][0]["restart_lsn"]) >= end, timeout=60,
             what="pg_receivewal to move slot pin1")
    receiver.interrupt()
    wait_for(lambda: wal_bytes(d, 1) <= BOUND, timeout=30, what="safekeeper 1 to remove what pin1 held")
    with d.sql() as c:
        assert c.execute("SELECT count(*) FROM load").fetchone()[0] == 7 * 101

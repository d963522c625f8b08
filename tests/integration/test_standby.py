"""A standby fed by the safekeepers cannot lose its WAL (real PostgreSQL 15, safekeepers archiving and removing).

It streams from safekeeper 1 with a reader slot there, so that safekeeper removes nothing it has not received;
what no safekeeper holds any more it restores from the archive with `walsidecar restore-wal`. Either way it catches
up after a bulk load written while it was away, and `failover` promotes it with every acknowledged row.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psycopg
import pytest

from support.deployment import APP, Deployment, Writer, backup_lsn, reader_settings
from support.helpers import free_port, wait_for, walsidecar
from support.procs import ProcessTracker
from sidecar.deployment import Standby
from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG, format_lsn, parse_lsn, parse_segment_file_name, segment_file_name
from sidecar.pgcluster import LocalCluster
from sidecar.walclient import WalReader

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BULK_ROWS = 700_000  # about 260 MB of WAL: many segments archived and removed while the standby is away


@pytest.fixture
def archiving(pg_factory, procs: ProcessTracker, test_dir: Path) -> Deployment:  # noqa: ANN001
    """The usual deployment, every safekeeper archiving to a directory and removing what is archived."""
    d = Deployment(pg_factory(settings={"synchronous_standby_names": APP}), procs, test_dir)
    for i in (1, 2, 3):
        d.extra[f"safekeeper{i}"] = ["--archive", f"file://{test_dir}/archive"]
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
    return d


def replay_lsn(standby: Standby) -> int:
    with psycopg.connect(standby.server.dsn(), autocommit=True, connect_timeout=5) as c:
        return parse_lsn(c.execute("SELECT coalesce(pg_last_wal_replay_lsn(), '0/0')::text").fetchone()[0])


def bulk_load(d: Deployment) -> int:
    """Hundreds of MB of WAL, committed; the primary's flush position after it."""
    with d.sql() as c:
        c.execute("INSERT INTO load SELECT -g, repeat('b', 300) FROM generate_series(1, %s) g", (BULK_ROWS,))
        c.execute("SELECT pg_switch_wal()")
        c.execute("INSERT INTO load VALUES (0, 'after the bulk load')")
        return parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])


def slot_lsn(d: Deployment, address: object, slot: str) -> int:
    """Where `slot` stands on the safekeeper whose reader port is `address` (AssertionError: no such slot)."""
    with WalReader(address, reader_settings(d)) as r:  # type: ignore[arg-type]
        got = r.read_slot(slot)
    assert got is not None, f"no reader slot {slot!r} on {address}"
    return got[0]


def test_a_standby_fed_by_the_safekeepers_catches_up_after_a_bulk_load_and_is_promoted(
        archiving: Deployment, test_dir: Path) -> None:
    d = archiving
    standby = Standby(d, LocalCluster(test_dir / "standby" / "data", free_port(),
                                      log_file=test_dir / "standby" / "server.log"),
                      archive=f"file://{test_dir}/archive")
    d.add(standby)
    standby.start()
    try:
        # It streams, and its slot on every safekeeper follows it.
        with d.sql() as c:
            for _ in range(2):
                c.execute("INSERT INTO load SELECT g, repeat('s', 300) FROM generate_series(1, 5000) g")
                c.execute("SELECT pg_switch_wal()")
            c.execute("INSERT INTO load VALUES (0, 'two segments on')")
            there = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
        wait_for(lambda: replay_lsn(standby) >= there, timeout=60, ignore=(psycopg.OperationalError,),
                 what=f"the standby to replay up to {format_lsn(there)}")
        source = d.reader_addresses[0]
        wait_for(lambda: slot_lsn(d, source, standby.slot) >= there - there % SEG, timeout=30,
                 what="the standby's slot to follow it")
        # Away while a bulk load is written, archived and removed from the safekeepers (up to its slot on 1).
        standby.stop()
        at = slot_lsn(d, source, standby.slot)
        end = bulk_load(d)
        assert end - at > 200 * 1024 * 1024
        wait_for(lambda: all(backup_lsn(d, i) >= end - end % SEG for i in (1, 2, 3)), timeout=120,
                 what=f"every safekeeper to archive up to {format_lsn(end - end % SEG)}")
        below = segment_file_name(1, at // SEG - 1)
        wait_for(lambda: not (d.sk_dir(1) / "wal" / below).exists(), timeout=60,
                 what=f"safekeeper 1 to remove {below}, archived and below the standby's slot")
        assert (d.sk_dir(1) / "wal" / segment_file_name(1, at // SEG)).exists(), \
            f"safekeeper 1 removed WAL at {format_lsn(at)} the standby had not received"
        standby.start()
        wait_for(lambda: replay_lsn(standby) >= end, timeout=180, ignore=(psycopg.OperationalError,),
                 what=f"the standby to stream up to {format_lsn(end)}")

        # Away again, and this time its slot is gone (as when safekeeper 1 loses its disk): what no
        # safekeeper holds comes from the archive through its restore_command.
        standby.stop()
        at = end
        end = bulk_load(d)
        with WalReader(source, reader_settings(d)) as r:
            r.drop_slot(standby.slot)
        wait_for(lambda: all(backup_lsn(d, i) >= end - end % SEG for i in (1, 2, 3)) and not any(
            (d.sk_dir(i) / "wal" / segment_file_name(1, at // SEG)).exists() for i in (1, 2, 3)), timeout=120,
            what=f"the safekeepers to archive and remove the segment of {format_lsn(at)}")
        writer = Writer(d.pg.dsn())
        writer.start()
        standby.start()
        wait_for(lambda: len(writer.acked) >= 100, timeout=60, what="acknowledged writes")
        os.kill(d.pg.postmaster_pid(), signal.SIGKILL)  # the primary's machine is gone
        wait_for(lambda: writer.error is not None, timeout=30, what="the writer's connection to die with the primary")
        acked = writer.stop()

        proc = walsidecar("failover", "--standby-dsn", standby.server.dsn(), "--safekeepers", ",".join(d.addresses),
                          "--reader-passfile", str(d.reader_passfile), "--timeout", "30", "--catchup-timeout", "60",
                          *d.tls("proposer"), timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert 'restored log file "' + segment_file_name(1, at // SEG) in standby.server.log_text()
        with psycopg.connect(standby.server.dsn(), autocommit=True) as c:
            assert c.execute("SELECT pg_is_in_recovery()").fetchone()[0] is False
            assert c.execute("SELECT count(*) FROM load WHERE id < 0").fetchone()[0] == 2 * BULK_ROWS
            have = {r[0] for r in c.execute("SELECT id FROM load WHERE id > 0")}
        assert not set(acked) - have, f"{len(set(acked) - have)} acknowledged rows are missing on the new primary"
    finally:
        standby.close()


def segnos(wal_dir: Path) -> list[int]:
    """The segment numbers of the WAL segment files in `wal_dir` (partial ones too)."""
    out = []
    for f in wal_dir.iterdir():
        try:
            out.append(parse_segment_file_name(f.name)[1])
        except ValueError:
            continue
    return out


def test_failover_names_the_reader_port_refusal_when_a_standby_without_slot_or_restore_command_fell_behind(
        archiving: Deployment, test_dir: Path) -> None:
    d = archiving
    standby = Standby(d, LocalCluster(test_dir / "standby" / "data", free_port(),
                                      log_file=test_dir / "standby" / "server.log"))
    d.add(standby)
    standby.start()
    try:
        wait_for(lambda: replay_lsn(standby) > 0, timeout=60, ignore=(psycopg.OperationalError,),
                 what="the standby to replay")
        # The recipe of old: streaming alone, without a slot or a restore_command.
        standby.stop()
        standby.server.set({"primary_slot_name": "", "restore_command": ""})
        with WalReader(d.reader_addresses[0], reader_settings(d)) as r:
            r.drop_slot(standby.slot)
        # It streams again from the end of its own WAL, at most the start of the segment after the last
        # file it has: once safekeeper 1 removed that one too, it holds nothing the standby asks for.
        last = max(segnos(standby.data_dir / "pg_wal"))

        def removed() -> bool:
            with d.sql() as c:
                c.execute("INSERT INTO load SELECT g, repeat('r', 300) FROM generate_series(1, 5000) g")
                c.execute("SELECT pg_switch_wal()")
                c.execute("INSERT INTO load VALUES (0, 'switched')")
            held = segnos(d.sk_dir(1) / "wal")
            return bool(held) and min(held) > last + 1
        wait_for(removed, timeout=180, what=f"safekeeper 1 to archive and remove the WAL up to segment {last + 1}")
        standby.start()
        os.kill(d.pg.postmaster_pid(), signal.SIGKILL)
        proc = walsidecar("failover", "--standby-dsn", standby.server.dsn(), "--safekeepers", ",".join(d.addresses),
                          "--reader-passfile", str(d.reader_passfile), "--timeout", "30", "--catchup-timeout", "3",
                          *d.tls("proposer"), timeout=300)
        out = proc.stdout
        assert proc.returncode == 1, out
        assert f"{d.reader_addresses[0]} refuses to stream from " in out, out
        assert "is not stored here (this safekeeper holds WAL from " in out, out
        assert ("Give the standby a reader slot where it streams (primary_slot_name) and a restore_command "
                "('walsidecar restore-wal %f %p ...'), then run failover again") in out, out
        assert "primary_conninfo fails or is empty" not in out
    finally:
        standby.close()


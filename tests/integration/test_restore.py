"""Reading WAL back from the safekeepers' reader ports: walclient, restore-wal and a restored primary (PG 15)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import shutil
import signal
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from support.deployment import Deployment, Writer, commit_lsn_of, read_wal, reader_settings
from support.backends import PgServer
from support.helpers import wait_for
from support.installed import installed_argv
from support.recovery import base_backup, recover
from sidecar.address import Address
from sidecar.cli import main
from sidecar.config import RestoreWalSettings
from sidecar.processes import process_tree
from sidecar.timelines import TimelineEntry
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, parse_lsn, segment_file_name
from sidecar.pgcluster import ClusterError
from sidecar.ops.restore import Exit, restore_wal
from sidecar.walclient import ReaderError, WalReader, copy_wal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SEG = DEFAULT_SEGMENT_SIZE


def commit_position(d: Deployment, i: int) -> int:
    """What safekeeper i serves: IDENTIFY_SYSTEM's xlogpos, its commit position."""
    with WalReader(d.reader_addresses[i - 1], reader_settings(d)) as r:
        return r.identify()[2]


def wait_committed_everywhere(d: Deployment, end: int) -> None:
    # The commit position reaches a safekeeper with the proposer's next message: poll for it.
    for i in (1, 2, 3):
        wait_for(lambda i=i: commit_position(d, i) >= end, timeout=60,
                 what=f"safekeeper {i}'s commit position to pass the last commit")


def primary_end(d: Deployment) -> int:
    with d.sql() as c:
        return parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])


def test_walclient_reads_committed_wal_as_the_primary_wrote_it(deployment: Deployment) -> None:
    d = deployment
    with d.sql() as c:
        c.execute("INSERT INTO load SELECT g, repeat('w', 200) FROM generate_series(1, 5000) g")
        end = commit_lsn_of(c, "INSERT INTO load VALUES (-1, 'last')")
    commit = wait_for(lambda: (p := commit_position(d, 1)) >= end and p, timeout=60,
                      what="safekeeper 1's commit position to pass the last commit")
    with WalReader(d.reader_addresses[0], reader_settings(d)) as r:
        system_id, tli, xlogpos = r.identify()
        assert tli == 1 and xlogpos >= commit
        assert r.wal_segment_size() == SEG
        start = commit - commit % SEG
        assert copy_wal(r, start, commit) == read_wal(d.pg.pg_wal_dir, start, commit)
        # Back in command mode after a stream we ended at stop_at.
        assert r.identify()[0] == system_id
        # Nothing is served past the commit position.
        with pytest.raises(ReaderError) as e:
            copy_wal(r, start + 4 * SEG, start + 5 * SEG)
        assert e.value.sqlstate == "22023", e.value
        # A stream left early ends cleanly too.
        for lsn, data in r.stream(start):
            assert lsn == start and data
            break
        assert r.identify()[0] == system_id


def test_readers_slot_create_list_drop_on_every_safekeeper(deployment: Deployment) -> None:
    d = deployment
    s = reader_settings(d)
    common = ["--safekeeper-readers", ",".join(s.safekeeper_readers), "--reader-passfile", str(d.reader_passfile),
              *d.link_args("reader", "client")]

    def slot(*args: str) -> tuple[int, list[str]]:
        out = CliRunner().invoke(main, ["readers", "slot", *args, *common])
        return out.exit_code, out.output.splitlines()

    code, lines = slot("create", "archiver")
    assert code == 0 and len(lines) == 3 and all("created slot archiver" in line for line in lines), lines
    code, lines = slot("create", "archiver")
    assert code == 1 and all("already exists" in line and "42710" in line for line in lines), lines
    code, lines = slot("list", "archiver", "other")
    assert code == 0 and all("archiver has no position yet; other does not exist" in line for line in lines), lines
    # A reader streaming with the slot moves it on the safekeeper it reads from.
    with d.sql() as c:
        end = commit_lsn_of(c, "INSERT INTO load VALUES (-2, 'slot')")
    commit = wait_for(lambda: (p := commit_position(d, 2)) >= end and p, timeout=60, what="a commit")
    with WalReader(d.reader_addresses[1], s) as r:
        for lsn, data in r.stream(commit - commit % SEG, slot="archiver", stop_at=commit):
            pass
        assert r.read_slot("archiver") == (commit, 1)
    code, lines = slot("drop", "archiver")
    assert code == 0 and len(lines) == 3, lines
    # --reserve-wal: the slot holds WAL from the commit position at once, as a standby made next needs.
    code, lines = slot("create", "standby", "--reserve-wal")
    assert code == 0 and all("created slot standby at 0/" in line for line in lines), lines
    code, lines = slot("list", "standby")
    assert all("standby at 0/" in line and "(timeline 1)" in line for line in lines), lines
    assert slot("drop", "standby")[0] == 0
    code, lines = slot("list", "archiver")
    assert all("archiver does not exist" in line for line in lines), lines
    assert CliRunner().invoke(main, ["readers", "slot", "create", "Bad-Name", *common]).exit_code == 2


# ---- restore-wal ---------------------------------------------------------------------------------


def postgres_owned(home: Path, d: Deployment) -> tuple[Path, Path]:
    """Copies of the reader's certificates and passfile that the postgres OS user can read: (certs, passfile)."""
    postgres = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
    certs = home / "certs"
    certs.mkdir(parents=True)
    for name in ("ca.crt", "node.crt", "node.key"):
        shutil.copy(d.certs_dir("reader", "client") / name, certs / name)
    passfile = home / "readers.pgpass"
    shutil.copy(d.reader_passfile, passfile)
    for p in (home, certs, *certs.iterdir(), passfile):
        if p.is_file():
            os.chmod(p, 0o600)
        if postgres is not None:
            os.chown(p, postgres.pw_uid, postgres.pw_gid)
    return certs, passfile


def workload_after_the_backup(d: Deployment, bulk_rows: int) -> tuple[list[int], int]:
    """Single-row commits and a bulk load across segments, committed on every safekeeper: (acked ids, end)."""
    writer = Writer(d.pg.dsn())
    writer.start()
    with d.sql() as c:
        c.execute("INSERT INTO load SELECT -g, repeat('b', 300) FROM generate_series(1, %s) g", (bulk_rows,))
    wait_for(lambda: len(writer.acked) >= 200, timeout=60, what="acknowledged single-row commits")
    acked = writer.stop()
    assert writer.error is None
    end = primary_end(d)
    wait_committed_everywhere(d, end)
    return acked, end


def test_a_wiped_primary_comes_back_from_a_base_backup_and_the_safekeepers(deployment: Deployment,
                                                                          test_dir: Path) -> None:
    d = deployment
    home = test_dir / "restored"
    certs, passfile = postgres_owned(home, d)
    restored = base_backup(home, d.pg.dsn())
    acked, end = workload_after_the_backup(d, 50000)

    # The primary's machine is gone.
    d.stop("proposer")
    d.pg.crash()
    shutil.rmtree(d.pg.data_dir)

    # The installed command, run by PostgreSQL as the postgres OS user, as in production.
    command = shlex.join(installed_argv("restore-wal", "%f", "%p", "--safekeeper-readers",
                                        ",".join(str(a) for a in d.reader_addresses), "--certs-dir", str(certs),
                                        "--reader-passfile", str(passfile)))
    try:
        recover(restored, command)
        with psycopg.connect(restored.dsn(), autocommit=True) as c:
            ids = {r[0] for r in c.execute("SELECT id FROM load WHERE id > 0")}
            assert not set(acked) - ids, f"{len(set(acked) - ids)} acknowledged rows lost"
            assert c.execute("SELECT count(*) FROM load WHERE id < 0").fetchone()[0] == 50000
            replayed = parse_lsn(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
            assert replayed >= end
        log = restored.log_text()
        # Whole segments, then the last one, partial and padded, each from a named safekeeper.
        assert log.count('restored log file "0000000100') >= 2, log[-3000:]
        assert "restored" in log and "safekeeper=" in log and "partial=True" in log, log[-3000:]
    finally:
        restored.teardown()


def test_restore_wal_refuses_what_is_not_there_or_not_intact(deployment: Deployment, test_dir: Path) -> None:
    d = deployment
    with d.sql() as c:
        c.execute("INSERT INTO load SELECT g, repeat('c', 300) FROM generate_series(1, 20000) g")
        switched = parse_lsn(c.execute("SELECT pg_switch_wal()::text").fetchone()[0])
        c.execute("INSERT INTO load VALUES (0, 'after the switch')")
    wait_committed_everywhere(d, primary_end(d))
    s = reader_settings(d)
    segno = switched // SEG
    name = segment_file_name(1, segno)
    out = test_dir / "RECOVERYXLOG"

    # Not written yet, a timeline that does not exist, no history beyond timeline 1: "does not exist".
    assert restore_wal(s, segment_file_name(1, segno + 50), out) == Exit.NOT_FOUND
    assert restore_wal(s, segment_file_name(7, segno), out) == Exit.NOT_FOUND
    assert restore_wal(s, "00000002.history", out) == Exit.NOT_FOUND
    assert not out.exists()

    # A damaged copy on the first safekeeper is refused; the next one serves the segment.
    stored = [next(d.sk_dir(i).rglob(name)) for i in (1, 2, 3)]
    with open(stored[0], "r+b") as f:
        f.seek(SEG // 2)
        f.write(b"\xde\xad\xbe\xef" * 8)
    assert restore_wal(s, name, out) == Exit.RESTORED
    assert out.read_bytes() == (d.pg.pg_wal_dir / name).read_bytes()
    out.unlink()

    # Damaged everywhere: nothing is written.
    for path in stored[1:]:
        with open(path, "r+b") as f:
            f.seek(SEG // 2)
            f.write(b"\xde\xad\xbe\xef" * 8)
    assert restore_wal(s, name, out) == Exit.BAD_DATA
    assert not out.exists() and [p.name for p in test_dir.iterdir() if "RECOVERYXLOG" in p.name] == []


def test_walclient_and_restore_wal_against_postgresqls_own_walsender_after_a_promotion(pg: PgServer,
                                                                                     test_dir: Path) -> None:
    """The reference server: a history file, and the end of a timeline, as PostgreSQL's walsender gives them."""
    with psycopg.connect(pg.dsn(), autocommit=True) as c:
        c.execute("CREATE TABLE t AS SELECT generate_series(1, 1000) AS i")
    pg.stop()
    (pg.data_dir / "standby.signal").write_text("")
    pg.start()
    pg.run_bin("pg_ctl", "-D", str(pg.data_dir), "-w", "promote")
    s = RestoreWalSettings(safekeeper_readers=(f"{pg.host}:{pg.port}",), insecure=True,
                           reader_user="postgres")
    with WalReader(Address.parse(s.safekeeper_readers[0]), s) as r:
        assert r.identify()[1] == 2
        content = r.timeline_history(2)
        assert content == (pg.pg_wal_dir / "00000002.history").read_text()
        switch = parse_lsn(content.split("\t")[1])
        start = switch - switch % SEG
        got = b"".join(data for _, data in r.stream(start, timeline=1))
        assert len(got) == switch - start and r.timeline_end == TimelineEntry(2, switch)
        assert r.identify()[1] == 2  # back in command mode after the end of the timeline
    out = test_dir / "RECOVERYHISTORY"
    assert restore_wal(s, "00000002.history", out) == Exit.RESTORED
    assert out.read_text() == content
    # Timeline 1 ends inside the switch segment (PostgreSQL keeps it only as .partial); timeline 2's
    # copy is served up to the end of the WAL, zero-padded.
    with WalReader(Address.parse(s.safekeeper_readers[0]), s) as r:
        written = r.identify()[2] - start
    seg = segment_file_name(2, switch // SEG)
    assert restore_wal(s, segment_file_name(1, switch // SEG), out) == Exit.NOT_FOUND
    assert restore_wal(s, seg, out) == Exit.RESTORED
    data = out.read_bytes()
    assert len(data) == SEG and data[:written] == (pg.pg_wal_dir / seg).read_bytes()[:written]


def test_archive_recovery_stops_instead_of_opening_short_when_too_few_safekeepers_answer(
        deployment: Deployment, test_dir: Path) -> None:
    d = deployment
    home = test_dir / "restored"
    certs, passfile = postgres_owned(home, d)
    restored = base_backup(home, d.pg.dsn())
    acked, _ = workload_after_the_backup(d, 20000)
    d.stop("proposer")
    d.pg.crash()
    shutil.rmtree(d.pg.data_dir)  # the primary's machine is gone

    # One safekeeper stopped, another that takes connections and never answers: only one answers, too
    # few to know where the committed WAL ends.
    d.stop("safekeeper2")
    silent = process_tree([d.process("safekeeper3").pid])  # with its reader process
    assert len(silent) == 2, f"safekeeper3 and its reader process, not {silent}"
    for pid in silent:
        os.kill(pid, signal.SIGSTOP)
    command = shlex.join(installed_argv("restore-wal", "%f", "%p", "--safekeeper-readers",
                                        ",".join(str(a) for a in d.reader_addresses), "--certs-dir", str(certs),
                                        "--reader-passfile", str(passfile), "--reader-timeout", "2",
                                        "--retry-for", "3"))
    try:
        with pytest.raises(ClusterError):
            recover(restored, command)
        log = restored.log_text()
        assert "FATAL:  could not restore file" in log and "child process exited with exit code 131" in log, \
            log[-3000:]
        assert "archive recovery complete" not in log and not restored.is_running(), log[-3000:]

        # The safekeepers back, the same server started again: recovery goes on and opens with every commit.
        for pid in silent:
            os.kill(pid, signal.SIGCONT)
        d.start("safekeeper2")
        recover(restored, command)
        with psycopg.connect(restored.dsn(), autocommit=True) as c:
            ids = {r[0] for r in c.execute("SELECT id FROM load WHERE id > 0")}
            assert c.execute("SELECT count(*) FROM load WHERE id < 0").fetchone()[0] == 20000
        assert not set(acked) - ids, f"{len(set(acked) - ids)} acknowledged rows lost"
    finally:
        for pid in silent:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        restored.teardown()

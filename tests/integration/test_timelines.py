"""A promoted standby as the new primary (real PostgreSQL 15): accepted when it holds every committed byte,
refused when it does not; the safekeepers lay its timeline out as its pg_wal and tell a reader of
timeline 1 where it ends."""

from __future__ import annotations

import asyncio
import os
import pwd
import re
from pathlib import Path

import psycopg
import pytest

from support.deployment import APP, Deployment, Writer, start_commit
from support.helpers import free_port, run, wait_for
from support.procs import ManagedProcess, ProcessTracker
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, format_lsn, parse_lsn, segment_file_name
from sidecar.pgcluster import LocalCluster
from sidecar.processes import sidecar_argv
from sidecar.proposer.replication import ReplicationStream, TimelineEnded, connect_replication

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SEG = DEFAULT_SEGMENT_SIZE


def standby_of(d: Deployment, home: Path) -> LocalCluster:
    """A plain streaming standby of the primary (not of the safekeepers), started and caught up."""
    postgres = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
    home.mkdir()
    if postgres is not None:
        os.chown(home, postgres.pw_uid, postgres.pw_gid)
    standby = LocalCluster(home / "data", free_port(), log_file=home / "standby.log")
    standby._prepare_log_file()
    standby.run_bin("pg_basebackup", "-D", str(standby.data_dir), "-d", d.pg.dsn(), "-X", "stream", "-c", "fast",
                    timeout=120)
    standby.set({"port": str(standby.port), "hot_standby": "on", "synchronous_standby_names": APP,
                 "primary_conninfo": d.pg.dsn(application_name="standby1")})
    (standby.data_dir / "standby.signal").touch()
    if postgres is not None:
        os.chown(standby.data_dir / "standby.signal", postgres.pw_uid, postgres.pw_gid)
    standby.start()
    return standby


def sql(server: LocalCluster, query: str) -> tuple:
    with psycopg.connect(server.dsn(), autocommit=True, connect_timeout=5) as c:
        return c.execute(query).fetchone()


def replayed(standby: LocalCluster) -> int:
    return parse_lsn(sql(standby, "SELECT pg_last_wal_replay_lsn()::text")[0])


def write_acknowledged(d: Deployment, rows: int) -> list[int]:
    writer = Writer(d.pg.dsn())
    writer.start()
    wait_for(lambda: len(writer.acked) >= rows, timeout=60, what="acknowledged writes")
    acked = writer.stop()
    assert writer.error is None
    return acked


def stop_primary(d: Deployment) -> int:
    """Stop the primary cleanly; the end of its WAL (the start of its shutdown checkpoint, which follows)."""
    with d.sql() as c:
        end = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
    d.members["primary"].stop()
    return end


def promote(standby: LocalCluster) -> int:
    """pg_promote(); the switch point (where timeline 2 begins), from its 00000002.history."""
    assert sql(standby, "SELECT pg_promote(true, 60)")[0] is True
    line = (standby.pg_wal_dir / "00000002.history").read_text().split("\t")
    return parse_lsn(line[1])


def sidecar_on(d: Deployment, procs: ProcessTracker, server: LocalCluster) -> ManagedProcess:
    """`walsidecar start` against `server`, with the deployment's safekeepers."""
    return procs.start(sidecar_argv("start", "--pg-dsn", server.dsn(), "--safekeepers", ",".join(d.addresses),
                                    "--application-name", APP, *d.tls("proposer")), name="proposer-tl2")


def stored(directory: Path, name: str) -> Path:
    path = directory / name
    return path if path.exists() else directory / (name + ".partial")


def test_a_promoted_standby_holding_every_committed_byte_becomes_the_primary(deployment: Deployment,
                                                                             procs: ProcessTracker,
                                                                             test_dir: Path) -> None:
    d = deployment
    standby = standby_of(d, test_dir / "standby")
    try:
        acked = write_acknowledged(d, 100)
        end = stop_primary(d)
        wait_for(lambda: replayed(standby) > end, timeout=60, what="the standby to replay the shutdown checkpoint")
        d.stop("proposer")
        switch = promote(standby)
        assert switch > end
        proposer = sidecar_on(d, procs, standby)

        def sync_streaming() -> bool:
            row = sql(standby, f"SELECT state, sync_state FROM pg_stat_replication WHERE application_name = '{APP}'")
            return row == ("streaming", "sync")
        wait_for(lambda: sync_streaming() or not proposer.running, timeout=60, ignore=(TypeError,),
                 what="the sidecar to stream from the promoted standby")
        assert proposer.running, proposer.log_path.read_text()[-3000:]
        assert "primary refused" not in proposer.log_path.read_text()
        with psycopg.connect(standby.dsn(), autocommit=True) as c:
            assert c.execute("SELECT count(*) FROM load WHERE id = ANY(%s)", (acked,)).fetchone()[0] == len(acked)
            # The WAL it writes is on timeline 2 (the control file says so only after the end-of-recovery
            # checkpoint, which a promotion runs in the background).
            assert c.execute("SELECT pg_walfile_name(pg_current_wal_lsn())").fetchone()[0][:8] == "00000002"

        # Commits wait for the quorum again: with two safekeepers down one waits, and returns with one back.
        d.safekeepers[2].kill9()
        d.safekeepers[3].kill9()
        thread, result = start_commit(standby.dsn(), "INSERT INTO load VALUES (-2, 'on timeline 2')")
        wait_for(lambda: sql(standby, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")[0] >= 1,
                 timeout=30, what="the commit to wait for the quorum")
        d.start_safekeeper(2)
        thread.join(60)
        assert not thread.is_alive() and "error" not in result, result
        d.start_safekeeper(3)
        flush = parse_lsn(sql(standby, "SELECT pg_current_wal_flush_lsn()::text")[0])

        # Every safekeeper holds the new primary's pg_wal layout: 00000002.history, and timeline 2's
        # segment holding the switch point with the same bytes as the new primary's.
        history = (standby.pg_wal_dir / "00000002.history").read_bytes()
        switch_seg = segment_file_name(2, switch // SEG)
        for i in (1, 2, 3):
            wal = d.sk_dir(i) / "wal"
            wait_for(lambda: (wal / "00000002.history").exists(), timeout=60, what=f"safekeeper {i}'s history file")
            assert (wal / "00000002.history").read_bytes() == history
            upto = min(flush, (switch // SEG + 1) * SEG) - (switch // SEG) * SEG
            theirs = (standby.pg_wal_dir / switch_seg).read_bytes()[:upto]
            wait_for(lambda: stored(wal, switch_seg).read_bytes()[:upto] == theirs, timeout=60,
                     ignore=(FileNotFoundError,), what=f"safekeeper {i} to hold {switch_seg} as the new primary does")
            assert not (wal / segment_file_name(1, switch // SEG)).exists()
            assert not (wal / (segment_file_name(1, switch // SEG) + ".partial")).exists()

        # A reader of timeline 1 is told where it ends and that timeline 2 follows.
        async def read_timeline_1() -> tuple[bytes, TimelineEnded]:
            conn = await connect_replication(d.reader_dsn(1), "tl1-reader")
            try:
                cur = await conn.execute("TIMELINE_HISTORY 2")
                name, content = await cur.fetchone()  # type: ignore[misc]
                got = bytes(content) if not isinstance(content, str) else content.encode()
                assert name == "00000002.history"
                received = bytearray()
                start = switch - switch % SEG
                stream = ReplicationStream(conn, start_lsn=start, timeline=1, slot=None,
                                           on_wal=lambda lsn, data: received.extend(data))
                await stream.start()
                with pytest.raises(TimelineEnded) as ended:
                    await asyncio.wait_for(stream.wait_closed(), 30)
                assert len(received) == switch - start
                return got, ended.value
            finally:
                await conn.close()
        content, ended = run(read_timeline_1())
        assert content == history
        assert (ended.next_tli, ended.next_lsn) == (2, switch)

        # pg_receivewal, resuming after the last timeline-1 segment it holds, follows the switch itself.
        recv = test_dir / "recv"
        recv.mkdir()
        before = segment_file_name(1, switch // SEG - 1)
        (recv / before).write_bytes((d.sk_dir(1) / "wal" / before).read_bytes())
        receiver = procs.start([str(standby.bin_dir / "pg_receivewal"), "-d", d.reader_dsn(1), "-D", str(recv),
                                "--no-loop", "-v"], name="pg_receivewal")
        wait_for(lambda: stored(recv, switch_seg).exists() and (recv / "00000002.history").exists(), timeout=60,
                 what="pg_receivewal to follow timeline 2")
        receiver.interrupt()
        assert (recv / "00000002.history").read_bytes() == history
        old = recv / (segment_file_name(1, switch // SEG) + ".partial")
        assert old.read_bytes()[:switch % SEG] == (standby.pg_wal_dir / switch_seg).read_bytes()[:switch % SEG]
        assert "switched to timeline 2 at " + format_lsn(switch) in receiver.log_path.read_text()
    finally:
        standby.teardown()


def test_a_standby_that_replayed_past_the_committed_end_gets_the_rest_of_timeline_1_committed_in_one_term(
        deployment: Deployment, procs: ProcessTracker, test_dir: Path) -> None:
    """The standby holds timeline 1's WAL past what the safekeepers have (the sidecar was down while the primary
    wrote it): the sidecar's first term on it streams timeline 1 from their end to the switch, and that WAL must
    be on a quorum before the term ends. Without the wait, each new term started below the switch again and
    ended at the switch again before its Appends were acknowledged, term after term."""
    d = deployment
    standby = standby_of(d, test_dir / "standby")
    try:
        write_acknowledged(d, 50)
        d.stop("proposer")
        with psycopg.connect(d.pg.dsn(), autocommit=True) as c:
            c.execute("SET synchronous_commit = local")  # nobody acknowledges: the sidecar is down
            c.execute("INSERT INTO load SELECT g, repeat('x', 200) FROM generate_series(1, 2000) g")
        end = stop_primary(d)
        wait_for(lambda: replayed(standby) > end, timeout=60, what="the standby to replay the shutdown checkpoint")
        switch = promote(standby)
        proposer = sidecar_on(d, procs, standby)
        wait_for(lambda: sql(standby, f"SELECT sync_state FROM pg_stat_replication WHERE application_name = '{APP}'")
                 == ("sync",) or not proposer.running, timeout=60, ignore=(TypeError,),
                 what="the sidecar to stream from the promoted standby")
        log = proposer.log_path.read_text()
        assert proposer.running, log[-3000:]
        assert log.count("the primary's timeline ended") == 1, log[-4000:]
        assert re.search(r"committed_to_the_switch[\"=: ]+(True|true)", log), log[-3000:]
        assert format_lsn(switch) in log
    finally:
        standby.teardown()


def test_a_standby_promoted_behind_the_committed_position_is_refused(deployment: Deployment,
                                                                     procs: ProcessTracker, test_dir: Path) -> None:
    d = deployment
    standby = standby_of(d, test_dir / "standby")
    try:
        write_acknowledged(d, 20)
        with d.sql() as c:
            flush = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
        wait_for(lambda: replayed(standby) >= flush, timeout=60, what="the standby to catch up")
        standby.stop()
        write_acknowledged(d, 50)  # acknowledged by the quorum, never seen by the standby
        stop_primary(d)
        d.stop("proposer")
        standby.start()
        switch = promote(standby)
        # Past the committed position by WAL of its own: only its timeline history shows what it lacks.
        sql(standby, "SELECT pg_switch_wal()")
        proposer = sidecar_on(d, procs, standby)
        wait_for(lambda: not proposer.running, timeout=60, what="the sidecar to refuse the promoted standby")
        assert proposer.returncode != 0
        log = proposer.log_path.read_text()
        assert re.search(rf"at {format_lsn(switch)}, below the quorum-committed position [0-9A-F]+/[0-9A-F]+: "
                         "it was promoted", log), log[-3000:]
        assert sql(standby, f"SELECT count(*) FROM pg_stat_replication WHERE application_name = '{APP}'")[0] == 0
    finally:
        standby.teardown()

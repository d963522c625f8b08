"""`walsidecar failover` against real PostgreSQL 15: a standby streaming from a safekeeper's reader port
is promoted after the primary is killed with SIGKILL, with every acknowledged commit."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psycopg
import pytest

from support.deployment import APP, Deployment, Writer, add_standby, start_commit, syncrep_waiters
from support.helpers import free_port, wait_for, walsidecar
from support.procs import ProcessTracker
from sidecar.deployment import Standby
from sidecar.processes import sidecar_argv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def failover(d: Deployment, standby: Standby, *extra: str) -> tuple[int, str]:
    proc = walsidecar("failover", "--standby-dsn", standby.server.dsn(), "--safekeepers", ",".join(d.addresses),
                      "--reader-passfile", str(d.reader_passfile), "--timeout", "30", *d.tls("proposer"), *extra,
                      timeout=180)
    print(proc.stdout, proc.stderr)
    return proc.returncode, proc.stdout


def undo(d: Deployment) -> subprocess.CompletedProcess[str]:
    proc = walsidecar("failover", "--undo", "--safekeepers", ",".join(d.addresses), "--reader-passfile",
                      str(d.reader_passfile), "--timeout", "30", *d.tls("proposer"), timeout=120)
    print(proc.stdout, proc.stderr)
    return proc


def streaming(dsn: str) -> bool:
    """Whether the server's WAL receiver streams."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as c:
        return bool(c.execute("SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'").fetchone()[0])


def rows(dsn: str, ids: list[int]) -> int:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as c:
        return c.execute("SELECT count(DISTINCT id) FROM load WHERE id = ANY(%s)", (ids,)).fetchone()[0]


def replayed(standby: Standby) -> bool:
    with psycopg.connect(standby.server.dsn(), autocommit=True, connect_timeout=5) as c:
        return c.execute("SELECT pg_last_wal_replay_lsn() IS NOT NULL").fetchone()[0]


def test_failover_promotes_the_standby_with_every_acknowledged_commit(deployment: Deployment, procs: ProcessTracker,
                                                                    test_dir: Path) -> None:
    d = deployment
    standby = add_standby(d, test_dir)
    try:
        writer = Writer(d.pg.dsn())
        writer.start()
        wait_for(lambda: len(writer.acked) >= 200, timeout=60, what="acknowledged writes")
        wait_for(lambda: rows(standby.server.dsn(), writer.acked[:100]) == 100, timeout=60,
                 ignore=(psycopg.OperationalError,), what="the standby to replay from the safekeeper")
        # Cut the standby off the safekeepers while commits go on: it falls behind the committed end.
        feeds = {k: standby.server.managed_settings()[k] for k in ("primary_conninfo", "restore_command")}
        standby.server.set({"primary_conninfo": f"host=127.0.0.1 port={free_port()} connect_timeout=2",
                            "restore_command": ""})
        standby.server.reload()
        behind = len(writer.acked)
        wait_for(lambda: len(writer.acked) >= behind + 100, timeout=60, what="more acknowledged writes")
        d.kill("safekeeper3")  # it misses the last commits
        behind = len(writer.acked)
        wait_for(lambda: len(writer.acked) >= behind + 200, timeout=60, what="writes without safekeeper 3")
        os.kill(d.pg.postmaster_pid(), signal.SIGKILL)  # the primary's machine is gone
        wait_for(lambda: writer.error is not None, timeout=30, what="the writer's connection to die with the primary")
        acked = writer.stop()
        # Safekeeper 3 comes back behind and safekeeper 2 goes: the quorum (1 and 3) must recover 3 from 1.
        d.start("safekeeper3")
        d.kill("safekeeper2")

        # A standby that cannot reach E is not promoted; the reason names its WAL receiver. The fence and
        # the recovery are done: safekeeper 3 read the donor's WAL over its reader port in the new term.
        code, out = failover(d, standby, "--catchup-timeout", "3")
        assert code == 1, out
        assert f"recovering {d.addresses[2]} from the donor {d.addresses[0]}" in out
        assert "not promoting" in out and "below E" in out and "run failover again" in out
        assert "cannot be reached" in out, out  # the cause: the server its primary_conninfo names
        d.start("safekeeper2")
        with psycopg.connect(standby.server.dsn(), autocommit=True) as c:
            assert c.execute("SELECT pg_is_in_recovery()").fetchone()[0] is True
        terms = [d.term(i) for i in (1, 2, 3)]

        # Given its reader port back, the same command (run again) promotes it.
        standby.server.set(feeds)
        standby.server.reload()
        code, out = failover(d, standby)
        assert code == 0, out
        for step in ("1/5 fence", "2/5 recover", "3/5 catch up", "4/5 promote", "5/5 resume"):
            assert step in out
        assert sum(d.term(i) > t for i, t in zip((1, 2, 3), terms)) >= 2  # a new term: the old sidecar is fenced
        new = standby.server.dsn()
        assert rows(new, acked) == len(acked), "an acknowledged commit is missing on the new primary"
        with psycopg.connect(new, autocommit=True) as c:
            assert c.execute("SELECT pg_is_in_recovery()").fetchone()[0] is False

        # Resume: the sidecar on the new primary; its commits wait for the quorum again.
        procs.start(sidecar_argv("start", "--pg-dsn", new, "--safekeepers", ",".join(d.addresses),
                                 "--application-name", APP, *d.tls("proposer")), name="new-proposer")

        def synchronous() -> bool:
            with psycopg.connect(new, autocommit=True, connect_timeout=5) as c:
                row = c.execute("SELECT sync_state FROM pg_stat_replication WHERE application_name = %s",
                                (APP,)).fetchone()
            return row is not None and row[0] == "sync"
        wait_for(synchronous, timeout=60, what="the sidecar on the new primary to stream as its synchronous standby")
        with psycopg.connect(new, autocommit=True) as c:
            c.execute("INSERT INTO load VALUES (-2, 'after the failover')")
        wait_for(lambda: (d.sk_dir(1) / "wal" / "00000002.history").exists(), timeout=30,
                 what="the safekeepers to hold timeline 2's history")

        # Running it again is safe: the standby is the primary already; nothing is fenced.
        before = [d.term(i) for i in (1, 2, 3)]
        code, out = failover(d, standby)
        assert code == 0 and "already a primary" in out, out
        assert [d.term(i) for i in (1, 2, 3)] == before

        # The old primary comes back with a commit waiting on it: its sidecar gets nothing acknowledged and,
        # before it exits, terminates the waiting backend, whose client gets an error instead of hanging.
        # (Its sidecar starts after the commit waits, so that the commit cannot start after it left.)
        d.stop("proposer")
        d.pg.start()
        thread, result = start_commit(d.pg.dsn(), "INSERT INTO load VALUES (-3, 'on the old primary')")
        wait_for(lambda: syncrep_waiters(d) >= 1, timeout=30, what="the old primary's commit to wait")
        d.start("proposer")
        old_sidecar = d.members["proposer"].log_path
        wait_for(lambda: "refusing to stream" in old_sidecar.read_text(), timeout=60,
                 what="the old sidecar to be refused")
        thread.join(timeout=30)
        assert not thread.is_alive() and "done" not in result, result
        assert isinstance(result.get("error"), psycopg.OperationalError), result
        log = old_sidecar.read_text()
        assert "terminated 1 of 1 commits waiting in SyncRep on this fenced-out primary" in log, log[-3000:]
        assert "reason=lineage-ended" in log
        wait_for(lambda: syncrep_waiters(d) == 0, timeout=30, what="no commit left waiting on the old primary")
        # `check` on it says it is the old primary and how to rejoin.
        check = walsidecar("check", "--pg-dsn", d.pg.dsn(), "--safekeepers", ",".join(d.addresses),
                           *d.tls("client"))
        assert "primary lineage" in check.stdout and "pg_rewind" in check.stdout, check.stdout
        d.pg.stop("immediate")
        thread.join(timeout=30)
    finally:
        standby.close()


def test_a_fenced_old_primary_gets_nothing_acknowledged_until_failover_undo(deployment: Deployment,
                                                                           test_dir: Path) -> None:
    """The fence ends the old primary's timeline for good, even if failover stops before promoting and the old
    primary and its sidecar never went down: its sidecar exits, its commits wait; `failover --undo` gives the
    timeline back. (Before the fence was durable, the old sidecar won the next term and went on acknowledging.)"""
    d = deployment
    standby = add_standby(d, test_dir)
    try:
        writer = Writer(d.pg.dsn())
        writer.start()
        wait_for(lambda: len(writer.acked) >= 100, timeout=60, what="acknowledged writes")
        acked = writer.stop()
        # A standby cut off from the safekeepers: failover fences, then stops before promoting it. Restarted
        # rather than reloaded: a reload takes effect when the startup process gets to it, and a receiver
        # that reconnected before that (a reader port's stream may end) still got WAL from the old source.
        standby.server.stop()
        standby.server.set({"primary_conninfo": f"host=127.0.0.1 port={free_port()} connect_timeout=2",
                            "restore_command": ""})
        standby.server.start()
        # A commit acknowledged once it streams no more: E is beyond what it replayed, however fast it was.
        wait_for(lambda: not streaming(standby.server.dsn()), timeout=60, ignore=(psycopg.OperationalError,),
                 what="the standby to stop streaming")
        with psycopg.connect(d.pg.dsn(), autocommit=True) as c:
            c.execute("INSERT INTO load VALUES (-4, 'after the standby was cut off')")
        code, out = failover(d, standby, "--catchup-timeout", "2")
        assert code == 1 and "not promoting" in out, out
        assert "ends at E for good" in out, out
        old_sidecar = d.members["proposer"]
        wait_for(lambda: not old_sidecar.running, timeout=60, what="the old primary's sidecar to stop")
        log = old_sidecar.log_path.read_text()
        assert "a failover ended this primary's timeline: it must not take commits again" in log, log[-3000:]
        assert "Traceback" not in log
        # `check` on it names the failover that ended its timeline, and the undo.
        check = walsidecar("check", "--pg-dsn", d.pg.dsn(), "--safekeepers", ",".join(d.addresses), *d.tls("client"))
        assert "ended this server's timeline 1" in check.stdout and "failover --undo" in check.stdout, check.stdout
        # Its commits wait: nothing is acknowledged on a fenced timeline. A sidecar started on it again stops
        # again, and first terminates the waiting commit, whose client gets an error, never an acknowledgement.
        thread, result = start_commit(d.pg.dsn(), "INSERT INTO load VALUES (-5, 'while fenced')")
        wait_for(lambda: syncrep_waiters(d) >= 1, timeout=30, what="a commit on the fenced primary to wait")
        d.start("proposer")
        wait_for(lambda: not d.members["proposer"].running, timeout=60,
                 what="a restarted sidecar on the fenced primary to stop again")
        thread.join(timeout=60)
        assert "error" in result and "done" not in result, result
        assert "terminated 1 of 1 commits waiting in SyncRep" in d.members["proposer"].log_path.read_text()

        proc = undo(d)
        assert proc.returncode == 0 and "undone in term" in proc.stdout, proc.stdout
        d.start("proposer")
        with psycopg.connect(d.pg.dsn(), autocommit=True) as c:
            c.execute("INSERT INTO load VALUES (-6, 'after the undo')")  # acknowledged: the timeline is back
        assert rows(d.pg.dsn(), acked) == len(acked)
        # A second undo has nothing to lift, and says so.
        proc = undo(d)
        assert proc.returncode == 1 and "nothing to undo" in proc.stdout, proc.stdout
    finally:
        standby.close()

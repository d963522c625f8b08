"""--commit-wait against real PostgreSQL 15 and three real safekeepers, two of them killed: `wait` keeps a
commit waiting, `terminate-after` ends it with an error and says so, and neither acknowledges it."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import psycopg
import pytest

from support.deployment import APP, Deployment, syncrep_waiters
from support.helpers import wait_for
from support.procs import ProcessTracker
from sidecar.lsn import parse_lsn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


class Commit(threading.Thread):
    """One autocommit INSERT on its own connection; keeps its backend pid, the server's notices and the outcome."""

    def __init__(self, dsn: str, row_id: int) -> None:
        super().__init__(daemon=True)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.pid = self.conn.info.backend_pid
        self.notices: list[str] = []
        self.conn.add_notice_handler(lambda d: self.notices.append(d.message_primary or ""))
        self.row_id = row_id
        self.done = False
        self.error: psycopg.Error | None = None

    def run(self) -> None:
        try:
            self.conn.execute("INSERT INTO load VALUES (%s, 'waits for the quorum')", (self.row_id,))
            self.done = True
        except psycopg.Error as e:
            self.error = e
        finally:
            self.conn.close()


def waiting_in_syncrep(d: Deployment, pid: int) -> bool:
    with d.sql() as c:
        row = c.execute("SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == "SyncRep"


def deploy(pg_factory, procs: ProcessTracker, test_dir: Path, *proposer: str) -> Deployment:
    """The `deployment` fixture's deployment, its proposer started with `proposer` arguments from the first."""
    d = Deployment(pg_factory(settings={"synchronous_standby_names": APP}), procs, test_dir)
    d.extra["proposer"] = list(proposer)
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
    return d


def lose_the_quorum(d: Deployment) -> None:
    d.safekeepers[2].kill9()
    d.safekeepers[3].kill9()


def row_count(d: Deployment, row_id: int) -> int:
    with d.sql() as c:
        return c.execute("SELECT count(*) FROM load WHERE id = %s", (row_id,)).fetchone()[0]


def test_wait_keeps_the_commit_waiting_without_a_quorum(pg_factory, procs: ProcessTracker, test_dir: Path) -> None:
    # The default policy; the alert says when the sidecar has seen the commit wait without a quorum.
    d = deploy(pg_factory, procs, test_dir, "--quorum-wait-alert", "1")
    lose_the_quorum(d)
    commit = Commit(d.pg.dsn(), 1)
    commit.start()
    wait_for(lambda: waiting_in_syncrep(d, commit.pid), timeout=30, what="the commit to wait in SyncRep")
    log = d.members["proposer"].log_path
    wait_for(lambda: "commits are waiting for the safekeeper quorum" in log.read_text(), timeout=60,
             what="the sidecar to see the commit wait without a quorum")
    # Seen by the sidecar, past the alert: still waiting, never acknowledged, never ended.
    assert waiting_in_syncrep(d, commit.pid)
    assert commit.is_alive() and not commit.done and commit.error is None
    assert "terminated a backend" not in log.read_text()
    d.start_safekeeper(3)
    commit.join(timeout=60)
    assert commit.done, commit.error
    assert row_count(d, 1) == 1


def test_terminate_after_ends_the_wait_with_an_error_and_acknowledges_nothing(pg_factory, procs: ProcessTracker,
                                                                              test_dir: Path) -> None:
    d = deploy(pg_factory, procs, test_dir, "--commit-wait", "terminate-after=1s")
    lose_the_quorum(d)
    commit = Commit(d.pg.dsn(), 2)
    commit.start()
    commit.join(timeout=60)
    assert not commit.is_alive(), "the commit still waits"
    assert not commit.done, "a commit returned success with 1 of 3 safekeepers"
    assert isinstance(commit.error, psycopg.OperationalError), commit.error
    # Terminated, not cancelled: a cancel would have returned success with a WARNING.
    assert any("terminating connection due to administrator command" in n for n in commit.notices), commit.notices
    log = d.members["proposer"].log_path
    # The client may see the connection close before the sidecar, whose signal closed it, writes its line.
    line = wait_for(lambda: next((ln for ln in log.read_text().splitlines()
                                  if "terminated a backend waiting in SyncRep" in ln), None),
                    timeout=30, what="the sidecar to log the termination")
    assert re.search(rf"\bpid={commit.pid}\b", line) and "reason=no-quorum" in line and "commit_lsn_above=" in line
    assert re.search(r"\bxid=\d+", line), line
    # Nothing was reported durable: the sidecar's flush stays below the commit in the primary's WAL.
    with d.sql() as c:
        primary_flush = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
    assert d.flush_lsn() < primary_flush

    # The transaction was in the primary's WAL all along (its outcome was unknown to the client, not
    # undone); once a quorum holds it, it is acknowledged like any other, and commits work again.
    d.start_safekeeper(3)
    wait_for(lambda: d.flush_lsn() >= primary_flush, timeout=60, what="the quorum to acknowledge it")
    assert row_count(d, 2) == 1
    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (3, 'with a quorum')")
    assert syncrep_waiters(d) == 0

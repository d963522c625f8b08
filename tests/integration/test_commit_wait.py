"""--commit-wait against real PostgreSQL 15 and three real safekeepers, two of them killed: `wait` keeps a
commit waiting, `terminate-after` ends it with an error and says so, and neither acknowledges it;
`degrade-after` acknowledges it with the safekeeper that is up, inside a range recorded first in a real etcd and
on that safekeeper, which the failover's gate then protects after the primary is lost."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
from pathlib import Path

import psycopg
import pytest

from support.deployment import APP, Deployment, add_standby, syncrep_waiters
from support.etcd import EtcdServer
from support.helpers import wait_for, walsidecar
from support.procs import ProcessTracker
from sidecar.broker import Broker
from sidecar.consensus.messages import NO_DEGRADED, DegradedRange
from sidecar.lsn import parse_lsn
from sidecar.safekeeper.control import load_control

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


CLUSTER = "degrade-test"


def degraded_in_etcd(etcd: EtcdServer) -> DegradedRange:
    async def read() -> DegradedRange:
        broker = Broker([etcd.url])
        try:
            return await broker.read_degraded(CLUSTER)
        finally:
            broker.close()
    return asyncio.run(read())


def degraded_on(d: Deployment, i: int) -> DegradedRange:
    control = load_control(d.sk_dir(i))
    return control.state.degraded if control else NO_DEGRADED


def degraded_check(d: Deployment, etcd: EtcdServer) -> dict:
    """`walsidecar check`'s line about the degraded range."""
    out = walsidecar("check", "--pg-dsn", d.pg.dsn(), "--safekeepers", ",".join(d.addresses), "--broker", etcd.url,
                     "--cluster", CLUSTER, "--format", "json", *d.tls("client"))
    return next(c for c in json.loads(out.stdout)["checks"] if c["name"] == "degraded range")


def degrade(pg_factory, procs: ProcessTracker, test_dir: Path, etcd: EtcdServer) -> Deployment:
    return deploy(pg_factory, procs, test_dir, "--commit-wait", "degrade-after=2s", "--broker", etcd.url,
                  "--cluster", CLUSTER)


def test_degrade_after_acknowledges_with_the_safekeeper_that_is_up_once_the_range_is_recorded(
        pg_factory, procs: ProcessTracker, test_dir: Path, etcd: EtcdServer) -> None:
    d = degrade(pg_factory, procs, test_dir, etcd)
    log = d.members["proposer"].log_path
    assert "commit-wait degrade-after is on" in log.read_text()
    assert not degraded_in_etcd(etcd)
    lose_the_quorum(d)
    commit = Commit(d.pg.dsn(), 1)
    commit.start()
    commit.join(timeout=60)
    assert commit.done, commit.error or "the commit still waits"
    # When it returned, the range was in etcd and on safekeeper 1, its one member: nothing closes it without a quorum.
    record = degraded_in_etcd(etcd)
    assert record and record.members == {1}, record
    assert degraded_on(d, 1) == record
    assert "degraded: acknowledging commits without a quorum" in log.read_text()
    # The commit's WAL is on safekeeper 1 and acknowledged: the flush reported to the primary is past it.
    with d.sql() as c:
        primary_flush = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
    assert row_count(d, 1) == 1
    line = degraded_check(d, etcd)
    assert line["status"] == "FAILED" and f"term {record.term}" in line["detail"], line

    # The quorum is back: once it holds every degraded acknowledgement the range closes, everywhere.
    d.start_safekeeper(2)
    d.start_safekeeper(3)
    wait_for(lambda: not degraded_in_etcd(etcd), timeout=60, what="the range to close in etcd")
    assert d.flush_lsn() >= primary_flush
    wait_for(lambda: not degraded_on(d, 1), timeout=30, what="safekeeper 1's copy to be cleared")
    assert degraded_check(d, etcd)["status"] == "OK"
    assert "degraded range closed" in log.read_text()
    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (2, 'with a quorum')")
    assert syncrep_waiters(d) == 0


def test_after_a_degraded_window_and_a_leader_kill_failover_and_the_gate_refuse_until_a_member_votes(
        pg_factory, procs: ProcessTracker, test_dir: Path, etcd: EtcdServer) -> None:
    d = degrade(pg_factory, procs, test_dir, etcd)
    standby = add_standby(d, test_dir)
    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (0, 'before')")
    wait_for(lambda: row_count_at(standby.server.dsn(), 0) == 1, timeout=60, ignore=(psycopg.OperationalError,),
             what="the standby to replay from the safekeepers")
    lose_the_quorum(d)
    acked = []
    for row_id in range(1, 4):  # degraded acknowledgements: safekeeper 1 alone holds them
        commit = Commit(d.pg.dsn(), row_id)
        commit.start()
        commit.join(timeout=60)
        assert commit.done, commit.error or "the commit still waits"
        acked.append(row_id)
    record = degraded_in_etcd(etcd)
    assert record.members == {1}
    # The leader is lost (its host: PostgreSQL and its sidecar), then safekeeper 1; the other two come back.
    os.kill(d.pg.postmaster_pid(), signal.SIGKILL)
    d.kill("proposer")
    d.kill("safekeeper1")
    d.start_safekeeper(2)
    d.start_safekeeper(3)

    # Without etcd, the safekeepers it hears say a degrade-after sidecar wrote them: it refuses at once.
    proc = walsidecar("failover", "--standby-dsn", standby.server.dsn(), "--safekeepers", ",".join(d.addresses),
                      "--reader-passfile", str(d.reader_passfile), "--timeout", "10", *d.tls("proposer"), timeout=120)
    assert proc.returncode == 1, proc.stdout
    assert "by a sidecar with --commit-wait degrade-after" in proc.stdout and "--broker" in proc.stdout, proc.stdout
    assert "1/5 fence" not in proc.stdout, proc.stdout
    # Nor under another cluster name than the sidecar's: etcd has no mark of a degrade-after sidecar there.
    proc = walsidecar("failover", "--standby-dsn", standby.server.dsn(), "--safekeepers", ",".join(d.addresses),
                      "--reader-passfile", str(d.reader_passfile), "--broker", etcd.url, "--cluster", "another",
                      "--timeout", "10", *d.tls("proposer"), timeout=120)
    assert proc.returncode == 1 and "give --cluster the name the sidecar was started with" in proc.stdout, proc.stdout

    code, out = failover(d, standby, etcd, "--timeout", "10")
    assert code == 1, out
    assert "not promoting" in out and f"degraded range of term {record.term}" in out, out
    assert "members not heard: safekeepers 1" in out, out
    with psycopg.connect(standby.server.dsn(), autocommit=True) as c:
        assert c.execute("SELECT pg_is_in_recovery()").fetchone()[0] is True
    assert degraded_in_etcd(etcd) == record
    # failover-gate, Patroni's pre_promote, runs the same steps: it vetoes the promotion too.
    gate = walsidecar("failover-gate", "--standby-dsn", standby.server.dsn(), "--safekeepers", ",".join(d.addresses),
                      "--reader-passfile", str(d.reader_passfile), "--broker", etcd.url, "--cluster", CLUSTER,
                      "--timeout", "10", *d.tls("proposer"), timeout=120)
    said = gate.stdout + gate.stderr
    assert gate.returncode == 1 and "gate closed: not promoting this standby" in said, said
    assert f"degraded range of term {record.term}" in said, said
    with psycopg.connect(standby.server.dsn(), autocommit=True) as c:
        assert c.execute("SELECT pg_is_in_recovery()").fetchone()[0] is True
    assert degraded_in_etcd(etcd) == record

    # With its member back, the fence's votes cover the range: the standby is promoted with every commit.
    d.start_safekeeper(1)
    code, out = failover(d, standby, etcd)
    assert code == 0, out
    assert "is closed: E holds every commit acknowledged in it" in out, out
    assert row_count_at(standby.server.dsn(), acked) == len(acked), "a degraded acknowledgement is lost"
    assert not degraded_in_etcd(etcd)


def row_count_at(dsn: str, ids: int | list[int]) -> int:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as c:
        return c.execute("SELECT count(DISTINCT id) FROM load WHERE id = ANY(%s)",
                         ([ids] if isinstance(ids, int) else ids,)).fetchone()[0]


def failover(d: Deployment, standby, etcd: EtcdServer, *extra: str) -> tuple[int, str]:
    proc = walsidecar("failover", "--standby-dsn", standby.server.dsn(), "--safekeepers", ",".join(d.addresses),
                      "--reader-passfile", str(d.reader_passfile), "--broker", etcd.url, "--cluster", CLUSTER,
                      "--timeout", "30", *d.tls("proposer"), *extra, timeout=180)
    print(proc.stdout, proc.stderr)
    return proc.returncode, proc.stdout

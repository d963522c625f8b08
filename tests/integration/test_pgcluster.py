"""Tests of the PostgreSQL cluster manager, the process wrapper, the local deployment and the test infrastructure."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Callable

import psycopg
import pytest

from support.backends import PgServer
from support.helpers import free_port, wait_for
from support.procs import ManagedProcess, ProcessTracker
from sidecar.deployment import APP, LocalDeployment, MemberExited
from sidecar.pgcluster import ClusterError, LocalCluster, quote_setting
from sidecar.processes import Child


def _show(server: PgServer, name: str) -> str:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        row = conn.execute(f"SHOW {name}").fetchone()
    assert row is not None
    return str(row[0])


def test_server_accepts_connections(pg: PgServer) -> None:
    assert pg.is_running()
    with psycopg.connect(pg.dsn(application_name="probe"), autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        app, addr = conn.execute(
            "SELECT application_name, host(client_addr) FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        ).fetchone()  # type: ignore[misc]
    assert (app, addr) == ("probe", "127.0.0.1")
    assert _show(pg, "wal_level") == "replica"
    assert _show(pg, "synchronous_standby_names") == ""
    assert (pg.pg_wal_dir / "archive_status").is_dir()


def test_replication_connection_allowed(pg: PgServer) -> None:
    with psycopg.connect(pg.dsn(replication="true"), autocommit=True) as conn:
        cur = conn.execute("IDENTIFY_SYSTEM")
        row = cur.fetchone()
    assert row is not None and int(row[1]) == 1


def test_set_and_reload_visible_in_show(pg: PgServer) -> None:
    pg.set({"synchronous_standby_names": "walsidecar", "application_name": "it's quoted"})
    pg.reload()
    wait_for(lambda: _show(pg, "synchronous_standby_names") == "walsidecar", 10, what="reloaded setting")
    assert _show(pg, "application_name") == "it's quoted"
    pg.set({"synchronous_standby_names": None})
    pg.reload()
    wait_for(lambda: _show(pg, "synchronous_standby_names") == "", 10, what="setting removed")


def test_set_and_restart_for_postmaster_setting(pg: PgServer) -> None:
    pg.set({"max_wal_senders": "7"})
    pg.restart()
    assert _show(pg, "max_wal_senders") == "7"


def test_init_settings_applied(pg_factory: Callable[..., PgServer]) -> None:
    server = pg_factory("custom", settings={"wal_keep_size": "64MB", "log_line_prefix": "%m [%p] x "})
    assert _show(server, "wal_keep_size") == "64MB"
    assert _show(server, "log_line_prefix") == "%m [%p] x "


def test_crash_then_start_recovers(pg: PgServer) -> None:
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t SELECT generate_series(1, 1000)")
    pg.crash()
    assert not pg.is_running()
    pg.start()
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (1000,)
    assert "database system was interrupted" in pg.log_text()


def test_stop_is_idempotent(pg: PgServer) -> None:
    pg.stop()
    assert not pg.is_running()
    pg.stop()
    pg.crash()
    pg.start()
    assert pg.is_running()


def test_several_servers(pg_factory: Callable[..., PgServer]) -> None:
    a = pg_factory("node")
    b = pg_factory("node")
    assert a.port != b.port and a.data_dir != b.data_dir
    for s in (a, b):
        assert _show(s, "port") == str(s.port)


def test_run_bin_as_os_user(pg: PgServer) -> None:
    out = pg.run_bin("psql", "-AtXc", "SELECT current_user").stdout.strip()
    assert out == "postgres"
    pg.run_bin("pgbench", "-i", "-s", "1", "-q")
    res = pg.run_bin("pgbench", "-c", "2", "-t", "20", "-n")
    assert "number of transactions actually processed: 40/40" in res.stdout
    segs = sorted(p.name for p in pg.pg_wal_dir.iterdir() if len(p.name) == 24)
    dump = pg.run_bin("pg_waldump", "-p", str(pg.pg_wal_dir), segs[0], check=False)
    assert "rmgr:" in dump.stdout


def test_run_bin_failure_raises(pg: PgServer) -> None:
    with pytest.raises(ClusterError, match="psql exited"):
        pg.run_bin("psql", "-AtXc", "SELECT nonsense_column")


def test_start_failure_reports_log(test_dir: Path) -> None:
    cluster = LocalCluster(test_dir / "bad" / "data", free_port())
    cluster.init({"shared_buffers": "not-a-size"})
    with pytest.raises(ClusterError) as info:
        cluster.start(timeout=20)
    assert "shared_buffers" in str(info.value)
    assert not cluster.is_running()


def test_start_uninitialised_raises(test_dir: Path) -> None:
    with pytest.raises(ClusterError, match="not initialised"):
        LocalCluster(test_dir / "none", free_port()).start()


def test_init_refuses_existing(pg: PgServer) -> None:
    cluster = LocalCluster(pg.data_dir, pg.port)
    with pytest.raises(ClusterError, match="already initialised"):
        cluster.init()


def test_dsn_quoting() -> None:
    c = LocalCluster(Path("/tmp/unused"), 5999)
    assert c.dsn() == "host=127.0.0.1 port=5999 user=postgres dbname=postgres"
    assert c.dsn(application_name="a b").endswith("application_name='a b'")
    assert quote_setting("it's") == "'it''s'"


def test_managed_process_kill9(procs: ProcessTracker) -> None:
    p = procs.start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"], name="sleeper")
    wait_for(lambda: "up" in p.log_text(), 10, what="child output")
    assert p.is_running() and p.returncode is None
    assert p.kill9() == -signal.SIGKILL
    assert not p.is_running()


def test_managed_process_terminate_escalates(procs: ProcessTracker) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
    p = procs.start([sys.executable, "-c", code], name="stubborn")
    wait_for(lambda: "ready" in p.log_text(), 10, what="handler installed")
    assert p.terminate(timeout=0.5) == -signal.SIGKILL


def test_managed_process_exit_code_and_log(test_dir: Path) -> None:
    p = ManagedProcess([sys.executable, "-c", "import sys; print('hello'); sys.exit(3)"], test_dir / "p.log")
    assert p.wait(10) == 3
    assert p.returncode == 3
    assert "hello" in p.log_text()


def test_tracker_kills_at_teardown(test_dir: Path) -> None:
    tracker = ProcessTracker(test_dir)
    p = tracker.start([sys.executable, "-c", "import time; time.sleep(600)"])
    tracker.kill_all()
    assert p.returncode == -signal.SIGKILL


def test_wait_for_times_out_with_message() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match="timed out waiting for the moon"):
        wait_for(lambda: False, timeout=0.2, interval=0.01, what="the moon")
    assert time.monotonic() - start < 5


def test_wait_for_returns_value_and_ignores() -> None:
    calls = iter([ConnectionError("no"), 0, "ok"])

    def probe() -> object:
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v

    assert wait_for(probe, 5, 0.001, "probe", ignore=(ConnectionError,)) == "ok"
    with pytest.raises(ConnectionError):
        wait_for(lambda: (_ for _ in ()).throw(ConnectionError("x")), 1, 0.01, "raise")


def test_child_restarts_with_the_same_command_and_log(test_dir: Path) -> None:
    child = Child("echo", [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(600)"],
                  test_dir / "echo.log")
    try:
        first = child.start().pid
        wait_for(lambda: str(first) in child.log_text(), 10, what="the first output")
        assert child.restart(timeout=5).pid != first and child.running
        wait_for(lambda: len(child.log_text().split()) == 2, 10, what="the second output")
        assert child.log_text().split() == [str(first), str(child.pid)]
    finally:
        child.kill()
    assert not child.running and child.returncode == -signal.SIGKILL


def test_local_deployment_knows_its_members_by_name(procs: ProcessTracker, test_dir: Path) -> None:
    with LocalDeployment(test_dir / "d", safekeepers=3, spawn=procs.spawn) as d:  # stop_all() at the end
        d.pg.init({"synchronous_standby_names": APP})
        d.start_all()
        assert list(d.members) == ["primary", "safekeeper1", "safekeeper2", "safekeeper3", "proposer"]
        assert (test_dir / "d" / "certs" / "safekeeper2" / "node.key").exists(), "a CA and certificates of its own"
        assert d.data_dir("safekeeper1") == test_dir / "d" / "safekeeper1"
        d.kill("safekeeper2")
        assert not d["safekeeper2"].running
        d.check_running()  # killed on purpose: not a failure
        d.start("safekeeper2")
        first = d.proposer
        d.restart("proposer")
        assert first is not None and not first.running and d.proposer is not first
        d.wait_streaming()
        d.proposer.kill()  # behind the deployment's back
        with pytest.raises(MemberExited, match="proposer exited"):
            d.check_running()
    assert not d.pg.is_running()
    assert not any(p.running for p in procs.started), "stop_all stops every process it started"

"""The --pg-backend container PgServer: what integration tests rely on, checked on the real image."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import psycopg
import pytest

from support.backends import ContainerBackend, ContainerPgServer
from support.deployment import APP, Deployment, wal_matches_primary
from support.helpers import wait_for
from support.procs import ProcessTracker
from sidecar.lsn import parse_lsn

pytestmark = [pytest.mark.containers, pytest.mark.integration]


@pytest.fixture
def make_server(container_engine: None, test_dir: Path) -> Iterator:
    backend = ContainerBackend(test_dir / "pg")
    made: list[ContainerPgServer] = []

    def make(name: str = "pg", settings: dict[str, str] | None = None) -> ContainerPgServer:
        server = backend.create(name, settings)
        made.append(server)
        return server

    try:
        yield make
    finally:
        for server in made:
            print(f"--- {server!r} log ---\n" + "\n".join(server.log_text().splitlines()[-60:]))
            server.teardown()


def show(server: ContainerPgServer, name: str) -> str:
    with psycopg.connect(server.dsn(), autocommit=True) as c:
        return c.execute(f"SHOW {name}").fetchone()[0]


def test_settings_restart_crash_and_binaries(make_server) -> None:
    pg = make_server(settings={"wal_keep_size": "64MB"})
    pg.start()
    assert show(pg, "wal_keep_size") == "64MB" and show(pg, "listen_addresses") == "127.0.0.1"
    pg.set({"synchronous_standby_names": APP})
    pg.reload()
    wait_for(lambda: show(pg, "synchronous_standby_names") == APP, timeout=10, what="the reload")
    pg.set({"max_wal_senders": "7", "synchronous_standby_names": None})   # no sidecar here: commits must not wait
    pg.restart()
    assert show(pg, "max_wal_senders") == "7"
    with psycopg.connect(pg.dsn(), autocommit=True) as c:
        c.execute("CREATE TABLE t AS SELECT g FROM generate_series(1, 1000) g")
    pg.crash()
    assert not pg.is_running()
    pg.start()
    assert "database system was interrupted" in pg.log_text()
    assert pg.run_bin("psql", "-AtXc", "SELECT count(*) FROM t").stdout.strip() == "1000"
    assert pg.run_bin("psql", "-AtXc", "SELECT current_user").stdout.strip() == "postgres"
    segments = sorted(p.name for p in pg.pg_wal_dir.iterdir() if len(p.name) == 24)
    assert segments, "the data directory is visible from the host"
    dump = pg.run_bin("pg_waldump", "-p", str(pg.pg_wal_dir), segments[0], check=False)
    assert "rmgr:" in dump.stdout
    pg.stop()
    control = pg.run_bin("pg_controldata", "-D", str(pg.data_dir)).stdout   # no server: a throwaway container
    assert "shut down" in control


def test_local_safekeepers_against_a_container_primary(make_server, procs: ProcessTracker, test_dir: Path) -> None:
    pg = make_server(settings={"synchronous_standby_names": APP})
    pg.start()
    d = Deployment(pg, procs, test_dir)
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load AS SELECT g, repeat('y', 300) AS pad FROM generate_series(1, 20000) g")
        lsn = parse_lsn(c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
    assert d.flush_lsn() >= lsn
    end, start = d.flush_lsn(), d.history_start(1)
    for i in (1, 2, 3):   # the safekeepers' segment files equal the primary's pg_wal, read from the host
        wait_for(lambda i=i: wal_matches_primary(d, i, start, end), timeout=60,
                 what=f"safekeeper {i} to hold the primary's WAL up to {end:X}")

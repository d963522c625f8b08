"""End to end on the images: the primary, three safekeepers and the sidecar all run as containers."""

from __future__ import annotations

import json

import pytest

from containers.harness import APP, PASSWORD, ContainerDeployment, walsidecar_in_image
from support.deployment import Writer, start_commit, syncrep_waiters
from support.helpers import wait_for
from sidecar.lsn import parse_lsn

pytestmark = [pytest.mark.containers, pytest.mark.integration]


def insert_lsn(d: ContainerDeployment, row_id: int) -> int:
    """Commit one row; return the end of WAL right after its commit returned."""
    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (%s, 'x')", (row_id,))
        return parse_lsn(c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])


def test_quorum_commit(container_deployment: ContainerDeployment) -> None:
    d = container_deployment
    lsn = insert_lsn(d, 1)
    name, state, sync_state, flush, _ = d.replication_row()
    assert (name, state, sync_state) == (APP, "streaming", "sync")
    assert parse_lsn(flush) >= lsn
    # One safekeeper down: 2 of 3 are still a quorum, commits go on.
    d.stop("safekeeper3")
    lsn = insert_lsn(d, 2)
    assert parse_lsn(d.replication_row()[3]) >= lsn
    with d.sql() as c:
        assert c.execute("SELECT count(*) FROM load").fetchone()[0] == 2


def test_commit_waits_for_quorum_and_completes_when_a_safekeeper_returns(
        container_deployment: ContainerDeployment) -> None:
    d = container_deployment
    d.stop("safekeeper2")
    d.stop("safekeeper3")
    thread, result = start_commit(d.pg.dsn(), "INSERT INTO load VALUES (2, 'waits')")
    wait_for(lambda: syncrep_waiters(d) >= 1, timeout=30, what="the commit to wait in SyncRep")
    assert thread.is_alive() and not result, "a commit returned with 1 of 3 safekeepers"
    with d.sql() as c:   # committed locally, not acknowledged: the flush position is behind it
        end = parse_lsn(c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
    assert parse_lsn(d.replication_row()[3]) < end
    d.start("safekeeper3")
    thread.join(timeout=60)
    assert result.get("done"), result
    with d.sql() as c:
        assert c.execute("SELECT count(*) FROM load WHERE id = 2").fetchone()[0] == 1


def test_restarted_safekeeper_container_rejoins(container_deployment: ContainerDeployment) -> None:
    d = container_deployment
    writer = Writer(d.pg.dsn())
    writer.start()
    try:
        wait_for(lambda: len(writer.acked) >= 50, timeout=60, what="writes before the restart")
        sk2 = d["safekeeper2"].container.container
        sk2.reload()
        started = sk2.attrs["State"]["StartedAt"]
        sk2.restart(timeout=10)   # docker restart: SIGTERM, then the same container starts again
        d["safekeeper2"].wait_ready()  # type: ignore[attr-defined]
        assert sk2.attrs["State"]["StartedAt"] != started
        seen = len(writer.acked)
        wait_for(lambda: len(writer.acked) >= seen + 100, timeout=60, what="writes after the restart")
        # Without safekeeper 3 the quorum is 1 + 2: commits go on only if 2 has rejoined and caught up.
        d.stop("safekeeper3")
        seen = len(writer.acked)
        wait_for(lambda: len(writer.acked) >= seen + 100, timeout=60,
                 what="writes acknowledged by safekeepers 1 and 2")
    finally:
        acked = writer.stop()
    assert writer.error is None, writer.error
    with d.sql() as c:
        assert c.execute("SELECT count(*) FROM load").fetchone()[0] == len(acked)


def test_pg_stat_replication_shows_the_sidecar(container_deployment: ContainerDeployment) -> None:
    d = container_deployment
    name, state, sync_state, _, _ = d.replication_row()
    with d.sql() as c:
        client_addr = c.execute("SELECT host(client_addr) FROM pg_stat_replication WHERE application_name = %s",
                                (APP,)).fetchone()[0]
    assert (name, state, sync_state, client_addr) == (APP, "streaming", "sync", "127.0.0.1")
    with d.sql() as c:
        assert c.execute("SHOW synchronous_standby_names").fetchone()[0] == APP
        slot = c.execute("SELECT slot_type, active FROM pg_replication_slots WHERE slot_name = %s",
                         (APP,)).fetchone()
    assert slot == ("physical", True)


def test_the_image_runs_init_postgres_check_and_status(container_deployment: ContainerDeployment) -> None:
    d = container_deployment
    sks = ",".join(d.addresses)
    init = walsidecar_in_image("init-postgres", "--pg-dsn", d.pg.dsn())   # psql and sql/ inside the image
    assert init.returncode == 0, init.stdout + init.stderr
    check = walsidecar_in_image("check", "--pg-dsn", d.pg.dsn(), "--safekeepers", sks, "--format", "json")
    assert check.returncode == 0, check.stdout + check.stderr
    assert json.loads(check.stdout)["ok"] is True
    status = walsidecar_in_image("status", "--pg-dsn", d.pg.dsn(), "--safekeepers", sks, "--format", "json")
    assert status.returncode == 0, status.stdout + status.stderr
    assert PASSWORD not in status.stdout
    assert all(a in status.stdout for a in d.addresses)

"""The safekeepers' reader port against real PostgreSQL 15 clients: pg_receivewal, a standby, libpq, psycopg."""

from __future__ import annotations

import psycopg
import pytest

from support.deployment import Deployment, commit_lsn_of

pytestmark = pytest.mark.integration


def replication(d: Deployment, i: int, **params: str) -> psycopg.Connection:
    return psycopg.connect(d.reader_dsn(i, **params), replication="true", autocommit=True)


def test_identify_system(deployment: Deployment) -> None:
    d = deployment
    with d.sql() as c:
        commit_lsn_of(c, "INSERT INTO load VALUES (1, 'a')")
        sysid = c.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]
    with replication(d, 1) as r:
        row = r.execute("IDENTIFY_SYSTEM").fetchone()
        assert int(row[0]) == sysid
        assert row[1] == 1
        assert r.execute("SHOW wal_segment_size").fetchone()[0] == "16MB"

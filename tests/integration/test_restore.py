"""Reading WAL back from the safekeepers' reader ports: walclient, restore-wal and a restored primary (PG 15)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.deployment import Deployment, commit_lsn_of, read_wal
from support.helpers import wait_for
from sidecar.config import RestoreWalSettings
from sidecar.lsn import DEFAULT_SEGMENT_SIZE
from sidecar.walclient import ReaderError, WalReader, copy_wal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def reader_settings(d: Deployment, **extra: object) -> RestoreWalSettings:
    certs = d.certs_dir("reader", "client")
    tls = {"certs_dir": certs} if certs is not None else {"insecure": True}
    return RestoreWalSettings(safekeeper_readers=tuple(str(a) for a in d.reader_addresses),
                              reader_passfile=d.reader_passfile, **tls, **extra)


def commit_position(d: Deployment, i: int) -> int:
    s = reader_settings(d)
    with WalReader(d.reader_addresses[i - 1], s) as r:
        return r.identify()[2]


def test_walclient_reads_committed_wal_as_the_primary_wrote_it(deployment: Deployment) -> None:
    d = deployment
    with d.sql() as c:
        c.execute("INSERT INTO load SELECT g, repeat('w', 200) FROM generate_series(1, 5000) g")
        end = commit_lsn_of(c, "INSERT INTO load VALUES (-1, 'last')")
    commit = wait_for(lambda: (p := commit_position(d, 1)) >= end and p, timeout=60,
                      what="safekeeper 1's commit position to pass the last commit")
    s = reader_settings(d)
    with WalReader(d.reader_addresses[0], s) as r:
        system_id, tli, xlogpos = r.identify()
        assert tli == 1 and xlogpos == commit
        assert r.wal_segment_size() == DEFAULT_SEGMENT_SIZE
        start = commit - commit % DEFAULT_SEGMENT_SIZE
        got = copy_wal(r, start, commit)
        assert got == read_wal(d.pg.pg_wal_dir, start, commit)
        # The connection is back in command mode after a stream that ended at stop_at.
        assert r.identify()[0] == system_id
        # Nothing past the commit position is served.
        with pytest.raises(ReaderError) as e:
            copy_wal(r, commit + DEFAULT_SEGMENT_SIZE, commit + 2 * DEFAULT_SEGMENT_SIZE)
        assert e.value.sqlstate == "22023", e.value
        with pytest.raises(ReaderError) as e:
            r.timeline_history(2)
        assert e.value.sqlstate == "58P01"

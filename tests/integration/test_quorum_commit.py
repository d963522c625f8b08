"""End to end: a real primary, three safekeeper processes and the proposer on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from support.backends import PgServer
from support.deployment import (APP, Deployment, Writer, commit_lsn_of, start_commit, syncrep_waiters,
                                wait_holds_primary_wal, wait_replayed, wal_matches_primary)
from support.helpers import wait_for
from support.procs import ProcessTracker
from sidecar.pgcluster import find_bin_dir
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, parse_lsn, segment_file_name
from sidecar.tls import client_context

pytestmark = pytest.mark.integration


def test_commit_is_acknowledged_by_quorum(deployment: Deployment) -> None:
    d = deployment
    with d.sql() as c:
        lsn = commit_lsn_of(c, "INSERT INTO load VALUES (1, 'a')")
    name, state, sync_state, flush, replay = d.replication_row()
    assert (name, state, sync_state) == (APP, "streaming", "sync")
    assert parse_lsn(flush) >= lsn
    # replay is what every safekeeper of the term has flushed: the third may still be joining.
    wait_replayed(d, lsn, "the sidecar to report the commit as held by all three safekeepers")


def test_commit_waits_without_quorum_and_completes_when_one_returns(deployment: Deployment) -> None:
    d = deployment
    d.safekeepers[2].kill9()
    d.safekeepers[3].kill9()
    thread, result = start_commit(d.pg.dsn(), "INSERT INTO load VALUES (2, 'waits')")
    wait_for(lambda: syncrep_waiters(d) >= 1, timeout=30, what="the commit to wait in SyncRep")
    thread.join(timeout=3)  # bounded: the commit must still be waiting after it
    assert thread.is_alive() and not result, "a commit returned with only 1 of 3 safekeepers"
    d.start_safekeeper(3)
    thread.join(timeout=60)
    assert result.get("done"), result
    with d.sql() as c:
        assert c.execute("SELECT count(*) FROM load WHERE id = 2").fetchone()[0] == 1


def test_safekeeper_wal_equals_primary_wal(deployment: Deployment) -> None:
    d = deployment
    with d.sql() as c:
        c.execute("INSERT INTO load SELECT g, repeat('y', 500) FROM generate_series(1, 40000) g")
        c.execute("SELECT pg_switch_wal()")
        commit_lsn_of(c, "INSERT INTO load VALUES (0, 'after switch')")
    end = d.flush_lsn()
    start = d.history_start(1)
    assert start % DEFAULT_SEGMENT_SIZE == 0
    for i in (1, 2, 3):
        wait_for(lambda: wal_matches_primary(d, i, start, end), timeout=60,
                 what=f"safekeeper {i} to hold the primary's WAL up to {end:X}")
    first_seg = start // DEFAULT_SEGMENT_SIZE
    wal_dir = d.sk_dir(1) / "wal"
    completed = wal_dir / segment_file_name(1, first_seg)
    assert completed.exists(), sorted(os.listdir(wal_dir))
    # Run as ourselves: the segment files belong to the safekeeper's user, not postgres.
    out = subprocess.run([str(find_bin_dir() / "pg_waldump"), "--path", str(wal_dir), completed.name],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "rmgr:" in out.stdout


def test_killed_safekeeper_rejoins_and_catches_up(deployment: Deployment) -> None:
    d = deployment
    writer = Writer(d.pg.dsn())
    writer.start()
    wait_for(lambda: len(writer.acked) >= 50, timeout=60, what="writes before the kill")
    d.safekeepers[2].kill9()
    seen = len(writer.acked)
    wait_for(lambda: len(writer.acked) >= seen + 200, timeout=60, what="writes with one safekeeper down")
    d.start_safekeeper(2)
    wait_for(lambda: len(writer.acked) >= seen + 400, timeout=60, what="writes after the restart")
    acked = writer.stop()
    assert writer.error is None
    wait_holds_primary_wal(d, 2, "the restarted safekeeper to match the primary again")
    with d.sql() as c:
        assert c.execute("SELECT count(*) FROM load").fetchone()[0] == len(acked)


def test_killed_proposer_restarts_in_a_new_term(deployment: Deployment) -> None:
    d = deployment
    writer = Writer(d.pg.dsn())
    writer.start()
    wait_for(lambda: len(writer.acked) >= 50, timeout=60, what="writes before the kill")
    term_before = max(d.term(i) for i in (1, 2, 3))
    d.proposer.kill9()
    acked_at_kill = len(writer.acked)
    d.start_proposer()
    d.wait_sync()
    wait_for(lambda: len(writer.acked) >= acked_at_kill + 100, timeout=60, what="writes in the new term")
    acked = writer.stop()
    assert writer.error is None
    assert min(d.term(i) for i in (1, 2, 3)) > term_before
    end = d.flush_lsn()
    start = d.history_start(1)
    for i in (1, 2, 3):
        wait_for(lambda: wal_matches_primary(d, i, start, end), timeout=60,
                 what=f"safekeeper {i} to match the primary after the new term")
    with d.sql() as c:
        ids = {r[0] for r in c.execute("SELECT id FROM load")}
    assert set(acked) <= ids


def test_garbage_frames_do_not_disturb_the_safekeeper(deployment: Deployment) -> None:
    d = deployment
    rng = random.Random(7)
    host, port = d.addresses[0].split(":")
    payloads = [
        rng.randbytes(64),
        struct.pack(">I", 0xFFFFFFFF) + b"v",  # declared length far too large
        struct.pack(">I", 40) + b"g" + b"\0" * 5,  # truncated greeting, then EOF
        struct.pack(">I", 9) + b"a" + b"\0" * 8,  # an Append before any greeting
        b"GET / HTTP/1.0\r\n\r\n",
    ]
    # Without a certificate garbage ends in the TLS handshake; with the proposer's it reaches the frame parser.
    tls = client_context(d.pki.certs("proposer"))
    for payload in payloads:
        for authenticated in (False, True):
            with socket.create_connection((host, int(port)), timeout=10) as raw:
                s = tls.wrap_socket(raw, server_hostname=host) if authenticated else raw
                s.sendall(payload)
                # The safekeeper's connection thread may have closed it already (a reset): the end waited for.
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_WR)
                s.settimeout(10)
                with contextlib.suppress(ConnectionResetError):
                    while s.recv(4096):  # the safekeeper must close the connection
                        pass
    assert d.safekeepers[1].is_running()
    d.safekeepers[2].kill9()  # commits now need safekeeper 1
    with d.sql() as c:
        lsn = commit_lsn_of(c, "INSERT INTO load VALUES (3, 'still served')")
    assert d.flush_lsn() >= lsn
    assert "malformed message" in d.safekeepers[1].log_text()


def test_safekeeper_behind_the_buffer_catches_up_from_the_primary(pg_factory, procs: ProcessTracker,
                                                                    test_dir: Path) -> None:
    pg: PgServer = pg_factory(settings={"synchronous_standby_names": APP})
    d = Deployment(pg, procs, test_dir)
    for i in (1, 2, 3):
        d.start_safekeeper(i)
    d.start_proposer("--wal-buffer", "1")
    d.wait_sync()
    d.safekeepers[3].kill9()
    with d.sql() as c:
        c.execute("CREATE TABLE big AS SELECT g, repeat('z', 300) AS pad FROM generate_series(1, 60000) g")
    end = d.flush_lsn()
    start = d.history_start(1)
    assert end - start > 8 * 1024 * 1024, "the test needs far more WAL than the 1 MiB buffer"
    d.start_safekeeper(3)
    wait_for(lambda: wal_matches_primary(d, 3, start, end), timeout=120,
             what="safekeeper 3 to catch up from the primary's pg_wal")
    assert "catching up safekeeper" in d.proposer.log_text()


def advisory_lock_holders(d: Deployment) -> int:
    with d.sql() as c:
        return c.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted").fetchone()[0]


def test_sidecar_reattaches_after_the_primary_restarts(deployment: Deployment) -> None:
    d = deployment
    assert advisory_lock_holders(d) == 1
    d.pg.stop()
    d.pg.start()
    d.wait_sync()
    wait_for(lambda: advisory_lock_holders(d) == 1, timeout=30, what="the sidecar to take its lock again")
    with d.sql() as c:
        lsn = commit_lsn_of(c, "INSERT INTO load VALUES (4, 'after restart')")
    assert d.flush_lsn() >= lsn
    assert d.proposer.is_running()


def test_sidecar_waits_for_a_primary_that_is_down(pg_factory, procs: ProcessTracker, test_dir: Path) -> None:
    pg: PgServer = pg_factory(settings={"synchronous_standby_names": APP})
    d = Deployment(pg, procs, test_dir)
    pg.stop()
    for i in (1, 2, 3):
        d.start_safekeeper(i)
    d.start_proposer()
    wait_for(lambda: "primary unreachable" in d.proposer.log_text(), timeout=30,
             what="the sidecar to report the primary unreachable")
    assert d.proposer.is_running()
    pg.start()
    d.wait_sync()

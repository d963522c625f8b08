"""A primary, three safekeeper processes and the proposer, as the integration tests run them."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from support.backends import PgServer
from support.helpers import free_port, wait_for
from support.pki import TestPKI, session_pki
from support.procs import ManagedProcess, ProcessTracker
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, parse_lsn, segment_file_name
from sidecar.safekeeper.control import load_control

APP = "walsidecar"


@dataclass
class Deployment:
    pg: PgServer
    procs: ProcessTracker
    base: Path
    n: int = 3
    ports: list[int] = field(default_factory=list)
    safekeepers: dict[int, ManagedProcess] = field(default_factory=dict)
    proposer: ManagedProcess | None = None
    pki: TestPKI = field(default_factory=session_pki)
    insecure: bool = False  # True: every process runs with --insecure instead of certificates
    link_security: str = "tls"  # or "auth-only": the certificates authenticate, nothing is encrypted

    def __post_init__(self) -> None:
        self.ports = [free_port() for _ in range(self.n)]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def sk_dir(self, i: int) -> Path:
        return self.base / f"sk{i}"

    def tls(self, role: str, node_id: int | None = None) -> list[str]:
        """`--certs-dir DIR` of a process with this role (`--insecure` for an insecure deployment)."""
        if self.insecure:
            return ["--insecure"]
        return self.pki.args(role, node_id) + ([] if self.link_security == "tls" else
                                               ["--link-security", self.link_security])

    def start_safekeeper(self, i: int, *extra: str) -> ManagedProcess:
        proc = self.procs.start(
            [sys.executable, "-m", "sidecar", "safekeeper", "--id", str(i), "--listen", self.addresses[i - 1],
             "--data-dir", str(self.sk_dir(i)), *self.tls("safekeeper", i), *extra], name=f"safekeeper{i}")
        self.safekeepers[i] = proc
        return proc

    def start_proposer(self, *extra: str) -> ManagedProcess:
        self.proposer = self.procs.start(
            [sys.executable, "-m", "sidecar", "start", "--pg-dsn", self.pg.dsn(), "--safekeepers",
             ",".join(self.addresses), *self.tls("proposer"), *extra], name="proposer")
        return self.proposer

    def start_all(self) -> None:
        for i in range(1, self.n + 1):
            self.start_safekeeper(i)
        self.start_proposer()
        self.wait_sync()

    def sql(self) -> psycopg.Connection:
        return psycopg.connect(self.pg.dsn(), autocommit=True)

    def replication_row(self) -> tuple | None:
        with self.sql() as c:
            return c.execute(
                "SELECT application_name, state, sync_state, flush_lsn::text, replay_lsn::text "
                "FROM pg_stat_replication WHERE application_name = %s", (APP,)).fetchone()

    def wait_sync(self, timeout: float = 60) -> None:
        wait_for(lambda: (r := self.replication_row()) is not None and r[2] == "sync",
                 timeout=timeout, what="the sidecar to be the synchronous standby")

    def flush_lsn(self) -> int:
        row = self.replication_row()
        assert row is not None and row[3] is not None
        return parse_lsn(row[3])

    def term(self, i: int) -> int:
        data = load_control(self.sk_dir(i))
        return data.state.term if data else 0

    def history_start(self, i: int) -> int:
        data = load_control(self.sk_dir(i))
        assert data is not None and data.state.term_history
        return data.state.term_history[0].start_lsn


def read_wal(directory: Path, start: int, end: int, seg_size: int = DEFAULT_SEGMENT_SIZE) -> bytes:
    """Bytes [start, end) from PostgreSQL-named segment files (final or .partial) in `directory`."""
    out = bytearray()
    pos = start
    while pos < end:
        segno, offset = divmod(pos, seg_size)
        name = segment_file_name(1, segno, seg_size)
        path = directory / name
        if not path.exists():
            path = directory / (name + ".partial")
        if not path.exists():
            break
        with path.open("rb") as f:
            f.seek(offset)
            chunk = f.read(min(end - pos, seg_size - offset))
        if not chunk:
            break
        out += chunk
        pos += len(chunk)
    return bytes(out)


def wal_matches_primary(d: Deployment, i: int, start: int, end: int) -> bool:
    ours = read_wal(d.sk_dir(i) / "wal", start, end)
    return len(ours) == end - start and ours == read_wal(d.pg.pg_wal_dir, start, end)


class Writer(threading.Thread):
    """Inserts rows one commit at a time, recording the ids whose COMMIT returned."""

    def __init__(self, dsn: str, table: str = "load") -> None:
        super().__init__(daemon=True)
        self.dsn, self.table = dsn, table
        self.acked: list[int] = []
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                i = 0
                while not self.stop_event.is_set():
                    i += 1
                    c.execute(f"INSERT INTO {self.table} VALUES (%s, repeat('x', 200))", (i,))
                    self.acked.append(i)
        except psycopg.Error as e:  # the test decides whether a failure matters
            self.error = e

    def stop(self) -> list[int]:
        self.stop_event.set()
        self.join(timeout=120)
        assert not self.is_alive(), "the writer is stuck in a commit"
        return self.acked


def commit_lsn_of(conn: psycopg.Connection, sql: str) -> int:
    """Run `sql` (autocommit) and return the end of WAL right after its commit returned."""
    conn.execute(sql)
    return parse_lsn(conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])


def start_commit(dsn: str, sql: str) -> tuple[threading.Thread, dict]:
    """Run one autocommit statement in a thread; the dict gets 'done' (or 'error')."""
    result: dict = {}

    def run() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute(sql)
            result["done"] = True
        except psycopg.Error as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result

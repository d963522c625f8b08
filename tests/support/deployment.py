"""sidecar.deployment.LocalDeployment as the integration tests use it, and what tests do with one."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg

from support.backends import PgServer
from support.helpers import wait_for
from support.pki import TestPKI, session_pki
from support.procs import ManagedProcess, ProcessTracker
from sidecar.deployment import APP, LocalDeployment, Standby, free_port
from sidecar.pgcluster import LocalCluster
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, parse_lsn, segment_file_name
from sidecar.config import RestoreWalSettings
from sidecar.safekeeper.control import load_control

__all__ = ["APP", "Deployment", "Writer", "add_standby", "backup_lsn", "commit_lsn_of", "read_wal", "reader_settings",
           "start_commit", "syncrep_waiters", "wal_matches_primary"]


class SessionCertificates:
    """The session PKI's certificates directory for a process's role and id (tests/support/pki.py)."""

    def __init__(self, pki: TestPKI) -> None:
        self.pki = pki

    def certs(self, name: str, role: str, node_id: int | None, hosts: tuple[str, ...]) -> Path:
        return self.pki.certs(role, node_id)


class Deployment(LocalDeployment):
    """A LocalDeployment on the test's server, its processes started through `procs` (a log per start,
    SIGKILLed by PID at teardown, logs printed for a failed test), certificates from the session PKI."""

    def __init__(self, pg: PgServer, procs: ProcessTracker, base: Path, n: int = 3, *, insecure: bool = False,
                 link_security: str = "tls", pki: TestPKI | None = None, peers: bool = True) -> None:
        self.procs = procs
        self.pki = pki or session_pki()
        super().__init__(base, safekeepers=n, primary=pg, insecure=insecure, link_security=link_security,
                         certificates=SessionCertificates(self.pki), spawn=procs.spawn, peers=peers)

    @property
    def ports(self) -> list[int]:
        return [int(a.rpartition(":")[2]) for a in self.addresses]

    def sk_dir(self, i: int) -> Path:
        return self.data_dir(f"safekeeper{i}")

    def tls(self, role: str, node_id: int | None = None) -> list[str]:
        """`--certs-dir DIR` of a process with this role (`--insecure` for an insecure deployment)."""
        return self.link_args(role, role, node_id)

    def start_safekeeper(self, i: int, *extra: str) -> ManagedProcess:
        return self.start(f"safekeeper{i}", *extra)

    def start_proposer(self, *extra: str) -> ManagedProcess:
        return self.start("proposer", *extra)

    def wait_sync(self, timeout: float = 60) -> None:
        self.wait_streaming(timeout, check=False)

    def flush_lsn(self) -> int:
        row = self.replication_row()
        assert row is not None and row[3] is not None
        return parse_lsn(row[3])

    def term(self, i: int) -> int:
        data = load_control(self.sk_dir(i))
        return data.state.term if data else 0

    def reader_dsn(self, i: int, **params: str) -> str:
        """libpq conninfo of safekeeper i's reader port: user walsidecar, its passfile, TLS verify-full (or none)."""
        from psycopg.conninfo import make_conninfo
        address = self.members[f"safekeeper{i}"].reader_address  # type: ignore[attr-defined]
        certs = self.certs_dir("reader", "client")
        ssl = {"sslmode": "disable"} if certs is None else \
            {"sslmode": "verify-full", "sslrootcert": str(certs / "ca.crt")}
        return make_conninfo(**{"host": address.host, "port": address.port, "user": "walsidecar",
                                "passfile": str(self.reader_passfile), "dbname": "replication",
                                "connect_timeout": 10, **ssl, **params})

    def history_start(self, i: int) -> int:
        """Where the first term starts, as safekeeper i knows it once it joined a term (an empty
        data directory joins only after it learned its term from its peers)."""
        data = wait_for(lambda: (c := load_control(self.sk_dir(i))) is not None and c.state.term_history and c,
                        timeout=30, what=f"safekeeper {i} to join a term")
        return data.state.term_history[0].start_lsn


def add_standby(d: LocalDeployment, base: Path) -> Standby:
    """A standby of the deployment's primary, fed by the safekeepers' reader ports, started."""
    cluster = LocalCluster(base / "standby" / "data", free_port(), log_file=base / "standby" / "server.log")
    standby = Standby(d, cluster)
    d.add(standby)
    standby.start()
    return standby


def backup_lsn(d: LocalDeployment, i: int) -> int:
    """Safekeeper i's backup_lsn, from its control file: below it, every segment is archived."""
    data = load_control(d.data_dir(f"safekeeper{i}"))
    return data.state.backup_lsn if data else 0


def reader_settings(d: LocalDeployment, **extra: object) -> RestoreWalSettings:
    """Settings of a reader of this deployment's reader ports (restore-wal's, which WalReader takes too)."""
    certs = d.certs_dir("reader", "client")
    tls = {"certs_dir": certs} if certs is not None else {"insecure": True}
    return RestoreWalSettings(safekeeper_readers=tuple(str(a) for a in d.reader_addresses),
                              reader_passfile=d.reader_passfile, **{**tls, **extra})


def wait_holds_primary_wal(d: Deployment, i: int, what: str, timeout: float = 60) -> None:
    """Wait until safekeeper i holds the primary's WAL from the first term's start to its flush position now."""
    end = d.flush_lsn()
    start = d.history_start(1)
    wait_for(lambda: wal_matches_primary(d, i, start, end), timeout=timeout, what=what)


def wait_replayed(d: Deployment, lsn: int, what: str, timeout: float = 60) -> None:
    """Wait until the sidecar reports `lsn` as replayed: flushed by every safekeeper of the term."""
    def replayed() -> bool:
        row = d.replication_row()
        return row is not None and row[4] is not None and parse_lsn(row[4]) >= lsn
    wait_for(replayed, timeout=timeout, what=what)


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


def syncrep_waiters(d: LocalDeployment) -> int:
    """How many backends of the primary wait for the synchronous standby (wait event SyncRep)."""
    with d.sql() as c:
        return c.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'").fetchone()[0]


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

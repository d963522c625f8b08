"""Real PostgreSQL 15 WAL for the analytics tests: bulk load, pgbench, compressed full-page images, a huge record."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    # Run as a script: import this checkout's sidecar, whatever else is installed.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
import pytest
from support.backends import (
    BackendUnavailable,
    ContainerBackend,
    LocalBackend,
    LocalPgServer,
    make_backend,
)

from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG
from sidecar.lsn import parse_lsn, segment_file_name

BIG_MESSAGE_BYTES = 34 * 1024 * 1024  # more than two segments: one segment holds no record start
COMPRESSIONS = ("pglz", "lz4", "zstd")


@dataclass(frozen=True)
class GeneratedWal:
    """Copied segments FIRST..LAST of a stopped server, and landmarks in them."""

    server: LocalPgServer
    archive: Path
    first_segno: int
    last_segno: int
    big_message_end: int  # EndRecPtr of the huge logical message
    switch_lsn: int  # where pg_switch_wal() was called

    @property
    def names(self) -> list[str]:
        return [segment_file_name(1, s) for s in range(self.first_segno, self.last_segno + 1)]


def _lsn(conn: psycopg.Connection, expr: str) -> int:
    row = conn.execute(f"SELECT {expr}::text").fetchone()
    assert row is not None
    return parse_lsn(row[0])


def generate_wal(make_server: Callable[[dict[str, str]], LocalPgServer], archive: Path, scale: int = 2) -> GeneratedWal:
    """Run the workload on a fresh server, stop it and copy its segments into archive (0755, files 0644).

    scale is pgbench's: the bulk load writes about 7 MB of WAL per unit.
    """
    server = make_server({"autovacuum": "off", "wal_keep_size": "4GB", "max_wal_size": "4GB", "timezone": "UTC"})
    pgbench = ("-h", server.host, "-p", str(server.port), "-U", "postgres")
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        first_segno = _lsn(conn, "pg_current_wal_insert_lsn()") // SEG
        server.run_bin("pgbench", "-i", "-s", str(scale), "-q", *pgbench, "postgres")  # COPY: a bulk load
        conn.execute("CHECKPOINT")
        server.run_bin("pgbench", "-n", "-t", "150", "-c", "2", "-j", "2", *pgbench, "postgres")
        for method in COMPRESSIONS:
            # wal_compression is per session for a superuser: the images this session logs use it.
            conn.execute(f"SET wal_compression = {method}")
            conn.execute("CHECKPOINT")
            conn.execute("UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid % 151 = 0")
        conn.execute("RESET wal_compression")
        with conn.transaction(force_rollback=True):
            conn.execute("INSERT INTO pgbench_history (tid, bid, aid, delta) VALUES (1, 1, 1, 1)")
        big = _lsn(conn, f"pg_logical_emit_message(false, 'walsidecar', repeat('x', {BIG_MESSAGE_BYTES}))")
        switch = _lsn(conn, "pg_switch_wal()")
        conn.execute("CREATE TABLE after_switch (id int primary key, v text)")
        for i in range(3):
            conn.execute("INSERT INTO after_switch VALUES (%s, repeat('v', %s))", (i, 50 * i))
        last_segno = _lsn(conn, "pg_current_wal_insert_lsn()") // SEG
    server.stop()
    archive.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(archive, 0o755)
    for segno in range(first_segno, last_segno + 1):
        name = segment_file_name(1, segno)
        shutil.copyfile(server.pg_wal_dir / name, archive / name)
        os.chmod(archive / name, 0o644)
    return GeneratedWal(server, archive, first_segno, last_segno, big, switch)


def wal_fixture(directory: str) -> Any:
    """A module-scoped fixture: the workload's WAL, generated in a new directory test_root/DIRECTORY-*.

    A new one each time: pytest sets a module's fixture up again when the module's tests do not run in one go
    (pytest-xdist's worksteal hands some of them to a worker after tests of other modules)."""

    @pytest.fixture(scope="module")
    def wal(request: pytest.FixtureRequest, test_root: Path) -> Iterator[GeneratedWal]:
        base = Path(tempfile.mkdtemp(prefix=f"{directory}-", dir=test_root))
        os.chmod(base, 0o755)  # the server's OS user reads the archive under it
        try:
            backend = make_backend(request.config.getoption("--pg-backend"), base / "pg")
        except BackendUnavailable as exc:
            pytest.skip(str(exc))
        with generated_wal(backend, base / "archive") as generated:
            yield generated

    return wal


@contextmanager
def generated_wal(backend: LocalBackend | ContainerBackend, archive: Path, scale: int = 2) -> Iterator[GeneratedWal]:
    """generate_wal on a server the backend makes; the server is torn down afterwards."""
    servers: list[LocalPgServer] = []

    def make(settings: dict[str, str]) -> LocalPgServer:
        server = backend.create("pg", settings)
        servers.append(server)
        server.start()
        return server

    try:
        yield generate_wal(make, archive, scale)
    finally:
        for server in servers:
            server.teardown()


def main() -> None:
    """`python3 tests/realwal.py DIR [SCALE]`: write the workload's segments into DIR (for benchmarks)."""
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: realwal.py DIR [PGBENCH_SCALE]")
    target = Path(sys.argv[1])
    scale = int(sys.argv[2]) if len(sys.argv) == 3 else 2
    with tempfile.TemporaryDirectory(prefix="walsidecar-realwal-") as tmp:
        base = Path(tmp)
        os.chmod(base, 0o755)
        with generated_wal(make_backend("local", base / "pg"), base / "archive", scale) as wal:
            shutil.copytree(wal.archive, target, dirs_exist_ok=True)
    print(f"{len(wal.names)} segments {wal.names[0]}..{wal.names[-1]} in {target}")


if __name__ == "__main__":
    main()

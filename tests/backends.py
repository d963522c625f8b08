"""PostgreSQL servers for tests behind one small interface, so backends can be swapped."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Mapping, Protocol, runtime_checkable

from helpers import free_port
from sidecar.pgcluster import ClusterError, LocalCluster


@runtime_checkable
class PgServer(Protocol):
    """What tests may do with a PostgreSQL server, whatever runs it."""

    name: str
    host: str
    port: int

    @property
    def data_dir(self) -> Path: ...

    @property
    def pg_wal_dir(self) -> Path: ...

    def start(self, timeout: float = 60) -> None: ...

    def stop(self, mode: str = "fast", timeout: float = 60) -> None: ...

    def crash(self) -> None: ...

    def restart(self) -> None: ...

    def reload(self) -> None: ...

    def is_running(self) -> bool: ...

    def set(self, settings: Mapping[str, str | None]) -> None: ...

    def dsn(self, dbname: str = "postgres", user: str = "postgres", **params: str) -> str: ...

    def run_bin(
        self, name: str, *args: str, check: bool = True, capture: bool = True
    ) -> subprocess.CompletedProcess[str]: ...

    def log_text(self) -> str: ...


class LocalPgServer:
    """A PgServer backed by sidecar.pgcluster.LocalCluster on 127.0.0.1."""

    def __init__(self, name: str, base_dir: Path, port: int | None = None) -> None:
        self.name = name
        self.host = "127.0.0.1"
        self.port = port if port is not None else free_port(self.host)
        self.cluster = LocalCluster(
            base_dir / name / "data", self.port, host=self.host, log_file=base_dir / name / "server.log"
        )

    def __repr__(self) -> str:
        return f"LocalPgServer({self.name!r}, port={self.port}, data_dir={str(self.data_dir)!r})"

    @property
    def data_dir(self) -> Path:
        """The server's data directory."""
        return self.cluster.data_dir

    @property
    def pg_wal_dir(self) -> Path:
        """The server's pg_wal directory."""
        return self.cluster.pg_wal_dir

    def init(self, settings: Mapping[str, str] | None = None) -> None:
        """initdb with the cluster defaults plus settings."""
        self.cluster.init(dict(settings or {}))

    def start(self, timeout: float = 60) -> None:
        """Start and wait until connections are accepted."""
        self.cluster.start(timeout=timeout)

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        """Stop if running."""
        self.cluster.stop(mode=mode, timeout=timeout)

    def crash(self) -> None:
        """Immediate stop: the next start runs crash recovery."""
        self.cluster.crash()

    def restart(self) -> None:
        """Fast stop then start."""
        self.cluster.restart()

    def reload(self) -> None:
        """SIGHUP the postmaster; poll SHOW to see the effect."""
        self.cluster.reload()

    def is_running(self) -> bool:
        """True while the postmaster is alive."""
        return self.cluster.is_running()

    def set(self, settings: Mapping[str, str | None]) -> None:
        """Merge managed settings (None removes one); then reload() or restart()."""
        self.cluster.set(settings)

    def dsn(self, dbname: str = "postgres", user: str = "postgres", **params: str) -> str:
        """libpq connection string over TCP."""
        return self.cluster.dsn(dbname=dbname, user=user, **params)

    def run_bin(
        self, name: str, *args: str, check: bool = True, capture: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run pgbench, psql, pg_waldump, ... as the server's OS user, pointed at this server."""
        return self.cluster.run_bin(name, *args, check=check, capture=capture)

    def log_text(self) -> str:
        """The server log so far."""
        try:
            return self.cluster.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def teardown(self) -> None:
        """Stop by any means that targets only this server: pg_ctl fast, immediate, then its PID."""
        for mode in ("fast", "immediate"):
            try:
                self.cluster.stop(mode=mode, timeout=30)
                return
            except (ClusterError, OSError, subprocess.SubprocessError):
                continue
        pid = self.cluster.postmaster_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class LocalBackend:
    """Creates LocalPgServers under one directory."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir

    def create(self, name: str, settings: Mapping[str, str] | None = None) -> LocalPgServer:
        """Make and initialise (not start) a server named name."""
        server = LocalPgServer(name, self.base_dir)
        server.init(settings)
        return server


class BackendUnavailable(RuntimeError):
    """The requested --pg-backend cannot be used here."""


BACKENDS = ("local", "container")


def make_backend(kind: str, base_dir: Path) -> LocalBackend:
    """The backend for --pg-backend kind."""
    if kind == "local":
        return LocalBackend(base_dir)
    if kind == "container":
        raise BackendUnavailable("--pg-backend container is not available yet; use --pg-backend local")
    raise BackendUnavailable(f"unknown --pg-backend {kind!r}; choose one of {', '.join(BACKENDS)}")

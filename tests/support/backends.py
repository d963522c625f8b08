"""PostgreSQL servers for tests behind one small interface, so backends can be swapped."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import psycopg

from support.helpers import free_port, wait_for
from sidecar.deployment import PgServer as DeployedServer
from sidecar.pgcluster import ClusterError, LocalCluster, initdb_args


@runtime_checkable
class PgServer(DeployedServer, Protocol):
    """What tests may do with a PostgreSQL server, whatever runs it: what a deployment does, and more."""

    name: str
    host: str

    @property
    def pg_wal_dir(self) -> Path: ...

    def restart(self) -> None: ...

    def reload(self) -> None: ...

    def set(self, settings: Mapping[str, str | None]) -> None: ...

    def run_bin(
        self, name: str, *args: str, check: bool = True, capture: bool = True
    ) -> subprocess.CompletedProcess[str]: ...

    def log_text(self) -> str: ...


class LocalPgServer(LocalCluster):
    """A PgServer that is a sidecar.pgcluster.LocalCluster on 127.0.0.1 under BASE_DIR/NAME."""

    def __init__(self, name: str, base_dir: Path, port: int | None = None) -> None:
        self.name = name
        super().__init__(base_dir / name / "data", port if port is not None else free_port("127.0.0.1"),
                         log_file=base_dir / name / "server.log")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, port={self.port}, data_dir={str(self.data_dir)!r})"


class LocalBackend:
    """Creates LocalPgServers under one directory."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir

    def create(self, name: str, settings: Mapping[str, str] | None = None) -> LocalPgServer:
        """Make and initialise (not start) a server named name."""
        server = LocalPgServer(name, self.base_dir)
        server.init(settings)
        return server


class ContainerPgServer:
    """A PgServer in a walsidecar/postgres container on the host network, bound to 127.0.0.1.

    Its directory is bind-mounted at the same path inside the container, so data_dir, pg_wal_dir
    and any path a test passes to run_bin mean the same on both sides. The settings live in
    walsidecar.conf exactly as with LocalPgServer; stop modes are the postmaster's signals.
    """

    def __init__(self, name: str, base_dir: Path, port: int | None = None) -> None:
        from containers import harness

        self._h = harness
        self.name = name
        self.host = "127.0.0.1"
        self.port = port if port is not None else free_port(self.host)
        self.dir = (base_dir / name).absolute()
        # Only the settings-file bookkeeping of LocalCluster is used: it never runs a binary here.
        self.cluster = LocalCluster(self.dir / "data", self.port, host=self.host, bin_dir=Path(harness.PG_BIN),
                                    os_user=pwd.getpwuid(os.geteuid()).pw_name)
        self.server: Any = None
        self._init_output = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, port={self.port}, data_dir={str(self.data_dir)!r})"

    @property
    def data_dir(self) -> Path:
        """The server's data directory (the same path in the container)."""
        return self.cluster.data_dir

    @property
    def pg_wal_dir(self) -> Path:
        """The server's pg_wal directory."""
        return self.cluster.pg_wal_dir

    def _mounts(self) -> dict[str, str]:
        return {str(self.dir): str(self.dir)}

    def init(self, settings: Mapping[str, str] | None = None) -> None:
        """initdb in a throwaway container, then the same managed settings as a local cluster."""
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)
        self.data_dir.mkdir(mode=0o700)
        os.chown(self.data_dir, self._h.PG_UID, self._h.PG_UID)
        proc = self._h.run_once(self._h.PG_IMAGE, [f"{self._h.PG_BIN}/initdb", *initdb_args(self.data_dir)],
                                volumes=self._mounts())
        self._init_output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise ClusterError(f"initdb failed in a container for {self.data_dir}:\n{self._init_output}")
        self.cluster.configure(settings)

    def start(self, timeout: float = 60) -> None:
        """Start the container (created on the first start) and wait until connections are accepted."""
        if self.server is None:
            self.server = self._h.HostNetContainer(
                self._h.PG_IMAGE, ["-D", str(self.data_dir)], volumes=self._mounts(),
                entrypoint=[f"{self._h.PG_BIN}/postgres"], user="postgres")
            self.server.start(wait=False)
        else:
            self.server.container.start()

        def accepting() -> bool:
            if self.server.status() in ("exited", "dead"):
                raise ClusterError(f"server failed to start ({self.data_dir}, port {self.port}):\n"
                                   + "\n".join(self.log_text().splitlines()[-40:]))
            try:
                psycopg.connect(self.dsn(), connect_timeout=2).close()
                return True
            except psycopg.OperationalError:
                return False

        wait_for(accepting, timeout=timeout, what=f"{self!r} to accept connections")

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        """Stop if running: the postmaster's signal for mode, then wait for the container to exit."""
        if not self.is_running():
            return
        self.server.kill(self._h.PG_STOP_SIGNALS[mode])
        try:
            self.server.container.wait(timeout=timeout)
        except Exception as e:  # requests' ReadTimeout / ConnectionError
            if self.is_running():
                raise ClusterError(f"server did not stop ({mode}) within {timeout}s: {e}") from e

    def crash(self) -> None:
        """Immediate stop: the next start runs crash recovery."""
        self.stop(mode="immediate")

    def restart(self) -> None:
        """Fast stop then start."""
        self.stop()
        self.start()

    def reload(self) -> None:
        """SIGHUP the postmaster; poll SHOW to see the effect."""
        self.server.kill("SIGHUP")

    def is_running(self) -> bool:
        """True while the server's container runs."""
        return self.server is not None and self.server.is_running()

    def set(self, settings: Mapping[str, str | None]) -> None:
        """Merge managed settings (None removes one); then reload() or restart()."""
        self.cluster.set(settings)

    def dsn(self, dbname: str = "postgres", user: str = "postgres", **params: str) -> str:
        """libpq connection string over TCP."""
        return self.cluster.dsn(dbname=dbname, user=user, **params)

    def run_bin(
        self, name: str, *args: str, check: bool = True, capture: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run pgbench, psql, pg_waldump, ... as postgres inside the container (a throwaway one
        with the same mount when the server is stopped), pointed at this server."""
        argv = [f"{self._h.PG_BIN}/{name}", *args]
        env = {"PGHOST": self.host, "PGPORT": str(self.port), "PGUSER": "postgres"}
        extra = self._host_paths(args)
        if extra or not self.is_running():
            # Host paths outside the server's directory (e.g. pg_waldump --path DIR) are mounted
            # at the same path into a throwaway container on the host network.
            proc = self._h.run_once(self._h.PG_IMAGE, argv, volumes={**self._mounts(), **extra},
                                    environment=env, network_mode="host")
        else:
            rc, (out, err) = self.server.container.exec_run(argv, user="postgres", environment=env,
                                                             workdir="/", demux=True)
            proc = subprocess.CompletedProcess(argv, rc, (out or b"").decode(errors="replace"),
                                               (err or b"").decode(errors="replace"))
        if not capture:
            sys.stdout.write(proc.stdout)
            sys.stderr.write(proc.stderr)
        if check and proc.returncode != 0:
            raise ClusterError(f"{name} exited with {proc.returncode}: {' '.join(argv)}\n"
                               f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
        return proc

    def _host_paths(self, args: tuple[str, ...]) -> dict[str, str]:
        """Existing host directories named by absolute-path arguments outside the server's directory."""
        found: dict[str, str] = {}
        for arg in args:
            value = arg.partition("=")[2] if arg.startswith("-") else arg
            if not value.startswith("/"):
                continue
            path = Path(value)
            directory = path if path.is_dir() else path.parent
            if directory.is_dir() and not directory.is_relative_to(self.dir) and directory != Path("/"):
                found[str(directory)] = str(directory)
        return found

    def log_text(self) -> str:
        """initdb's output, then the server's (the container's log, across restarts)."""
        return self._init_output + (self.server.logs() if self.server is not None else "")

    def teardown(self) -> None:
        """Stop (fast, then immediate) and remove the container, whatever state it is in."""
        if self.server is None:
            return
        for mode in ("fast", "immediate"):
            try:
                self.stop(mode=mode, timeout=30)
                break
            except ClusterError:
                continue
        self.server.remove()


class ContainerBackend:
    """Creates ContainerPgServers; needs a Docker engine with walsidecar/postgres (scripts/build-images.sh)."""

    def __init__(self, base_dir: Path) -> None:
        from containers.harness import availability

        a = availability()
        if a.fail:
            raise RuntimeError(f"--pg-backend container: {a.reason}")
        if not a.ok:
            raise BackendUnavailable(f"--pg-backend container: {a.reason}")
        self.base_dir = base_dir

    def create(self, name: str, settings: Mapping[str, str] | None = None) -> ContainerPgServer:
        """Make and initialise (not start) a server named name."""
        server = ContainerPgServer(name, self.base_dir)
        server.init(settings)
        return server


class BackendUnavailable(RuntimeError):
    """The requested --pg-backend cannot be used here."""


BACKENDS = ("local", "container")


def make_backend(kind: str, base_dir: Path) -> LocalBackend | ContainerBackend:
    """The backend for --pg-backend kind."""
    if kind == "local":
        return LocalBackend(base_dir)
    if kind == "container":
        return ContainerBackend(base_dir)
    raise BackendUnavailable(f"unknown --pg-backend {kind!r}; choose one of {', '.join(BACKENDS)}")

"""Containers for tests: walsidecar's images on the host network, each bound to 127.0.0.1.

No port is mapped: a host-network container's port is a port of the (test's) network namespace,
chosen free here and passed to the container. Readiness is polled by the tests themselves.
Every container carries LABEL = "<hostname>:<pid of the pytest process>", so that containers
left by a killed run can be found and removed, without touching those of a run still going.
"""

from __future__ import annotations

import os
import shutil

# testcontainers reads these when it is imported: the reaper image cannot be pulled here, and the
# container host must be 127.0.0.1 (this machine has /.dockerenv, which would make testcontainers
# look for a gateway address instead).
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
os.environ.setdefault("TC_HOST", "127.0.0.1")
os.environ.setdefault("TESTCONTAINERS_CONNECTION_MODE", "docker_host")

import socket
import subprocess
from typing import Any, Sequence

import psycopg

from support.helpers import free_port, wait_for

PG_IMAGE = os.environ.get("WALSIDECAR_PG_IMAGE", "walsidecar/postgres:local")
APP_IMAGE = os.environ.get("WALSIDECAR_IMAGE", "walsidecar/walsidecar:local")
PG_BIN = "/usr/lib/postgresql/15/bin"
PG_UID = 999   # the postgres user of the PostgreSQL image (docker/rootfs.py; the official image too)
LABEL = "org.walsidecar.tests"
OWNER = f"{socket.gethostname()}:{os.getpid()}"
PASSWORD = "walsidecar-test"


class Availability:
    """Whether container tests can run here, and what to do when they cannot."""

    def __init__(self, reason: str | None, fail: bool) -> None:
        self.reason, self.fail = reason, fail

    @property
    def ok(self) -> bool:
        return self.reason is None


_availability: Availability | None = None


def availability() -> Availability:
    """Checked once per session: an engine answers and the images are present.

    Not available: skip with the reason, unless the run promised an engine
    (WALSIDECAR_REQUIRE_CONTAINERS=1, set by scripts/with-docker.sh once its dockerd runs) or the
    image build failed (WALSIDECAR_IMAGES_ERROR): then the tests fail.
    """
    global _availability
    if _availability is not None:
        return _availability
    must = os.environ.get("WALSIDECAR_REQUIRE_CONTAINERS") == "1"
    reason: str | None = None
    if os.environ.get("WALSIDECAR_IMAGES_ERROR"):
        reason, must = os.environ["WALSIDECAR_IMAGES_ERROR"], True
    elif os.environ.get("WALSIDECAR_DOCKER_UNAVAILABLE"):
        reason = os.environ["WALSIDECAR_DOCKER_UNAVAILABLE"]
    else:
        try:
            import testcontainers  # noqa: F401

            import docker
        except ImportError as e:
            reason = f"{e.name} is not installed (pip install -e '.[test]')"
        else:
            try:
                client = docker.from_env()
                client.ping()
            except Exception as e:  # docker raises several unrelated types here
                reason = f"no Docker engine reachable ({e})"
            else:
                missing = [img for img in (PG_IMAGE, APP_IMAGE) if not _has_image(client, img)]
                if missing:
                    # testcontainers would try to pull them: say so instead.
                    reason = f"image {', '.join(missing)} missing: run scripts/build-images.sh"
                else:
                    remove_leftovers(client)
                client.close()
    _availability = Availability(reason, must and reason is not None)
    return _availability


def _has_image(client: Any, image: str) -> bool:
    import docker.errors
    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False


def remove_leftovers(client: Any) -> list[str]:
    """Remove our containers whose pytest process on this host is gone (a killed run)."""
    removed = []
    for c in client.containers.list(all=True, filters={"label": LABEL}):
        host, _, pid = c.labels.get(LABEL, "").rpartition(":")
        if host != socket.gethostname() or not pid.isdigit() or _alive(int(pid)):
            continue
        c.remove(force=True, v=True)
        removed.append(c.short_id)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def docker_client() -> Any:
    import docker
    return docker.from_env()


class HostNetContainer:
    """A testcontainers DockerContainer on the host network; start() waits for ready()."""

    role = "container"

    def __init__(self, image: str, command: Sequence[str] | None = None, *, env: dict[str, str] | None = None,
                 volumes: dict[str, str] | None = None, tmpfs: dict[str, str] | None = None,
                 **create_kwargs: Any) -> None:
        from testcontainers.core.container import DockerContainer

        self.tc = DockerContainer(image)
        if command is not None:
            self.tc.with_command(list(command))
        for k, v in (env or {}).items():
            self.tc.with_env(k, v)
        for host, inside in (volumes or {}).items():
            self.tc.with_volume_mapping(host, inside, mode="rw")
        for inside, options in (tmpfs or {}).items():
            self.tc.with_tmpfs_mount(inside, options)   # options go to docker as they are
        # with_kwargs replaces earlier kwargs: everything goes in this one call. network=None also
        # stops testcontainers from looking for a "host network" of its own.
        self.tc.with_kwargs(network_mode="host", network=None,
                            labels={LABEL: OWNER, f"{LABEL}.role": self.role}, **create_kwargs)

    @property
    def container(self) -> Any:
        """The docker-py Container."""
        return self.tc.get_wrapped_container()

    def ready(self) -> bool:
        return True

    def status(self) -> str:
        c = self.container
        c.reload()
        return c.status

    def is_running(self) -> bool:
        return self.tc._container is not None and self.status() == "running"

    def logs(self) -> str:
        if self.tc._container is None:
            return ""
        import docker.errors
        try:
            return self.container.logs().decode(errors="replace")
        except docker.errors.APIError as e:  # the container may be gone already
            return f"<no logs: {e}>"

    def wait_ready(self, timeout: float = 60) -> None:
        def check() -> bool:
            if self.status() in ("exited", "dead"):
                raise RuntimeError(f"{self!r} exited ({self.container.attrs['State'].get('ExitCode')}):\n"
                                   + self.logs()[-4000:])
            return self.ready()

        wait_for(check, timeout=timeout, interval=0.05, what=f"{self!r} to be ready")

    def start(self, wait: bool = True, timeout: float = 60) -> HostNetContainer:
        """Create and start the container (first time) or start it again (after stop())."""
        if self.tc._container is None:
            self.tc.start()
        else:
            self.container.start()
        if wait:
            self.wait_ready(timeout)
        return self

    def stop(self, timeout: int = 10) -> None:
        """docker stop: the image's STOPSIGNAL, SIGKILL after timeout. The container is kept."""
        self.container.stop(timeout=timeout)

    def kill(self, signal: str = "SIGKILL") -> None:
        self.container.kill(signal=signal)

    def remove(self) -> None:
        """Remove the container (and its anonymous volumes), whatever its state."""
        import docker.errors
        if self.tc._container is not None:
            try:
                self.tc.stop(force=True, delete_volume=True)
            except docker.errors.NotFound:  # already removed
                pass


class PgContainer(HostNetContainer):
    """walsidecar/postgres through its entrypoint: initdb into a tmpfs, then postgres on 127.0.0.1."""

    role = "postgres"

    def __init__(self, *postgres_args: str, port: int | None = None, image: str = PG_IMAGE) -> None:
        self.port = port or free_port()
        super().__init__(
            image, ["postgres", "-c", "fsync=off", *postgres_args],
            env={"PGPORT": str(self.port), "PGLISTEN": "127.0.0.1", "POSTGRES_PASSWORD": PASSWORD,
                 "POSTGRES_INITDB_ARGS": "--no-sync", "PGDATA": "/pgtmp/data"},
            # A tmpfs at a path the image does not have (on an existing dir, mode= is ignored).
            tmpfs={"/pgtmp": "size=1g,mode=1777"})

    def __repr__(self) -> str:
        return f"PgContainer(port={self.port})"

    def dsn(self, dbname: str = "postgres", **params: str) -> str:
        parts = {"host": "127.0.0.1", "port": str(self.port), "user": "postgres", "password": PASSWORD,
                 "dbname": dbname, **params}
        return " ".join(f"{k}={v}" for k, v in parts.items())

    def ready(self) -> bool:
        try:
            with psycopg.connect(self.dsn(), connect_timeout=2) as c:
                c.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False


IMAGE_UID = 10001  # the walsidecar image's user (docker/Dockerfile)


def container_certs(role: str, node_id: int | None = None) -> str:
    """The session's certificates for `role`, copied for the image's user: its key stays 0600."""
    from support.pki import session_pki
    src = session_pki().certs(role, node_id)
    dst = src.parent / "containers" / src.name
    if not dst.exists():
        shutil.copytree(src, dst)
        for p in (dst, *dst.iterdir()):
            os.chown(p, IMAGE_UID, IMAGE_UID)
    return str(dst)


class SafekeeperContainer(HostNetContainer):
    """`walsidecar safekeeper` with its data in the container's own filesystem (kept across restarts)."""

    role = "safekeeper"

    def __init__(self, node_id: int, port: int | None = None, image: str = APP_IMAGE) -> None:
        self.node_id = node_id
        self.port = port or free_port()
        super().__init__(image, ["safekeeper", "--id", str(node_id), "--listen", self.address,
                                 "--data-dir", f"/var/lib/walsidecar/sk{node_id}", "--certs-dir", "/certs"],
                         volumes={container_certs("safekeeper", node_id): "/certs"})

    def __repr__(self) -> str:
        return f"SafekeeperContainer({self.node_id}, port={self.port})"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False


class ProposerContainer(HostNetContainer):
    """`walsidecar start` attached to the primary; readiness is the primary's view (pg_stat_replication)."""

    role = "proposer"

    def __init__(self, pg_dsn: str, safekeepers: Sequence[str], *extra: str, image: str = APP_IMAGE) -> None:
        super().__init__(image, ["start", "--pg-dsn", pg_dsn, "--safekeepers", ",".join(safekeepers),
                                 "--certs-dir", "/certs", *extra], volumes={container_certs("proposer"): "/certs"})

    def __repr__(self) -> str:
        return "ProposerContainer()"


def run_once(image: str, argv: Sequence[str], *, user: str | None = "postgres", volumes: dict[str, str] | None = None,
             environment: dict[str, str] | None = None, network_mode: str = "none",
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run argv in a throwaway container (no network unless asked) and return its status and output.

    user=None runs as the image's own USER.
    """
    client = docker_client()
    try:
        c = client.containers.create(
            image, entrypoint=list(argv[:1]), command=list(argv[1:]), user=user, network_mode=network_mode,
            environment=environment or {}, labels={LABEL: OWNER, f"{LABEL}.role": "once"},
            volumes={h: {"bind": inside, "mode": "rw"} for h, inside in (volumes or {}).items()})
        try:
            c.start()
            rc = c.wait(timeout=timeout)["StatusCode"]
            out = c.logs(stdout=True, stderr=False).decode(errors="replace")
            err = c.logs(stdout=False, stderr=True).decode(errors="replace")
        finally:
            c.remove(force=True, v=True)
    finally:
        client.close()
    return subprocess.CompletedProcess(list(argv), rc, out, err)


APP = "walsidecar"


class ContainerDeployment:
    """A primary, N safekeepers and the proposer, every one of them a container on 127.0.0.1."""

    def __init__(self, n: int = 3, pg_args: Sequence[str] = ("-c", f"synchronous_standby_names={APP}")) -> None:
        self.pg = PgContainer(*pg_args)
        self.safekeepers = {i: SafekeeperContainer(i) for i in range(1, n + 1)}
        self.proposer: ProposerContainer | None = None

    @property
    def addresses(self) -> list[str]:
        return [sk.address for sk in self.safekeepers.values()]

    def all(self) -> list[HostNetContainer]:
        return [self.pg, *self.safekeepers.values(), *([self.proposer] if self.proposer else [])]

    def start_all(self) -> None:
        for c in (self.pg, *self.safekeepers.values()):   # started together, then polled
            c.start(wait=False)
        for c in (self.pg, *self.safekeepers.values()):
            c.wait_ready()
        self.start_proposer()
        self.wait_sync()

    def start_proposer(self, *extra: str) -> ProposerContainer:
        self.proposer = ProposerContainer(self.pg.dsn(), self.addresses, *extra)
        self.proposer.start(wait=False)
        return self.proposer

    def sql(self) -> psycopg.Connection:
        return psycopg.connect(self.pg.dsn(), autocommit=True)

    def replication_row(self) -> tuple | None:
        """(application_name, state, sync_state, flush_lsn, client_addr) of the sidecar's walsender."""
        with self.sql() as c:
            return c.execute(
                "SELECT application_name, state, sync_state, flush_lsn::text, host(client_addr) "
                "FROM pg_stat_replication WHERE application_name = %s", (APP,)).fetchone()

    def wait_sync(self, timeout: float = 60) -> None:
        def check() -> bool:
            if self.proposer is not None and self.proposer.status() in ("exited", "dead"):
                raise RuntimeError("the proposer container exited:\n" + self.proposer.logs()[-4000:])
            row = self.replication_row()
            return row is not None and row[2] == "sync"

        wait_for(check, timeout=timeout, what="the sidecar to be the synchronous standby")

    def syncrep_waiters(self) -> int:
        with self.sql() as c:
            return c.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'").fetchone()[0]

    def walsidecar(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`walsidecar ARGS` in a throwaway container of the walsidecar image, on the host network."""
        return run_once(APP_IMAGE, ["walsidecar", *args], user=None, network_mode="host", timeout=120,
                        volumes={container_certs("client"): "/certs"}, environment={"WALSIDECAR_CERTS_DIR": "/certs"})

    def logs(self) -> str:
        return "\n".join(f"--- {c!r} logs ---\n" + "\n".join(c.logs().splitlines()[-80:]) for c in self.all())

    def remove_all(self) -> None:
        for c in reversed(self.all()):
            c.remove()

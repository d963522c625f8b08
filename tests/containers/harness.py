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
from pathlib import Path
from typing import Any, Callable, Sequence

import psycopg

from support.helpers import free_port, wait_for
from sidecar.deployment import APP, LocalDeployment, Primary, ProposerMember, SafekeeperMember, SidecarMember

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
                 role: str | None = None, probe: Callable[[], bool] | None = None, **create_kwargs: Any) -> None:
        from testcontainers.core.container import DockerContainer

        self.role = role or self.role
        self.probe = probe
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
        return self.probe() if self.probe is not None else True

    def status(self) -> str:
        """docker's state of the container ("running", "exited", ...), or "removed"."""
        import docker.errors
        c = self.container
        try:
            c.reload()
        except docker.errors.NotFound:
            return "removed"
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
            if self.status() in ("exited", "dead", "removed"):
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


PG_STOP_SIGNALS = {"smart": "SIGTERM", "fast": "SIGINT", "immediate": "SIGQUIT"}


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

    @property
    def data_dir(self) -> Path:
        """The data directory, inside the container."""
        return Path("/pgtmp/data")

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:  # type: ignore[override]
        """Stop if running: the postmaster's signal for `mode`, then wait for the container to exit."""
        if self.is_running():
            self.kill(PG_STOP_SIGNALS[mode])
            self.container.wait(timeout=timeout)

    def crash(self) -> None:
        """Immediate stop: the next start runs crash recovery."""
        self.stop("immediate")

    def teardown(self) -> None:
        self.remove()

    def dsn(self, dbname: str = "postgres", user: str = "postgres", **params: str) -> str:
        parts = {"host": "127.0.0.1", "port": str(self.port), "user": user, "password": PASSWORD,
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


class ContainerCertificates:
    """The session's certificates for a role, copied for the image's user (container_certs)."""

    def certs(self, name: str, role: str, node_id: int | None, hosts: tuple[str, ...]) -> Path:
        return Path(container_certs(role, node_id))


class ContainerMember(SidecarMember):
    """A walsidecar member run in a container of the walsidecar image: the command its process kind runs,
    with the certificates mounted at /certs.

    The container is made on the first start and started again after a stop, so its data stays; kill is
    SIGKILL; its output goes to the member's log file when it is closed.
    """

    container: HostNetContainer | None = None

    def start(self, *extra: str) -> HostNetContainer:
        """Start the container (made on the first start, with `extra` arguments); the caller polls readiness."""
        if self.container is None:
            certs = self.d.certs_dir(self.name, self.role, self.node_id)
            command, kwargs = self.container_command(
                [*self.args(), "--certs-dir", "/certs", *self.d.extra.get(self.name, ()), *extra])
            self.container = HostNetContainer(APP_IMAGE, command, volumes={str(certs): "/certs"}, role=self.role,
                                              probe=self.ready, **kwargs)
        self.container.start(wait=False)
        self.wanted = True
        self.d.note("started", process=self.name, container=self.container.container.short_id)
        return self.container

    def container_command(self, argv: list[str]) -> tuple[list[str], dict[str, Any]]:
        """The container's command for `walsidecar ARGV`, and what else to create it with."""
        return argv, {}

    def ready(self) -> bool:
        """Whether the started container serves (polled by wait_ready)."""
        return True

    def wait_ready(self, timeout: float = 60) -> None:
        assert self.container is not None
        self.container.wait_ready(timeout)

    def stop(self, timeout: float = 15) -> None:
        """docker stop: SIGTERM, SIGKILL after `timeout` seconds; the container is kept."""
        self.wanted = False
        if self.running:
            self.container.stop(timeout=int(timeout))  # type: ignore[union-attr]

    def kill(self) -> None:
        self.wanted = False
        if self.running:
            self.container.kill()  # type: ignore[union-attr]

    def close(self) -> None:
        """Save the output and remove the container."""
        self.wanted = False
        if self.container is not None:
            self.log_path.write_text(self.logs())
            self.container.remove()

    def logs(self) -> str:
        return self.container.logs() if self.container is not None else ""

    @property
    def running(self) -> bool:
        return self.container is not None and self.container.is_running()

    @property
    def returncode(self) -> int | None:
        if self.container is None or self.running:
            return None
        return int(self.container.container.attrs["State"]["ExitCode"])

    @property
    def data_dir(self) -> Path:
        """Inside the container, kept across its restarts."""
        return Path("/var/lib/walsidecar") / self.name

    @property
    def log_path(self) -> Path:
        return self.d.base / f"{self.name}.log"


class SafekeeperContainer(ContainerMember, SafekeeperMember):
    """`walsidecar safekeeper` in a container; ready once it accepts connections. A founding one is created
    (`safekeeper-init`) at its first start, inside the container, with a marker beside its data directory."""

    def container_command(self, argv: list[str]) -> tuple[list[str], dict[str, Any]]:
        if not self.founding:
            return argv, {}
        marker = f"{self.data_dir}.created"
        init = f"walsidecar safekeeper-init --id {self.node_id} --data-dir {self.data_dir} " \
               f"--members {len(self.d.addresses)}"
        # The image's shell is dash with a few tools (docker/rootfs.py): the marker by a redirection, not touch.
        script = f'[ -f {marker} ] || {{ {init}; : > {marker}; }}; exec walsidecar "$@"'
        return ["-ec", script, "sh", *argv], {"entrypoint": ["/bin/sh"]}

    def ready(self) -> bool:
        try:
            with socket.create_connection((self.place.address, self.port), timeout=1):
                return True
        except OSError:
            return False

    def term_known(self) -> bool:
        """Its control file, looked for inside the container: the host's path of that name is not its (looking
        there, `start_all` waited its whole timeout before starting the proposer)."""
        from sidecar.safekeeper.control import control_path
        if self.container is None or not self.running:
            return False
        # The shell's `test`: the image has no binary of that name (docker/rootfs.py).
        code, _ = self.container.container.exec_run(["sh", "-c", f"test -f {control_path(self.data_dir)}"])
        return code == 0


class ProposerContainer(ContainerMember, ProposerMember):
    """`walsidecar start` in a container, attached to the primary."""


class ContainerDeployment(LocalDeployment):
    """A LocalDeployment under `base` whose members are all containers on 127.0.0.1: the primary through
    the PostgreSQL image's entrypoint (PgContainer), the safekeepers and the proposer of the walsidecar image."""

    def __init__(self, base: Path, n: int = 3, pg_args: Sequence[str] = ("-c", f"synchronous_standby_names={APP}")
                 ) -> None:
        super().__init__(base, safekeepers=n, primary=PgContainer(*pg_args), certificates=ContainerCertificates(),
                         safekeeper_kind=SafekeeperContainer, proposer_kind=ProposerContainer, readers=False)

    def logs(self) -> str:
        """The last lines of every member's container output."""
        outputs = {name: m.server.logs() if isinstance(m, Primary) else m.logs()  # type: ignore[attr-defined]
                   for name, m in self.members.items()}
        return "\n".join(f"--- {name} logs ---\n" + "\n".join(out.splitlines()[-80:]) for name, out in outputs.items())


def walsidecar_in_image(*args: str) -> subprocess.CompletedProcess[str]:
    """`walsidecar ARGS` in a throwaway container of the walsidecar image, on the host network."""
    return run_once(APP_IMAGE, ["walsidecar", *args], user=None, network_mode="host", timeout=120,
                    volumes={container_certs("client"): "/certs"}, environment={"WALSIDECAR_CERTS_DIR": "/certs"})

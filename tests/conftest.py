"""Shared fixtures: test directories, PostgreSQL servers and tracked subprocesses."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping

import pytest

# testcontainers reads these at import time (tests/containers, --pg-backend container): no reaper
# (its image cannot be pulled) and containers reached on 127.0.0.1 only.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
os.environ.setdefault("TC_HOST", "127.0.0.1")
os.environ.setdefault("TESTCONTAINERS_CONNECTION_MODE", "docker_host")

from support.backends import BACKENDS, BackendUnavailable, PgServer, make_backend
from support import pki as pki_module
from support.procs import ProcessTracker
from support.etcd import EtcdServer
from support.deployment import APP, Deployment
from support.pki import TestPKI
from support.tracebacks import report, tracebacks, walsidecar_logs

_failed_key = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pg-backend",
        choices=BACKENDS,
        default=os.environ.get("WALSIDECAR_PG_BACKEND", "local"),
        help="where test PostgreSQL servers run: 'local' (pg_ctl on this machine) or 'container' "
        "(the walsidecar/postgres image on the host network; see scripts/build-images.sh)",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_failed_key] = True
    return report


def _failed(request: pytest.FixtureRequest) -> bool:
    return request.node.stash.get(_failed_key, False)


@pytest.fixture(scope="session")
def test_root() -> Iterator[Path]:
    """Per-session scratch root under /tmp, traversable by the postgres OS user.

    Removed at the end unless WALSIDECAR_KEEP_TEST_DATA=1.
    """
    root = Path(tempfile.mkdtemp(prefix="walsidecar-test-", dir="/tmp"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        if os.environ.get("WALSIDECAR_KEEP_TEST_DATA") != "1":
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def pki(test_root: Path) -> Iterator[TestPKI]:
    """One CA for the whole session; every walsidecar process a test starts gets a certificate from it."""
    made = TestPKI(test_root / "pki")
    pki_module.install(made)
    try:
        yield made
    finally:
        pki_module.install(None)


@pytest.fixture
def test_dir(test_root: Path, request: pytest.FixtureRequest) -> Path:
    """A fresh 0755 directory for this test (short name: keeps socket paths short)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:48]
    path = Path(tempfile.mkdtemp(prefix=f"{slug}-", dir=test_root))
    os.chmod(path, 0o755)
    return path


@pytest.fixture
def pg_factory(
    request: pytest.FixtureRequest, test_dir: Path
) -> Iterator[Callable[..., PgServer]]:
    """Factory: make(name="pg", settings=None, start=True) -> an initialised server.

    Every server made is stopped at teardown: by its own pg_ctl or postmaster PID (local), or by
    removing its container (container).
    """
    kind = request.config.getoption("--pg-backend")
    try:
        backend = make_backend(kind, test_dir / "pg")
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    servers: list = []

    def make(name: str = "pg", settings: Mapping[str, str] | None = None, start: bool = True) -> PgServer:
        taken = {s.name for s in servers}
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}{n}"
        server = backend.create(unique, settings)
        servers.append(server)
        if start:
            server.start()
        return server

    try:
        yield make
    finally:
        for server in reversed(servers):
            if _failed(request):
                print(f"--- {server!r} log tail ---\n" + "\n".join(server.log_text().splitlines()[-60:]))
            server.teardown()


@pytest.fixture
def pg(pg_factory: Callable[..., PgServer]) -> PgServer:
    """A started server with the default settings (synchronous_standby_names left empty)."""
    return pg_factory()


@pytest.fixture
def procs(request: pytest.FixtureRequest, test_dir: Path) -> Iterator[ProcessTracker]:
    """Tracks ManagedProcesses started in the test; SIGKILLs them all by PID at teardown. Then fails the test if
    a walsidecar process's log holds a traceback (`@pytest.mark.allow_traceback(reason)` exempts a test whose
    point is an unhandled exception)."""
    tracker = ProcessTracker(test_dir / "procs")
    try:
        yield tracker
    finally:
        tracker.kill_all()
        if _failed(request):
            print(tracker.log_tails(60))
    # Once every process is gone and its log complete, and before the session removes the directories.
    if not request.node.get_closest_marker("allow_traceback"):
        found = tracebacks(walsidecar_logs(test_dir, tracker.started))
        if found:
            pytest.fail(report(found), pytrace=False)


@pytest.fixture
def deployment(pg_factory: Callable[..., PgServer], procs: ProcessTracker, test_dir: Path) -> Deployment:
    """A primary naming the sidecar in synchronous_standby_names, 3 safekeepers and the sidecar, streaming
    (a LocalDeployment whose processes `procs` tracks)."""
    pg = pg_factory(settings={"synchronous_standby_names": APP})
    d = Deployment(pg, procs, test_dir)
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
    return d


@pytest.fixture
def etcd(procs: ProcessTracker, test_dir: Path) -> EtcdServer:
    """A real etcd on 127.0.0.1 (free ports, data under the test's directory), killed by PID at teardown."""
    server = EtcdServer(test_dir / "etcd")
    procs.track(server.child)
    return server.start()

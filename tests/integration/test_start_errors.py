"""`start` against a real primary and safekeepers: what it does with mistakes, and what it says about them."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from support.backends import PgServer
from support.deployment import Deployment
from support.helpers import free_port, wait_for, walsidecar
from support.procs import ManagedProcess, ProcessTracker
from sidecar.processes import read_log

pytestmark = pytest.mark.integration


def _start(d: Deployment, dsn: str, safekeepers: list[str]) -> list[str]:
    return ["start", "--pg-dsn", dsn, "--safekeepers", ",".join(safekeepers), *d.tls("proposer")]


def _run_start(procs: ProcessTracker, d: Deployment, dsn: str, safekeepers: list[str]) -> ManagedProcess:
    return procs.start([sys.executable, "-m", "sidecar", *_start(d, dsn, safekeepers)], name="proposer")


@pytest.fixture
def password_role(pg: PgServer) -> str:
    """A role that must give its password ('good') over TCP."""
    with psycopg.connect(pg.dsn(), autocommit=True) as c:
        c.execute("CREATE ROLE pw LOGIN REPLICATION PASSWORD 'good'")
        hba = Path(c.execute("SHOW hba_file").fetchone()[0])
    hba.write_text("host all pw 127.0.0.1/32 scram-sha-256\nhost replication pw 127.0.0.1/32 scram-sha-256\n"
                   + hba.read_text())
    pg.reload()
    return "pw"


@pytest.mark.parametrize("dsn_args,said", [
    ({"user": "pw", "password": "bad"}, 'password authentication failed for user "pw"'),
    ({"user": "nosuch"}, 'role "nosuch" does not exist'),
    ({"dbname": "nosuch"}, 'database "nosuch" does not exist'),
], ids=["bad password", "no such role", "no such database"])
def test_errors_that_cannot_heal_end_start_with_the_message(pg: PgServer, password_role: str, test_dir: Path,
                                                            procs: ProcessTracker, dsn_args: dict, said: str) -> None:
    d = Deployment(pg, procs, test_dir)
    args = dict(dsn_args)
    dsn = pg.dsn(dbname=args.pop("dbname", "postgres"), user=args.pop("user", "postgres"), **args)
    out = walsidecar(*_start(d, dsn, d.addresses), timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert f"Error: the primary refuses walsidecar: {said}" in text, text
    assert text.count("the primary refuses walsidecar; retrying a few times") == 2, text  # 3 tries in all
    assert "Traceback" not in text


def test_a_primary_stopped_then_started_is_reattached(deployment: Deployment) -> None:
    d = deployment
    d.start_all()
    d.wait_sync()
    d.pg.stop()
    wait_for(lambda: "primary unreachable; retrying" in read_log(d.members["proposer"].log_path), timeout=60,
             what="the proposer to see the primary gone")
    d.pg.start()
    d.wait_sync(timeout=120)
    with d.sql() as c:
        c.execute("CREATE TABLE after_restart ()")  # commits go through the sidecar again
    assert d.members["proposer"].running


@pytest.fixture
def silent() -> Iterator[str]:
    """An address that accepts TCP connections and never says anything."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_a_safekeeper_that_does_not_answer_is_named_with_the_reason(pg_factory, procs: ProcessTracker,
                                                                    test_dir: Path, silent: str) -> None:
    pg: PgServer = pg_factory(settings={"synchronous_standby_names": "walsidecar"})
    d = Deployment(pg, procs, test_dir)
    # A brand-new cluster whose third member never starts: each learns its term from the other alone
    # (with all three as --peers an empty safekeeper waits for both, see test_lost_disk.py).
    d.start_safekeeper(1, "--peers", d.addresses[1])
    d.start_safekeeper(2, "--peers", d.addresses[0])
    refused = f"127.0.0.1:{free_port()}"
    proposer = _run_start(procs, d, pg.dsn(), [*d.addresses[:2], refused])
    log = lambda: read_log(proposer.log_path)  # noqa: E731
    wait_for(lambda: "streaming to 2 of 3 safekeepers" in log(), timeout=120, what="streaming to two")
    text = log()
    # The real safekeepers may be refused too while they start: the line is the typo'd address's.
    line = next(ln for ln in text.splitlines() if "cannot connect to safekeeper" in ln and f"peer={refused}" in ln)
    assert "[warning" in line and "Connection refused" in line, line
    assert "streaming to 2 of 3 safekeepers, quorum 2: can tolerate no failure: one more stops commits" in text
    proposer.terminate()

    proposer = _run_start(procs, d, pg.dsn(), [*d.addresses[:2], silent])
    wait_for(lambda: f"peer={silent}" in log() and "cannot connect to safekeeper" in log(), timeout=120,
             what="the silent safekeeper to be named")
    line = next(ln for ln in log().splitlines() if "cannot connect to safekeeper" in ln and f"peer={silent}" in ln)
    assert "[warning" in line and "timeout: no answer" in line, line
    proposer.terminate()

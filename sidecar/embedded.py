"""`walsidecar up`: a local primary, three safekeepers and the proposer, for trying it out."""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import signal
import socket
import urllib.request
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import IO

from sidecar.config import UP_CONFIG, UP_LOCK, InitPostgresSettings
from sidecar.ctl import ControlSocket, answer
from sidecar.deployment import (
    APP, LOOPBACK_HOST, ChildServer, DeploymentError, LocalDeployment, SafekeeperMember, Standby, free_port,
    start_tied_child,
)
from sidecar.logs import get_logger
from sidecar.ops.initpg import run_init
from sidecar.pgcluster import ClusterError, LocalCluster
from sidecar.supervisor import Supervisor

SAFEKEEPERS = 3
# The proposer's states of a safekeeper that is elected in its term and connected (monitor._state).
BACK = ("catching up", "streaming")


class Embedded:
    """Supervise the embedded default until SIGINT/SIGTERM, then stop everything it started.

    Safekeepers and the proposer that die are restarted with backoff; PostgreSQL exiting ends it. Every
    process it starts is told by the kernel to stop should `up` itself die, even by SIGKILL.
    """

    def __init__(self, base_dir: Path, pg_port: int, sk_port: int, log_format: str = "plain",
                 metrics_port: int = 7610, insecure: bool = False, link_security: str = "tls",
                 standby: bool = False) -> None:
        self.base = base_dir.absolute()
        self.made = _first_missing(self.base)  # before LocalDeployment writes its reader credentials there
        self.insecure = insecure
        self.link_security = link_security
        self.ports = [(pg_port, "PostgreSQL", "--pg-port")]
        self.ports += [(sk_port + i, f"safekeeper{i + 1}", "--safekeeper-port (the first of 3 consecutive ports)")
                       for i in range(SAFEKEEPERS)]
        # Proposer first, then one per safekeeper.
        ports = metrics_ports(metrics_port, SAFEKEEPERS + 1)
        if metrics_port:
            self.ports += [(p, f"metrics of {name}", "--metrics-port (the first of 4 consecutive ports)")
                           for p, name in zip(ports, ["the proposer"] + [f"safekeeper{i}" for i in range(1, 4)])]
        self.metrics = [f"{LOOPBACK_HOST}:{p}" for p in ports]
        if standby:
            self.ports.append((pg_port + 1, "the standby", "--pg-port (the standby takes the next port)"))
        self.log = get_logger(role="up")
        archive = f"file://{self.base}/archive"  # the safekeepers upload to it; the proposer catches up from it
        server = ChildServer(LocalCluster(self.base / "pg", pg_port, log_file=self.base / "postgres.log"))
        self.d = LocalDeployment(
            self.base, safekeepers=SAFEKEEPERS, primary=server, sk_ports=[sk_port + i for i in range(SAFEKEEPERS)],
            insecure=insecure, link_security=link_security, log_format=log_format, log=self.log,
            spawn=start_tied_child, peers=True,  # a wiped safekeeper learns its term before it votes again
            extra={"proposer": ["--metrics", self.metrics[0], "--archive", archive],
                   **{f"safekeeper{i}": ["--metrics", self.metrics[i], "--archive", archive]
                      for i in range(1, SAFEKEEPERS + 1)}})
        self.standby: Standby | None = None
        if standby:
            self.standby = Standby(self.d, ChildServer(LocalCluster(self.base / "standby", pg_port + 1,
                                                                    log_file=self.base / "standby.log")),
                                   archive=archive)
            self.d.add(self.standby)

    def run(self) -> None:
        """Run until SIGINT/SIGTERM; DeploymentError when it cannot start or PostgreSQL exits."""
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)
        lock = self._lock()  # refused: the --dir is another `up`'s, never ours to remove
        try:
            check_free(self.ports)
        except DeploymentError:
            lock.close()
            # Refused before anything started: a --dir this run made would be litter holding only the lock file.
            if self.made is not None:
                shutil.rmtree(self.made, ignore_errors=True)
            raise
        (self.base / "ready").unlink(missing_ok=True)
        stop = _stop_on_signals()
        control = None
        try:
            self._start()
            dsn = self.d.dsn()
            self._install_views(dsn)
            config = self._write_config(dsn)
            supervisor = Supervisor(self.d, self.log, back=self._back)
            control = ControlSocket(self.base)
            (self.base / "ready").write_text(dsn + "\n")
            self._announce(dsn, config)
            while not stop():
                supervisor.tick()
                control.poll(lambda req: answer(supervisor, req), timeout=0.2)
        except ClusterError as e:
            raise DeploymentError(str(e)) from e
        finally:
            if control is not None:
                control.close()
            self.d.stop_all()
            lock.close()

    def _back(self, name: str) -> str | None:
        """A safekeeper is back once the proposer streams to it (None until then); nothing to wait for otherwise."""
        member = self.d.members[name]
        if not isinstance(member, SafekeeperMember) or not self.d.members["proposer"].running:
            return ""
        try:
            # The proposer's metrics are on loopback: plain HTTP (cli._endpoint).
            with urllib.request.urlopen(f"http://{self.metrics[0]}/status", timeout=1) as r:
                doc = json.load(r)
        except (OSError, ValueError):
            return None  # the proposer is starting: ask again
        row = next((r for r in doc.get("safekeepers", []) if r.get("address") == member.address), {})
        return f"the proposer streams to it ({row['state']})" if row.get("state") in BACK else None

    def _lock(self) -> IO[str]:
        """Hold DIR/up.pid locked while running: a second `up` on the same --dir stops here."""
        return _lock_dir(self.base)

    def _start(self) -> None:
        pg = self.d.pg
        if not (pg.data_dir / "PG_VERSION").exists():
            self.log.info("initdb", data_dir=str(pg.data_dir))
            pg.init({"synchronous_standby_names": APP, "max_slot_wal_keep_size": "10GB"})
        self.d.start_all(timeout=120)

    def _install_views(self, dsn: str) -> None:
        """What `walsidecar init-postgres` installs (sql/install.sql): the walsidecar.* views among it."""
        out = io.StringIO()
        with redirect_stdout(out), redirect_stderr(out):
            failed = run_init(InitPostgresSettings(pg_dsn=dsn, application_name=APP, role="", sync="on"))
        if failed:
            raise DeploymentError(f"installing sql/install.sql failed:\n{out.getvalue().strip()}")
        self.log.info("installed sql/install.sql", schema="walsidecar")

    def _announce(self, dsn: str, config: Path) -> None:
        """The banner: on the terminal (stdout), whatever the log format, and in the log."""
        ctl = f"walsidecar ctl --dir {self.base}"
        print(f"\nwalsidecar is up: commits on this primary wait for {SAFEKEEPERS // 2 + 1} of "
              f"{SAFEKEEPERS} safekeepers.\n  psql \"{dsn}\"   (views: SELECT * FROM walsidecar.status;)\n"
              f"  logs: {self.base}/*.log\n"
              f"  status:  walsidecar status --config {config}   (add --watch 2 to follow it)\n"
              f"  check:   walsidecar check --config {config}\n"
              f"  ctl:     {ctl} members | stop safekeeper2 | start safekeeper2 | restart proposer\n"
              f"  metrics: http://{self.metrics[0]}/metrics (proposer), "
              + ", ".join(f"http://{m}/metrics" for m in self.metrics[1:]) + " (safekeepers)\n"
              + ("  INSECURE: --insecure, the safekeeper links run without TLS\n" if self.insecure else
                 f"  {'auth-only (no encryption)' if self.link_security != 'tls' else 'TLS'}: CA in "
                 f"{self.base}/ca, a certificate per process in {self.base}/certs\n")
              + (f"  standby: psql \"{self.standby.server.dsn()}\" streams from safekeeper1's reader port (slot "
                 f"{self.standby.slot!r}; what it lacks, restore-wal gets from the safekeepers and the archive); when the "
                 f"primary dies: walsidecar failover --config {config}\n" if self.standby is not None else "")
              + "A safekeeper or the proposer that dies is restarted (with backoff); PostgreSQL exiting stops "
                "everything" + (" unless the standby can take over" if self.standby is not None else "")
              + ".\nPress Ctrl-C to stop.\n", flush=True)
        self.log.info("walsidecar is up", psql=dsn, status=f"walsidecar status --config {config}",
                      check=f"walsidecar check --config {config}", ctl=f"{ctl} members", metrics=self.metrics[0])

    def _write_config(self, dsn: str) -> Path:
        """A --config file for `walsidecar status` and `walsidecar check` against this cluster."""
        path = self.base / UP_CONFIG
        path.write_text(
            "# Written by `walsidecar up`: walsidecar status --config THIS_FILE\n"
            f"pg_dsn = {_toml_str(dsn)}\n"
            f"safekeepers = {_toml_str(','.join(self.d.addresses))}\n"
            f"application_name = {_toml_str(APP)}\n"
            f"proposer_metrics = {_toml_str(self.metrics[0])}\n"
            + ("insecure = true\n" if self.insecure else
               f"certs_dir = {_toml_str(str(self.d.certs_dir('client', 'client')))}\n")
            + ("" if self.link_security == "tls" else f"link_security = {_toml_str(self.link_security)}\n")
            + ("" if self.standby is None else self._failover_config()))
        return path


    def _failover_config(self) -> str:
        """The standby (status shows it, failover promotes it); failover talks to the safekeepers as a proposer."""
        assert self.standby is not None and self.d.reader_passfile is not None
        certs = "" if self.insecure else \
            f"certs_dir = {_toml_str(str(self.d.certs_dir('failover', 'proposer')))}\n"
        return (f"standby_dsn = {_toml_str(self.standby.server.dsn())}\n"
                "\n[failover]\n"
                f"reader_passfile = {_toml_str(str(self.d.reader_passfile))}\n" + certs)


def _lock_dir(base: Path) -> IO[str]:
    """Hold DIR/up.pid locked while `up` (or `up --ha`) runs: a second `up` on the same --dir stops here."""
    f = open(base / UP_LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise DeploymentError(f"another `walsidecar up` (pid {pid}) is running in {base}: stop it with Ctrl-C, "
                              f"use it (`walsidecar ctl --dir {base} members`), or give another --dir") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of `path` that does not exist yet (what mkdir(parents=True) makes); None if it does."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def metrics_ports(first: int, n: int) -> list[int]:
    """`n` consecutive ports from `first`, or `n` free ones (distinct) when `first` is 0."""
    if first:
        return [first + i for i in range(n)]
    return [free_port() for _ in range(n)]


def check_free(ports: list[tuple[int, str, str]]) -> None:
    """DeploymentError naming the first (port, what, option) someone else listens on, before anything starts."""
    for port, what, option in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
            try:
                s.bind((LOOPBACK_HOST, port))
            except OSError as e:
                raise DeploymentError(f"port {port} ({what}) on {LOOPBACK_HOST} is in use ({e.strerror}): is another "
                                      f"`walsidecar up` or server running? Choose another with {option}") from None


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _stop_on_signals():
    stopped = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return lambda: stopped

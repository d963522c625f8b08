"""A local deployment: a PostgreSQL primary, N safekeepers and the proposer, each a member known by name.

`walsidecar up`, the integration tests, scripts/chaos.py and scripts/bench.py build on it. Members are
`primary`, `safekeeper1`..`safekeeperN` and `proposer`; each can be started, stopped, killed (kill -9; an
immediate stop for the primary) and restarted on its own, and has a log file and a data directory.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import psycopg

from sidecar.address import Address
from sidecar.certs import ensure_node
from sidecar.durable import write_durably
from sidecar.pgcluster import LocalCluster
from sidecar.processes import Child, read_log, sidecar_argv, tail, tls_args, walsidecar_argv

APP = "walsidecar"
LOOPBACK_HOST = "127.0.0.1"
READER_USER = "walsidecar"  # the reader every deployment's safekeepers know (readers.auth, readers.pgpass)


class DeploymentError(RuntimeError):
    """The deployment did not come up as asked; the message says what and which log to read."""


class MemberExited(DeploymentError):
    """A member that should run has exited."""

    def __init__(self, member: ProcessMember) -> None:
        self.name, self.returncode, self.log_path = member.name, member.returncode, member.log_path
        # The log's last lines travel with the error: the directory holding the log may be gone
        # by the time anyone reads it (a test's, a CI run's).
        last = tail(read_log(self.log_path), 15)
        super().__init__(f"{self.name} exited with code {self.returncode}; see {self.log_path}"
                         + (f"; it ended with:\n{last}" if last else ""))


_handed_out: set[int] = set()


def free_port(host: str = LOOPBACK_HOST, taken: set[int] | None = None) -> int:
    """A TCP port on `host` that was free a moment ago, not in `taken` (to which it is added).

    Below the kernel's ephemeral range, so that no outgoing connection takes it before (or while,
    after a restart) the process meant to listen on it binds it. Without `taken`, a port this process
    handed out before is not handed out again (until most of the range has been).
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - 12000)
    if taken is None:
        taken = _handed_out
        if len(taken) > (low - first) * 3 // 4:
            taken.clear()
    rnd = random.SystemRandom()
    for _ in range(500):
        port = rnd.randrange(first, low)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise DeploymentError(f"no free TCP port on {host} below {low}")


class Place(Protocol):
    """Where a member runs: the address it listens on, and how its command line is run there."""

    address: str

    def argv(self, argv: Sequence[str]) -> list[str]: ...


class Loopback:
    """This host's 127.0.0.1: the command line runs as it is."""

    address = LOOPBACK_HOST

    def argv(self, argv: Sequence[str]) -> list[str]:
        return list(argv)


class Certificates(Protocol):
    """Where a walsidecar process's certificates directory comes from."""

    def certs(self, name: str, role: str, node_id: int | None, hosts: tuple[str, ...]) -> Path: ...


class OwnCA:
    """A CA under BASE/ca (made once, reused) and a certificates directory per process under BASE/certs/NAME."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def certs(self, name: str, role: str, node_id: int | None = None, hosts: tuple[str, ...] = ()) -> Path:
        return ensure_node(self.base / "ca", self.base / "certs" / name, role, node_id, hosts=hosts)


@runtime_checkable
class PgServer(Protocol):
    """The primary's server as the deployment drives it (a LocalCluster, or a test backend's server)."""

    port: int

    @property
    def data_dir(self) -> Path: ...

    def start(self, timeout: float = 60) -> None: ...

    def stop(self, mode: str = "fast", timeout: float = 60) -> None: ...

    def crash(self) -> None: ...

    def is_running(self) -> bool: ...

    def teardown(self) -> None: ...

    def dsn(self, dbname: str = "postgres", user: str = "postgres", **params: str) -> str: ...


Spawn = Callable[[str, Sequence[str], Path], Child]


def start_child(name: str, argv: Sequence[str], log_path: Path) -> Child:
    """The default way to start a member's process: a Child appending to the member's log."""
    return Child(name, argv, log_path).start()


def start_tied_child(name: str, argv: Sequence[str], log_path: Path) -> Child:
    """A member's process that gets SIGTERM (a clean stop) when this process dies, even by SIGKILL."""
    return Child(name, argv, log_path, parent_death_signal=signal.SIGTERM).start()


class ChildServer:
    """A LocalCluster whose postmaster is our child (not daemonised by pg_ctl): it stops when we die.

    The kernel sends it SIGQUIT (an immediate stop: crash recovery at the next start) when this process
    dies, even by SIGKILL; whether it runs is a poll of our child, not a pg_ctl call.
    """

    STOP_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.port = cluster.port
        self.child: Child | None = None

    def __getattr__(self, name: str) -> Any:  # data_dir, log_file, dsn(), init(), pg_wal_dir, ...
        if name == "cluster":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.cluster, name)

    @property
    def data_dir(self) -> Path:
        return self.cluster.data_dir

    def start(self, timeout: float = 60) -> None:
        """Start the postmaster and wait until it accepts connections."""
        c = self.cluster
        kwargs = c.spawn_kwargs()
        self.child = Child("postgres", [str(c.bin_dir / "postgres"), "-D", str(c.data_dir), "-p", str(self.port)],
                           c.log_file, parent_death_signal=signal.SIGQUIT, **kwargs).start()
        deadline = time.monotonic() + timeout
        while True:
            if not self.child.running:
                raise DeploymentError(f"PostgreSQL exited with code {self.child.returncode} while starting; the "
                                      f"end of {c.log_file}:\n{tail(read_log(c.log_file), 15)}")
            try:
                psycopg.connect(c.dsn(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    self.stop("immediate")
                    raise DeploymentError(f"PostgreSQL did not accept connections within {timeout:.0f}s; see "
                                          f"{c.log_file}") from None
            time.sleep(0.1)

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        """`mode` as pg_ctl's; an immediate stop after `timeout` (SIGKILL would leave the backends running)."""
        if self.child is None or not self.child.running:
            return
        self.child.send_signal(self.STOP_SIGNALS[mode])
        try:
            self.child.wait(timeout)
        except subprocess.TimeoutExpired:
            self.child.stop(timeout, sig=signal.SIGQUIT)

    def crash(self) -> None:
        self.stop("immediate")

    def is_running(self) -> bool:
        return self.child is not None and self.child.running

    def teardown(self) -> None:
        self.stop("fast", timeout=30)


class Member:
    """One named part of a deployment.

    To add a kind of member (a standby, a reader, etcd, an S3 server): subclass ProcessMember (or
    SidecarMember for a `walsidecar` subcommand) with its `argv()` (and `standby` if it streams from the
    primary as a synchronous standby), then `LocalDeployment.add()` an instance, or make one in
    LocalDeployment.__init__ if every deployment has it. Start, stop, kill, restart, the liveness check,
    the log, the data directory and the order of stopping come with it. To run the same members
    elsewhere (in containers), subclass them overriding start, stop, kill, close, running and the paths,
    and give LocalDeployment those kinds (`safekeeper_kind`, `proposer_kind`).
    """

    name: str
    standby: str | None = None  # application_name it streams from the primary as, if it does
    takes_over: bool = False  # can become the primary (walsidecar failover) when the primary dies

    def start(self, *extra: str) -> Any: ...

    def stop(self, timeout: float = 15) -> None: ...

    def kill(self) -> None: ...

    def close(self) -> None:
        """Stop by any means, for cleanup."""
        self.stop()

    def restart(self) -> Any:
        self.stop()
        return self.start()

    def streaming_problem(self) -> str | None:
        """Why this running member does not get the WAL it should (None: it does, or it gets none)."""
        return None

    @property
    def running(self) -> bool:
        raise NotImplementedError

    @property
    def data_dir(self) -> Path:
        raise NotImplementedError

    @property
    def log_path(self) -> Path | None:
        raise NotImplementedError

    @property
    def process(self) -> Child | None:
        """The process started last, if this member is one this deployment started itself."""
        return None


class Primary(Member):
    """The PostgreSQL primary: kill is an immediate stop (no shutdown checkpoint, crash recovery next)."""

    def __init__(self, server: PgServer) -> None:
        self.name = "primary"
        self.server = server

    def start(self, *extra: str) -> None:
        if not self.server.is_running():
            self.server.start()

    def stop(self, timeout: float = 60) -> None:
        self.server.stop("fast", timeout=timeout)

    def kill(self) -> None:
        self.server.crash()

    def close(self) -> None:
        self.server.teardown()

    @property
    def running(self) -> bool:
        return self.server.is_running()

    @property
    def data_dir(self) -> Path:
        return self.server.data_dir

    @property
    def log_path(self) -> Path | None:
        return getattr(self.server, "log_file", None)

    @property
    def process(self) -> Child | None:
        """The postmaster when the server runs it as this deployment's child (ChildServer), else None."""
        return getattr(self.server, "child", None)


# A PostgreSQL log line saying why WAL does not come, and the ones that say nothing about it.
_CAUSE = re.compile(r"FATAL|ERROR")
_NOISE = re.compile(r"the database system is (starting up|not yet accepting connections|shutting down)"
                    r"|terminating walreceiver process due to administrator command")


def last_cause(log: Path | None, tail_bytes: int = 65536) -> str | None:
    """The last error line of a PostgreSQL log (its end only), without its timestamp and pid."""
    if log is None:
        return None
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if _CAUSE.search(line) and not _NOISE.search(line):
            return re.sub(r"^\S+ \S+ \S+ \[\d+\]\s*", "", line).strip()
    return None


SLOT_TIMEOUT = 60.0  # seconds for the safekeepers' reader ports to answer when a standby is made


class Standby(Primary):
    """A local PostgreSQL standby fed by the safekeepers, not by the primary.

    It replays only what a quorum committed, so `walsidecar failover` can promote it without loss; it is not
    a synchronous standby of the primary (commits never wait for it). Its first start takes a base backup
    of the primary and writes the two ways a PostgreSQL standby gets WAL, as from a primary and its archive:
    streaming from `source`'s reader port with a reader slot there, so that safekeeper removes nothing the
    standby has not received; and `restore_command = 'walsidecar restore-wal ...'` for what the slot does not
    hold (`source` down or its disk lost): every safekeeper's reader port, then the archive. A slot moves
    only on the safekeeper streamed from, so the standby has one slot, where it streams: a slot elsewhere
    would hold that safekeeper's WAL for ever.
    """

    takes_over = True

    def __init__(self, d: LocalDeployment, server: PgServer, name: str = "standby", source: str = "safekeeper1",
                 archive: str | None = None) -> None:
        super().__init__(server)
        self.d, self.name, self.source, self.archive = d, name, source, archive

    @property
    def slot(self) -> str:
        """Its reader slot on `source` (primary_slot_name)."""
        return self.name

    def start(self, *extra: str) -> None:
        if not (self.data_dir / "PG_VERSION").exists():
            self.prepare()
        super().start()

    def streaming_problem(self) -> str | None:
        """None while it streams from a reader port (or is a primary now); else the cause, from its log."""
        try:
            with psycopg.connect(self.server.dsn(), autocommit=True, connect_timeout=2) as c:
                row = c.execute("SELECT pg_is_in_recovery(), (SELECT status FROM pg_stat_wal_receiver), "
                                "coalesce(pg_last_wal_replay_lsn(), '0/0')::text").fetchone()
        except psycopg.Error as e:
            return f"cannot be asked: {' '.join(str(e).split())}"
        in_recovery, receiver, replayed = row
        if not in_recovery or receiver == "streaming":
            return None
        cause = last_cause(self.log_path)
        return (f"not streaming (WAL receiver {receiver or 'not running'}), replayed up to {replayed}"
                + (f"; its log: {cause}" if cause else ""))

    def prepare(self) -> None:
        """A reader slot, pg_basebackup of the primary, then standby.signal, primary_conninfo and restore_command."""
        from sidecar.config import ReaderCredentials
        from sidecar.walclient import reader_conninfo
        source = self.d.members[self.source]
        if not isinstance(source, SafekeeperMember) or source.reader_address is None or self.d.reader_passfile is None:
            raise DeploymentError(f"the standby streams from {self.source}'s reader port: make the deployment "
                                  "with readers")
        readers = self.d.reader_addresses
        # Before the base backup: a slot reserves from the commit position it is made at, which is below
        # the backup's start, so the source keeps all the WAL the standby will ask for.
        self._make_slot(source.reader_address)
        cluster = getattr(self.server, "cluster", self.server)
        cluster._prepare_dirs()
        cluster.run_bin("pg_basebackup", "-D", str(self.data_dir), "-d", self.d.dsn(), "-X", "stream", "-c", "fast",
                        timeout=300)
        # The server runs as its own OS user: it gets copies of the CA certificate and the password file.
        certs = self.data_dir / "walsidecar-reader"
        shutil.rmtree(certs, ignore_errors=True)  # a base backup of a promoted standby has its copies
        certs.mkdir(mode=0o700)
        passfile = certs / "reader.pgpass"
        passfile.write_bytes(self.d.reader_passfile.read_bytes())
        os.chmod(passfile, 0o600)
        ca = self.d.certs_dir(self.name, "client")
        if ca is not None:
            (certs / "ca.crt").write_bytes((ca / "ca.crt").read_bytes())
        for path in (certs, passfile, *certs.iterdir()):
            cluster._chown(path)
        creds = ReaderCredentials(reader_user=READER_USER, reader_passfile=passfile,
                                  certs_dir=certs if ca is not None else None, insecure=ca is None)
        conninfo = reader_conninfo(source.reader_address, creds, application_name=self.name)
        restore = walsidecar_argv("restore-wal", "%f", "%p", "--safekeeper-readers", ",".join(map(str, readers)),
                                  "--reader-passfile", str(passfile), "--log-format", "json",
                                  *tls_args(certs if ca is not None else None),
                                  *(["--archive", self.archive] if self.archive else []))
        cluster.set({"port": str(self.server.port), "hot_standby": "on", "primary_conninfo": conninfo,
                     "primary_slot_name": self.slot, "restore_command": shlex.join(restore)})
        signal_file = self.data_dir / "standby.signal"
        signal_file.touch()
        cluster._chown(signal_file)
        self.d.note("standby prepared", standby=self.name, source=str(source.reader_address), slot=self.slot)

    def _make_slot(self, address: Address) -> None:
        """A reader slot holding WAL from now on the source; one left by an earlier standby is made anew."""
        from sidecar.config import ReaderCredentials
        from sidecar.walclient import ReaderError, ReaderUnreachable, WalReader
        ca = self.d.certs_dir(self.name, "client")
        creds = ReaderCredentials(reader_user=READER_USER, reader_passfile=self.d.reader_passfile,
                                  certs_dir=ca, insecure=ca is None)
        deadline = time.monotonic() + SLOT_TIMEOUT
        while True:
            try:
                with WalReader(address, creds, application_name=self.name) as r:
                    if r.read_slot(self.slot) is not None:
                        r.drop_slot(self.slot)
                    r.create_slot(self.slot, reserve_wal=True)
                return
            except ReaderUnreachable as e:
                if time.monotonic() > deadline:  # a safekeeper just started may not listen yet
                    raise DeploymentError(f"cannot make the standby's reader slot {self.slot!r} on {address} "
                                          f"within {SLOT_TIMEOUT:g}s: {e.message}") from None
                time.sleep(0.1)
            except ReaderError as e:
                raise DeploymentError(f"cannot make the standby's reader slot {self.slot!r} on {address}: "
                                      f"{e.message}") from None


class ProcessMember(Member):
    """A member that is one process at a time, started through the deployment's `spawn`."""

    role = "client"  # the certificate it gets, if it is a walsidecar process

    def __init__(self, d: LocalDeployment, name: str, *, node_id: int | None = None, port: int | None = None,
                 place: Place | None = None) -> None:
        self.d = d
        self.name = name
        self.node_id = node_id
        self.port = port
        self.place: Place = place or Loopback()
        self.children: list[Child] = []  # every process started, so that cleanup stops them all
        self.wanted = False  # started and not stopped on purpose since
        self._extra: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """The command line (before the place's wrapper and the extra arguments)."""
        raise NotImplementedError

    @property
    def address(self) -> str:
        return f"{self.place.address}:{self.port}"

    @property
    def child(self) -> Child | None:
        """The process started last."""
        return self.children[-1] if self.children else None

    @property
    def process(self) -> Child | None:
        return self.child

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.running

    @property
    def returncode(self) -> int | None:
        return self.child.returncode if self.child is not None else None

    @property
    def data_dir(self) -> Path:
        return self.d.base / self.name

    @property
    def log_path(self) -> Path:
        return self.child.log_path if self.child is not None else self.d.base / f"{self.name}.log"

    def start(self, *extra: str) -> Child:
        """Start a new process for this member (with `extra` arguments this time) and return it."""
        self._extra = extra
        argv = self.place.argv([*self.argv(), *self.d.extra.get(self.name, ()), *extra])
        child = self.d.spawn(self.name, argv, self.d.base / f"{self.name}.log")
        self.children.append(child)
        self.wanted = True
        self.d.note("started", process=self.name, pid=child.pid)
        return child

    def restart(self) -> Child:
        self.stop()
        return self.start(*self._extra)

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM each process of this member still running, SIGKILL after `timeout` seconds."""
        self.wanted = False
        for child in self.children:
            if child.running:
                child.stop(timeout=timeout)
                self.d.note("stopped", process=self.name, pid=child.pid)

    def kill(self) -> None:
        """kill -9 (and reap) each process of this member still running."""
        self.wanted = False
        for child in self.children:
            child.kill()

    def check(self) -> None:
        """Raise MemberExited if this member should run and does not."""
        if self.exited:
            raise MemberExited(self)

    @property
    def exited(self) -> bool:
        """True when this member should run and does not."""
        return self.wanted and not self.running


class SidecarMember(ProcessMember):
    """A `walsidecar` subcommand, with this deployment's certificates and link security."""

    def args(self) -> list[str]:
        raise NotImplementedError

    def argv(self) -> list[str]:
        hosts = () if self.place.address == LOOPBACK_HOST else ("localhost", self.place.address)
        return sidecar_argv(*self.args(), *self.d.link_args(self.name, self.role, self.node_id, hosts),
                            log_format=self.d.log_format)


class SafekeeperMember(SidecarMember):
    """A safekeeper; with the deployment's readers, also a reader port (`reader_address`) using its auth file."""

    role = "safekeeper"

    def __init__(self, d: LocalDeployment, name: str, **kwargs: Any) -> None:
        super().__init__(d, name, **kwargs)
        self.reader_port = d.pick_port() if d.reader_auth is not None else None
        # One of the safekeepers the cluster is made with (created at its first start); one added later
        # joins an existing cluster as a lost disk does: empty, learning its term from its peers.
        self.founding = False

    @property
    def reader_address(self) -> Address | None:
        """HOST:PORT of its reader port (--pg-listen), None when the deployment has no readers."""
        return Address(self.place.address, self.reader_port) if self.reader_port is not None else None

    @property
    def created_marker(self) -> Path:
        """Beside the data directory, not in it: says the safekeeper was created, so that a wiped directory
        is known for a lost disk and never created again."""
        return self.d.base / f"{self.name}.created"

    def start(self, *extra: str) -> Child:
        self.create_once()
        return super().start(*extra)

    def term_known(self) -> bool:
        """Whether it has a control file: a founding one from its creation, an empty one (a lost disk) once it
        learned its term from its peers (safekeeper/amnesia.py)."""
        from sidecar.safekeeper.control import control_path
        return control_path(self.data_dir).exists()

    def create_once(self) -> None:
        """`walsidecar safekeeper-init` of a founding safekeeper, the first time it starts in this deployment."""
        from sidecar.safekeeper.control import control_path
        from sidecar.safekeeper.create import create_data_dir
        if not self.founding or self.created_marker.exists():
            return
        if not control_path(self.data_dir).exists():  # made before the marker was (an older walsidecar): keep it
            assert self.node_id is not None
            create_data_dir(self.node_id, self.data_dir, len(self.d.addresses))
        write_durably(self.created_marker, b"")
        self.d.note("created", process=self.name, members=len(self.d.addresses))

    def args(self) -> list[str]:
        readers = [] if self.reader_port is None or self.d.reader_auth is None else \
            ["--pg-listen", str(self.reader_address), "--pg-auth-file", str(self.d.reader_auth)]
        # Its peers: an empty data directory (a lost disk) learns its term from them before it votes.
        # On loopback only: safekeepers placed in network namespaces need not reach one another.
        peers = [a for a in self.d.addresses if a != self.address] \
            if self.d.peers and self.place.address == LOOPBACK_HOST else []
        return ["safekeeper", "--id", str(self.node_id), "--listen", self.address, "--data-dir", str(self.data_dir),
                *readers, *(["--peers", ",".join(peers)] if peers else [])]


class ProposerMember(SidecarMember):
    role = "proposer"

    @property
    def standby(self) -> str:  # type: ignore[override]
        return self.d.application_name

    def args(self) -> list[str]:
        return ["start", "--pg-dsn", self.d.pg.dsn(), "--safekeepers", ",".join(self.d.addresses),
                "--application-name", self.d.application_name]


def make_reader_credentials(base: Path) -> tuple[Path, Path]:
    """BASE/readers.auth (READER_USER's verifier) and BASE/readers.pgpass (its password), made once."""
    from sidecar.readerauth import add
    auth, passfile = base / "readers.auth", base / "readers.pgpass"
    if not (auth.exists() and passfile.exists()):
        base.mkdir(parents=True, exist_ok=True)
        password = secrets.token_urlsafe(24)  # nothing a passfile would need to escape
        add(auth, READER_USER, password)
        fd = os.open(passfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"*:*:*:{READER_USER}:{password}\n")
    return auth, passfile


class LocalDeployment:
    """A primary, `safekeepers` safekeepers and the proposer on this machine, under `base`.

    `primary` is a server made elsewhere (initialised or not); by default a LocalCluster in BASE/pg.
    Certificates come from `certificates` (default: a CA of its own under BASE), or none when `insecure`.
    `places` puts members elsewhere (a network namespace: its address and command wrapper), `extra` adds
    arguments to a member's every start, `spawn` starts each process (tests track them with it), `log`
    (a structlog logger) is told of each start and stop. `safekeeper_kind` and `proposer_kind` make those
    members (called as the default SafekeeperMember and ProposerMember are). With `readers` every safekeeper serves
    readers on a port of its own, user READER_USER with the password in `reader_passfile` (a libpq passfile).
    As a context manager it stops all it started.
    """

    def __init__(self, base: Path, *, safekeepers: int = 3, proposer: bool = True, primary: PgServer | None = None,
                 pg_port: int | None = None, sk_ports: Sequence[int] | None = None, insecure: bool = False,
                 link_security: str = "tls", certificates: Certificates | None = None,
                 application_name: str = APP, log_format: str = "plain", places: Mapping[str, Place] | None = None,
                 extra: Mapping[str, Sequence[str]] | None = None, spawn: Spawn = start_child,
                 pick_port: Callable[[], int] = free_port, log: Any = None,
                 safekeeper_kind: Callable[..., Member] = SafekeeperMember,
                 proposer_kind: Callable[..., Member] = ProposerMember, readers: bool = True, peers: bool = True) -> None:
        self.base = Path(base).absolute()
        self.peers = peers  # each safekeeper gets the others as --peers (an empty one learns its term first)
        self.pick_port = pick_port
        self.reader_auth: Path | None = None  # the safekeepers' --pg-auth-file
        self.reader_passfile: Path | None = None  # READER_USER's password, for libpq clients
        if readers:
            self.reader_auth, self.reader_passfile = make_reader_credentials(self.base)
        self.insecure = insecure
        self.link_security = link_security
        self.certificates = certificates or OwnCA(self.base)
        self.application_name = application_name
        self.log_format = log_format
        self.extra = {k: list(v) for k, v in (extra or {}).items()}
        self.spawn = spawn
        self._log = log
        places = places or {}
        server = primary if primary is not None else LocalCluster(
            self.base / "pg", pg_port if pg_port is not None else pick_port(), log_file=self.base / "postgres.log")
        self.members: dict[str, Member] = {}
        self.add(Primary(server))
        for i in range(1, safekeepers + 1):
            name = f"safekeeper{i}"
            member = self.add(safekeeper_kind(self, name, node_id=i, place=places.get(name),
                                              port=sk_ports[i - 1] if sk_ports is not None else pick_port()))
            if isinstance(member, SafekeeperMember):
                member.founding = True
        if proposer and safekeepers:
            self.add(proposer_kind(self, "proposer"))

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def add(self, member: Member) -> Member:
        """Make `member` part of the deployment (started by start_all after those added before it)."""
        self.members[member.name] = member
        return member

    def __getitem__(self, name: str) -> Member:
        return self.members[name]

    def note(self, event: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.info(event, **fields)

    # ---- what is where

    @property
    def pg(self) -> Any:
        """The primary's server (its dsn(), data_dir, pg_wal_dir, ...)."""
        return self._primary.server

    @property
    def _primary(self) -> Primary:
        member = self.members["primary"]
        assert isinstance(member, Primary)
        return member

    def _processes(self) -> list[ProcessMember]:
        return [m for m in self.members.values() if isinstance(m, ProcessMember)]

    def _safekeepers(self) -> list[SafekeeperMember]:
        return [m for m in self.members.values() if isinstance(m, SafekeeperMember)]

    @property
    def addresses(self) -> list[str]:
        """HOST:PORT of each safekeeper, in order."""
        return [m.address for m in self._safekeepers()]

    @property
    def reader_addresses(self) -> list[Address]:
        """The reader port of each safekeeper that has one, in order."""
        return [m.reader_address for m in self._safekeepers() if m.reader_address is not None]

    @property
    def safekeepers(self) -> dict[int, Child]:
        """The process started last of each safekeeper that has been started, by node id."""
        return {m.node_id: m.child for m in self._safekeepers() if m.child is not None}  # type: ignore[misc]

    @property
    def proposer(self) -> Child | None:
        """The proposer's process started last."""
        member = self.members.get("proposer")
        return member.process if member is not None else None

    def process(self, name: str) -> Child | None:
        """Member `name`'s process started last (None before its first start, or a primary run elsewhere)."""
        return self.members[name].process

    def data_dir(self, name: str) -> Path:
        return self.members[name].data_dir

    def log_path(self, name: str) -> Path | None:
        return self.members[name].log_path

    def dsn(self) -> str:
        return str(self.pg.dsn())

    def sql(self, connect_timeout: int = 10) -> psycopg.Connection:
        """An autocommit connection to the primary."""
        return psycopg.connect(self.dsn(), autocommit=True, connect_timeout=connect_timeout)

    def certs_dir(self, name: str, role: str, node_id: int | None = None, hosts: tuple[str, ...] = ()) -> Path | None:
        """The certificates directory of process `name` (None when insecure)."""
        return None if self.insecure else self.certificates.certs(name, role, node_id, hosts)

    def link_args(self, name: str, role: str, node_id: int | None = None, hosts: tuple[str, ...] = ()) -> list[str]:
        """How a walsidecar process of this deployment secures its links: certificates and link security."""
        auth_only = [] if self.link_security == "tls" else ["--link-security", self.link_security]
        return tls_args(self.certs_dir(name, role, node_id, hosts)) + auth_only

    # ---- one member

    def start(self, name: str, *extra: str) -> Any:
        """Start member `name` (with `extra` arguments this time); returns its new process, if it is one."""
        return self.members[name].start(*extra)

    def stop(self, name: str, timeout: float = 15) -> None:
        self.members[name].stop(timeout)

    def kill(self, name: str) -> None:
        """kill -9 of member `name` (for the primary: an immediate stop)."""
        self.members[name].kill()

    def restart(self, name: str) -> Any:
        return self.members[name].restart()

    # ---- all of them

    def start_all(self, wait: bool = True, timeout: float = 60) -> None:
        """Start every member not running yet, in the order added, then wait until streaming."""
        for member in self.members.values():
            if not member.running:
                if isinstance(member, ProposerMember) and self.peers:
                    self._wait_terms_learned(timeout)
                member.start()
        if wait:
            self.wait_streaming(timeout)

    def _wait_terms_learned(self, timeout: float) -> None:
        """Until every running safekeeper knows its term (`SafekeeperMember.term_known`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(m.term_known() for m in self._safekeepers() if m.running):
            time.sleep(0.05)

    def stop_all(self) -> None:
        """Stop everything this deployment started, by PID: the primary first, as its shutdown checkpoint
        waits for the sidecar while the quorum is up, then the processes, last started first."""
        self._primary.close()
        for member in self.members.values():
            if isinstance(member, Standby):
                member.close()
        for member in reversed(self._processes()):
            member.close()

    def check_running(self) -> None:
        """Raise MemberExited for the first process member that should run and has exited."""
        for member in self._processes():
            member.check()

    def replication_rows(self) -> dict[str, tuple[Any, ...]]:
        """application_name -> (state, sync_state, flush_lsn, replay_lsn) of pg_stat_replication."""
        with self.sql() as c:
            rows = c.execute("SELECT application_name, state, sync_state, flush_lsn::text, replay_lsn::text "
                             "FROM pg_stat_replication").fetchall()
        return {r[0]: tuple(r[1:]) for r in rows}

    def replication_row(self, name: str | None = None) -> tuple[Any, ...] | None:
        """(application_name, state, sync_state, flush_lsn, replay_lsn) of standby `name` (default: the
        proposer's application name), or None when it does not stream."""
        name = name or self.application_name
        row = self.replication_rows().get(name)
        return (name, *row) if row is not None else None

    def streaming(self) -> bool:
        """True when every standby member streams as a synchronous standby of the primary."""
        names = {m.standby for m in self.members.values() if m.standby}
        try:
            rows = self.replication_rows() if names else {}
        except psycopg.OperationalError:
            return False
        return all(n in rows and rows[n][0] == "streaming" and rows[n][1] in ("sync", "quorum") for n in names)

    def wait_streaming(self, timeout: float = 60, check: bool = True) -> None:
        """Wait until streaming(); with `check`, fail at once when a member that should run exits."""
        deadline = time.monotonic() + timeout
        while True:
            if check:
                self.check_running()
            if self.streaming():
                return
            if time.monotonic() > deadline:
                waiting = [m for m in self.members.values() if m.standby]
                raise DeploymentError(
                    f"the {', '.join(m.name for m in waiting)} did not become the synchronous standby within "
                    f"{timeout:.0f}s; see " + ", ".join(str(m.log_path) for m in waiting))
            time.sleep(0.05)

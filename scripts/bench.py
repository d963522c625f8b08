#!/usr/bin/env python3
"""Benchmark walsidecar against PostgreSQL's own ways of keeping remote WAL copies.

Every configuration runs on this machine, on 127.0.0.1, each with its own directories on
the same disk and fsync on everywhere:

* async          no synchronous standby (the upper bound)
* receivewal-1   one `pg_receivewal --synchronous` as the synchronous standby
* native-quorum  three `pg_receivewal --synchronous`, `ANY 2 (r1, r2, r3)`
* native-quorum-tls  the same with TLS on the three replication connections (the primary with ssl=on and the
                 deployment's certificate, pg_receivewal with sslmode=require; pgbench's own connections
                 stay plain): native quorum commit paying for TLS as walsidecar's links do (run only when
                 --only names it)
* walsidecar     three safekeepers, quorum 2, mutually authenticated TLS on every link
* walsidecar-auth      the same with --link-security auth-only: certificates checked at connection start, no encryption
* walsidecar-insecure  the same with --insecure: no TLS (walsidecar ÷ walsidecar-insecure is TLS's cost)
* walsidecar-python    walsidecar with the safekeepers' Python stream loop (WALSIDECAR_IMPL=python) where
                       walsidecar runs the compiled one (WALSIDECAR_IMPL=compiled): walsidecar ÷
                       walsidecar-python is what the compiled loop gains (run only when --only names it)
* walsidecar-floor     the sidecar with --insecure against three scripts/floor_safekeeper.c: the floor, what
                       it achieves when a safekeeper costs nothing but recv/pwrite/fdatasync/send (a
                       measurement stand-in compiled into the scratch directory; run only when --only
                       names it; no catch-up workload)
* walsidecar-floor-all the same with scripts/floor_proposer.c in the sidecar's place too: both stand-ins, what
                       a commit costs when the proposer's pump costs nothing but its system calls (plain
                       TCP; run only when --only names it; no catch-up workload)
* walsidecar-floor-all-tls  both stand-ins over TLS 1.3 with the deployment's certificates (OpenSSL from C,
                       scripts/floor_wire.h): the floor of walsidecar's own configuration

Rounds are interleaved (A B C D, A B C D, ...); each configuration starts from a fresh copy
of a template cluster (one per pgbench scale, each built once per run). Workloads:

* pgbench-1             pgbench TPC-B, 1 client: latency, CPU per transaction (= per commit round trip)
* pgbench-1-reader-flood  pgbench-1 while scripts/bench_reader_flood.py, a process of its own (not pinned),
                        floods every safekeeper's reader port: strangers repeating SSLRequest, TLS handshake and
                        a garbage startup or a wrong password, and authenticated readers streaming the WAL from
                        its start, again and again. Reported over pgbench-1's mean latency, with the flood's own
                        CPU; the two alternate which runs first, round by round
* pgbench-1-idle-load   pgbench-1 while a busy loop per CPU runs under SCHED_IDLE (nothing of walsidecar's):
                        what background work at the lowest priority costs the commits on this machine, the
                        floor under pgbench-1-reader-flood's ratio (the flood runs under SCHED_IDLE too)
* pgbench-16            16 clients: TPS, CPU per transaction
* pgbench-16-one-down   16 clients with one receiver stopped (native-quorum: a pg_receivewal;
                        walsidecar: a safekeeper), TPS; restarted and level again before the next
                        workload. The report shows its TPS over pgbench-16's, per configuration
* bulk                  WAL MB/s from the LSN difference over wall time, the receivers' CPU s per GB, RSS
* catchup               one receiver down while WAL is written (CPU and RSS measured meanwhile), then
                        restarted: MB/s until it is level again
* pgbench-16-contended  16 clients at --contended-scale (default 10) on a cluster of its own: every
                        transaction updates one of the branch rows (ten: one per unit of scale), so
                        commits queue behind row locks and commit latency is throughput
* wal-analytics         after the last round, decodes the WAL one safekeeper stored
                        (scripts/bench_wal_analytics.py): pg_waldump, walsidecar's segment scan per core
                        and `analyze --stats` on Spark, in MB/s

--topology says which CPUs each part runs on (the postmaster is started on its CPUs, so every backend
it forks is too):
* box (default)  everything on every CPU, one box
* hosts          the primary PostgreSQL and the sidecar on the first CPU (the sidecar runs on the
                 primary's host: every cycle it spends is taken from PostgreSQL), pgbench and the
                 receivers (pg_receivewal, or the safekeepers) on the others, as separate hosts would be
* split          the primary PostgreSQL and pgbench on the first CPU, the receivers and the sidecar on
                 the others: how much the receivers competing with the primary for cores bounds the results

Writes results.json (every round), results.md (medians, ratios and the goals) and chart.png to
--out. MB means 10^6 bytes, GB 10^9 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "scripts"))  # bench_wal_analytics

from sidecar.lsn import format_lsn, parse_lsn, parse_segment_file_name  # noqa: E402
from sidecar.pgcluster import ClusterError, LocalCluster, find_bin_dir  # noqa: E402
from sidecar.processes import Child, process_tree  # noqa: E402
from sidecar.deployment import (  # noqa: E402
    DeploymentError, LocalDeployment, MemberExited, ProcessMember, ProposerMember, SafekeeperMember, free_port,
)

CONFIGS = ("async", "receivewal-1", "native-quorum", "native-quorum-tls", "walsidecar", "walsidecar-auth",
           "walsidecar-insecure", "walsidecar-python", "walsidecar-floor", "walsidecar-floor-all",
           "walsidecar-floor-all-tls")
# walsidecar with mutually authenticated TLS on every link (the default), and with --insecure: the difference
# is what TLS costs.
SIDECAR_CONFIGS = ("walsidecar", "walsidecar-auth", "walsidecar-insecure", "walsidecar-python", "walsidecar-floor",
                   "walsidecar-floor-all", "walsidecar-floor-all-tls")
FLOOR = "walsidecar-floor"  # the sidecar against scripts/floor_safekeeper.c (FloorSafekeeper)
# scripts/floor_proposer.c (FloorProposer) against them, over plain TCP and over TLS
FLOOR_ALL, FLOOR_ALL_TLS = "walsidecar-floor-all", "walsidecar-floor-all-tls"
FLOORS = (FLOOR, FLOOR_ALL, FLOOR_ALL_TLS)
PYTHON_LOOP = "walsidecar-python"  # the safekeepers on the Python reference of their stream loop
NATIVE_TLS = "native-quorum-tls"  # native quorum commit with TLS on its replication connections
# The floors, the Python loop and native quorum commit over TLS only when --only names them.
DEFAULT_CONFIGS = tuple(c for c in CONFIGS if c not in (*FLOORS, PYTHON_LOOP, NATIVE_TLS))
ONE_DOWN = "pgbench-16-one-down"
CONTENDED = "pgbench-16-contended"
FLOOD = "pgbench-1-reader-flood"
FLOOD_SCRIPT = ROOT / "scripts" / "bench_reader_flood.py"
# The flood's own processes run only on CPU nothing else wants (SCHED_IDLE, as `chrt --idle 0`), standing
# in for an attacker on another host: on a machine of two cores its TLS and SCRAM clients would otherwise take
# cores from the primary and pgbench that no safekeeper could give back. --flood-priority normal measures it
# level with the rest.
FLOOD_PRIORITIES = ("idle", "normal")
# The machine's own floor for the flood: pgbench-1 while a busy loop per CPU runs under SCHED_IDLE, touching
# nothing of walsidecar's. What any background work at the lowest priority there is costs the commits here.
IDLE_LOAD = "pgbench-1-idle-load"
WORKLOADS = ("pgbench-1", FLOOD, IDLE_LOAD, "pgbench-16", ONE_DOWN, "bulk", "catchup", CONTENDED, "wal-analytics")
# A receiver can be down without stopping commits. Not the floor: a restarted stand-in is empty and has
# no reader port to catch up from.
QUORUM_CONFIGS = ("native-quorum", NATIVE_TLS, *(c for c in SIDECAR_CONFIGS if c not in FLOORS))
READER_CONFIGS = tuple(c for c in SIDECAR_CONFIGS if c not in FLOORS)  # safekeepers with a reader port
CONTENDED_SCALE = 10  # ten branch rows: sixteen clients queue behind their row locks
SIDECAR_APP = "walsidecar"
MB, GB = 1_000_000, 1_000_000_000
BULK_ROW_PAD = 1000  # bytes of text per bulk row: about 1.1 kB of WAL
BULK_BATCH_BYTES = 128 * MB  # WAL per bulk INSERT statement (one commit each)
PRIMARY_SETTINGS = {
    "fsync": "on",
    "synchronous_commit": "on",
    "shared_buffers": "256MB",
    "max_wal_size": "8GB",  # keeps checkpoints out of the measured bulk writes
    "checkpoint_timeout": "30min",
    "max_wal_senders": "10",
    "max_replication_slots": "10",
    "wal_sender_timeout": "60s",
}
RECEIVEWAL_NAMES = {"receivewal-1": ("r1",), "native-quorum": ("r1", "r2", "r3"), NATIVE_TLS: ("r1", "r2", "r3")}
STANDBY_NAMES = {
    "async": "",
    "receivewal-1": "r1",
    "native-quorum": "ANY 2 (r1, r2, r3)",
    NATIVE_TLS: "ANY 2 (r1, r2, r3)",
    "walsidecar": SIDECAR_APP,
    "walsidecar-auth": SIDECAR_APP,
    "walsidecar-insecure": SIDECAR_APP,
    "walsidecar-python": SIDECAR_APP,
    "walsidecar-floor": SIDECAR_APP,
    "walsidecar-floor-all": SIDECAR_APP,
    "walsidecar-floor-all-tls": SIDECAR_APP,
}


class BenchError(RuntimeError):
    """A configuration could not be built or a workload failed."""


@dataclass
class Settings:
    rounds: int = 3
    duration: float = 30.0
    scale: int = 20
    contended_scale: int = CONTENDED_SCALE
    bulk_bytes: int = 1 * GB
    catchup_bytes: int = 1 * GB
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    workloads: tuple[str, ...] = WORKLOADS
    out: Path = Path("bench-results")
    workdir: Path | None = None
    profile: str = ""  # "", "wall" or "gil"
    fsync_floor: bool = True
    keep: bool = False
    quick: bool = False
    topology: str = "box"
    flood_priority: str = "idle"


# ---- processes and /proc ---------------------------------------------------------------------


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def switches_and_syscalls(pid: int) -> tuple[int, int, int]:
    """(voluntary, involuntary) context switches over the process's live threads, and its read- and
    write-family system calls (/proc/PID/io syscr + syscw, every thread's: read, write, pread, pwrite, readv,
    writev and the like; recv/send on a socket, epoll and fsync are not among them). A voluntary switch is a
    sleep: each is a wake-up later. Threads that exited take their switches with them; the calls are kept."""
    voluntary = involuntary = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    voluntary += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    involuntary += int(line.split()[1])
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines() if ": " in line)
    return voluntary, involuntary, int(io.get("syscr", 0)) + int(io.get("syscw", 0))


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the process's peak resident set since it started or since reset_peak_rss()."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    raise BenchError(f"no VmHWM for pid {pid}")


def reset_peak_rss(pid: int) -> None:
    """Start a new peak-RSS window (writing 5 to clear_refs resets VmHWM)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass  # then the peak covers the whole life of the process


class Meter:
    """CPU seconds, peak RSS, context switches and read/write system calls of a set of processes, each with
    the processes below it (a safekeeper's reader process), over one measured window. The peak RSS is the
    sum of their peaks."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.cpu0: dict[str, dict[int, tuple[float, float]]] = {}
        self.calls0: dict[str, dict[int, tuple[int, int, int]]] = {}
        for name, pid in pids.items():
            self.cpu0[name], self.calls0[name] = {}, {}
            for p in process_tree([pid]):
                reset_peak_rss(p)
                with contextlib.suppress(OSError):
                    self.cpu0[name][p] = cpu_times(p)
                    self.calls0[name][p] = switches_and_syscalls(p)

    def finish(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, pid in self.pids.items():
            user = system = rss = 0.0
            counts = [0, 0, 0]
            for p in process_tree([pid]):
                try:
                    u, s = cpu_times(p)
                    rss += peak_rss_mb(p)
                    now = switches_and_syscalls(p)
                except (OSError, BenchError):
                    continue  # exited meanwhile
                u0, s0 = self.cpu0[name].get(p, (0.0, 0.0))
                user, system = user + u - u0, system + s - s0
                before = self.calls0[name].get(p, (0, 0, 0))
                counts = [c + max(n - b, 0) for c, n, b in zip(counts, now, before)]
            out[name] = {"cpu_s": round(user + system, 3), "cpu_user_s": round(user, 3),
                         "cpu_sys_s": round(system, 3), "peak_rss_mb": round(rss, 1), "wakeups": counts[0],
                         "involuntary_switches": counts[1], "rw_syscalls": counts[2]}
        return out


class Profiler:
    """py-spy record on some processes (collapsed stacks), stopped with SIGINT so it writes its file."""

    def __init__(self, pids: dict[str, int], prefix: Path, gil: bool = False) -> None:
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        exe = shutil.which("py-spy")
        if exe is None:
            print("bench: --profile needs py-spy on PATH; not profiling", file=sys.stderr)
            return
        prefix.parent.mkdir(parents=True, exist_ok=True)
        for name, pid in pids.items():
            out = prefix.with_name(f"{prefix.name}-{name}.txt")
            log = out.with_suffix(".log").open("wb")
            argv = [exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--nonblocking",
                    "-o", str(out)] + (["--gil"] if gil else [])
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
            log.close()
            self.procs.append((p, out))

    def stop(self) -> None:
        for p, out in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p, out in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if out.exists():
                out.with_name(out.stem + "-top.txt").write_text(summarize_profile(out))


def summarize_profile(path: Path, top: int = 25) -> str:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    self_n: dict[str, int] = {}
    incl_n: dict[str, int] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
        for f in set(frames):
            incl_n[f] = incl_n.get(f, 0) + n
    if not total:
        return "no samples\n"
    lines = [f"{total} samples", "", "self %  function"]
    lines += [f"{100 * n / total:6.1f}  {f}" for f, n in sorted(self_n.items(), key=lambda kv: -kv[1])[:top]]
    lines += ["", "incl %  function"]
    lines += [f"{100 * n / total:6.1f}  {f}" for f, n in sorted(incl_n.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines) + "\n"


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


TOPOLOGIES = ("box", "hosts", "split")


@dataclass(frozen=True)
class Pinning:
    """--topology hosts or split: the CPUs of the primary PostgreSQL, pgbench, the sidecar and the receivers."""

    topology: str
    primary: frozenset[int]
    pgbench: frozenset[int]
    sidecar: frozenset[int]
    receivers: frozenset[int]

    @classmethod
    def of(cls, topology: str) -> Pinning | None:
        """None for box; BenchError when this process may not use two CPUs."""
        if topology == "box":
            return None
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise BenchError(f"--topology {topology} needs at least 2 CPUs and this process may use {len(cpus)}: "
                             "run with --topology box")
        first, rest = frozenset(cpus[:1]), frozenset(cpus[1:])
        if topology == "hosts":
            return cls(topology, primary=first, sidecar=first, pgbench=rest, receivers=rest)
        return cls(topology, primary=first, pgbench=first, sidecar=rest, receivers=rest)

    def of_member(self, name: str) -> frozenset[int]:
        return self.sidecar if name == "proposer" else self.receivers

    def describe(self) -> dict[str, Any]:
        return {"topology": self.topology, "primary_cpus": sorted(self.primary), "pgbench_cpus": sorted(self.pgbench),
                "sidecar_cpus": sorted(self.sidecar), "receiver_cpus": sorted(self.receivers)}


@contextmanager
def affinity(cpus: frozenset[int] | None) -> Iterator[None]:
    """Processes started inside run on `cpus`: a child inherits the affinity of the thread that forks it."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin_tree(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of `pid` and of its descendants onto `cpus` (those started before it was pinned too)."""
    for p in process_tree([pid]):
        try:
            tasks = [int(t.name) for t in Path(f"/proc/{p}/task").iterdir()]
        except OSError:
            continue
        for tid in tasks:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass


# ---- one configuration ------------------------------------------------------------------------


class ReceiveWal(ProcessMember):
    """`pg_receivewal --synchronous` into its own directory: a synchronous standby named like the member."""

    def __init__(self, d: LocalDeployment, name: str, bin_dir: Path, tls: bool = False) -> None:
        super().__init__(d, name)
        self.bin_dir = bin_dir
        self.tls = tls

    @property
    def standby(self) -> str:  # type: ignore[override]
        return self.name

    def argv(self) -> list[str]:
        dsn = f"host=127.0.0.1 port={self.d.pg.port} user=postgres application_name={self.name}"
        if self.tls:
            dsn += " sslmode=require"
        return [str(self.bin_dir / "pg_receivewal"), "-D", str(self.data_dir), "--synchronous", "--no-loop",
                "--slot", self.name, "-d", dsn]


def floor_binary(work: Path, name: str) -> Path:
    """scripts/NAME.c, a measurement stand-in, compiled into the scratch directory `work`, once per run."""
    exe = work / name
    source = ROOT / "scripts" / f"{name}.c"
    if not exe.exists():
        cc = shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            raise BenchError(f"the floors compile {source}: install gcc (apt-get install gcc)")
        # The proposer's stand-in speaks to the primary through libpq, whose headers pg_config knows.
        libpq = [f"-I{subprocess.run(['pg_config', '--includedir'], capture_output=True, text=True).stdout.strip()}",
                 "-lpq"] if name == "floor_proposer" else []
        proc = subprocess.run([cc, "-O2", "-pthread", "-o", str(exe), str(source), *libpq, "-lssl", "-lcrypto"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise BenchError(f"compiling {source} failed:\n{proc.stderr[-2000:]}")
    return exe


class FloorSafekeeper(SafekeeperMember):
    """scripts/floor_safekeeper.c in a safekeeper's place: the floor of walsidecar-floor, for measuring only."""

    def argv(self) -> list[str]:
        exe = floor_binary(self.d.base.parent, "floor_safekeeper")  # Setup's base is in the run's scratch directory
        return [str(exe), "--id", str(self.node_id), "--listen", self.address, "--data-dir", str(self.data_dir),
                *floor_tls(self)]

    def create_once(self) -> None:
        """Nothing: the stand-in keeps no control file, and remembers no term across a restart anyway."""


class FloorProposer(ProposerMember):
    """scripts/floor_proposer.c in the sidecar's place: the floor of walsidecar-floor-all, for measuring only."""

    def argv(self) -> list[str]:
        exe = floor_binary(self.d.base.parent, "floor_proposer")
        return [str(exe), "--pg-dsn", self.d.pg.dsn(), "--application-name", self.d.application_name,
                "--safekeepers", ",".join(self.d.addresses), *floor_tls(self)]


def floor_tls(member: ProcessMember) -> list[str]:
    """A stand-in's --certs-dir: the certificates the deployment made for it, none when it is insecure."""
    certs = member.d.certs_dir(member.name, member.role, member.node_id)
    return ["--certs-dir", str(certs)] if certs is not None else []


class Setup:
    """A primary copied from the template plus the configuration's receivers, as a LocalDeployment."""

    def __init__(self, config: str, base: Path, template: Path, bin_dir: Path, pin: Pinning | None = None) -> None:
        self.config = config
        self.base = base
        self.bin_dir = bin_dir
        self.pin = pin
        self.port = free_port()
        # The floors' stand-ins serve no readers, speak plain TCP except in walsidecar-floor-all-tls, and learn no
        # term from peers (which the deployment would otherwise wait for before it starts the proposer).
        floor: dict[str, Any] = {"readers": False, "peers": False, "safekeeper_kind": FloorSafekeeper} \
            if config in FLOORS else {}
        if config in (FLOOR_ALL, FLOOR_ALL_TLS):
            floor["proposer_kind"] = FloorProposer
        # Which stream loop the safekeepers run, asked for by name: a compiled loop that did not build fails
        # the run rather than measuring the reference under the compiled one's name.
        impl = {"WALSIDECAR_IMPL": "python" if config == PYTHON_LOOP else "compiled"}
        self.d = LocalDeployment(base, safekeepers=3 if config in SIDECAR_CONFIGS else 0, pg_port=self.port,
                                 application_name=SIDECAR_APP,
                                 insecure=config in ("walsidecar-insecure", FLOOR, FLOOR_ALL),
                                 link_security="auth-only" if config == "walsidecar-auth" else "tls",
                                 spawn=lambda name, argv, log: Child(name, argv, log, env=impl).start(), **floor)
        self.cluster = self.d.pg
        for name in RECEIVEWAL_NAMES.get(config, ()):
            self.d.add(ReceiveWal(self.d, name, bin_dir, tls=config == NATIVE_TLS))
        self._template = template

    # -- building

    def build(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)  # LocalDeployment made it for the reader credentials
        os.chmod(self.base, 0o755)
        subprocess.run(["cp", "-a", str(self._template), str(self.cluster.data_dir)], check=True, timeout=300)
        self.cluster.set({"port": str(self.port), "synchronous_standby_names": STANDBY_NAMES[self.config]})
        if self.config == NATIVE_TLS:
            self.serve_tls()
        # The postmaster is pinned before it forks the backends pgbench and the receivers connect to.
        with affinity(self.pin and self.pin.primary):
            self.d.start("primary")
        self.repin()
        receivewal = RECEIVEWAL_NAMES.get(self.config, ())
        with self.sql() as c:
            for name in receivewal:
                c.execute("SELECT pg_create_physical_replication_slot(%s, true)", (name,))
        for name in receivewal:
            (self.base / name).mkdir()
        # The certificates are made as each process starts: before anything is measured.
        with affinity(self.pin and self.pin.receivers):
            self.d.start_all(wait=False)
        self.repin()
        self.wait_synchronous()
        if self.config == NATIVE_TLS:
            with self.sql() as c:
                plain = c.execute("SELECT application_name FROM pg_stat_replication JOIN pg_stat_ssl USING (pid) "
                                  "WHERE NOT ssl").fetchall()
            if plain:
                raise BenchError(f"{NATIVE_TLS}: {', '.join(r[0] for r in plain)} replicate without TLS")

    def serve_tls(self) -> None:
        """ssl=on with a certificate of the deployment's CA, its key in the data directory and the server's own."""
        certs = self.d.certs_dir("primary", "client", hosts=("127.0.0.1",))
        assert certs is not None  # native configurations are not insecure
        owner = self.cluster.data_dir.stat()
        for source, target in (("node.crt", "server.crt"), ("node.key", "server.key")):
            path = self.cluster.data_dir / target
            shutil.copyfile(certs / source, path)
            os.chmod(path, 0o600)
            os.chown(path, owner.st_uid, owner.st_gid)
        self.cluster.set({"ssl": "on", "ssl_cert_file": "server.crt", "ssl_key_file": "server.key"})

    def start_receiver(self, name: str) -> None:
        """Start (or restart) one receiver by name: r1..r3, safekeeper1..3 or the proposer."""
        with affinity(self.pin and self.pin.receivers):
            self.d.start(name)
        self.repin()

    def postmaster_pid(self) -> int | None:
        return self.cluster.postmaster_pid()

    def repin(self) -> None:
        """With --topology hosts or split, set the affinity of every process again (threads started meanwhile
        included)."""
        if self.pin is None:
            return
        if (pid := self.postmaster_pid()) is not None:
            pin_tree(pid, self.pin.primary)
        for name, pid in self.measured_pids().items():
            pin_tree(pid, self.pin.of_member(name))

    def cpus(self) -> dict[str, list[int]]:
        """The CPUs each process may run on now (the primary as 'postgres')."""
        pids = {"postgres": self.postmaster_pid(), **self.measured_pids()}
        out = {}
        for name, pid in pids.items():
            try:
                out[name] = sorted(os.sched_getaffinity(pid)) if pid is not None else []
            except ProcessLookupError:
                pass
        return out

    def stop_receiver(self, name: str) -> None:
        self.d.stop(name)

    def wait_synchronous(self, timeout: float = 120) -> None:
        try:
            self.d.wait_streaming(timeout)
        except MemberExited:
            self.check_alive()  # says which one, with its log
            raise
        except DeploymentError as e:
            raise BenchError(str(e)) from e

    def check_alive(self) -> None:
        try:
            self.d.check_running()
        except MemberExited as e:
            child = self.d.process(e.name)
            raise BenchError(f"{e.name} exited with {e.returncode}:\n{child.log_tail(20) if child else ''}") from e

    def sql(self) -> psycopg.Connection:
        """An autocommit connection to the primary."""
        return self.d.sql()

    def measured_pids(self) -> dict[str, int]:
        """The processes whose CPU and memory the report shows."""
        return {name: c.pid for name in self.d.members
                if (c := self.d.process(name)) is not None and c.running and c.pid is not None}

    # -- teardown

    def teardown(self, keep: bool) -> None:
        # The primary's shutdown checkpoint waits for its synchronous standbys: it stops first.
        self.d.stop_all()
        if not keep:
            shutil.rmtree(self.base, ignore_errors=True)


# ---- workloads --------------------------------------------------------------------------------


def pgbench(setup: Setup, clients: int, duration: float, log_dir: Path) -> dict[str, Any]:
    """TPC-B-like pgbench; per-transaction latencies from --log, the COMMIT's mean from -r."""
    with setup.sql() as c:
        c.execute("CHECKPOINT")
    log_dir.mkdir(parents=True, exist_ok=True)
    prefix = log_dir / f"c{clients}"
    argv = [str(setup.bin_dir / "pgbench"), "-n", "-r", "-c", str(clients), "-j", str(min(clients, 2)),
            "-T", str(max(1, round(duration))), "--log", f"--log-prefix={prefix}",
            "-h", "127.0.0.1", "-p", str(setup.port), "-U", "postgres", "postgres"]
    with affinity(setup.pin and setup.pin.pgbench):  # pgbench's, not this process's while it waits
        # Its clients' connections stay plain in every configuration (native-quorum-tls's primary offers TLS).
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PGSSLMODE": "disable"})
    try:
        stdout, stderr = proc.communicate(timeout=duration + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise BenchError(f"pgbench failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-2000:]}")
    tps = re.search(r"^tps = ([\d.]+) \(without initial connection time\)", stdout, re.M)
    commit = re.search(r"^\s+([\d.]+)\s+END;", stdout, re.M)
    latencies: list[int] = []
    for f in log_dir.glob(f"{prefix.name}.*"):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[2].isdigit():
                latencies.append(int(parts[2]))
        f.unlink()
    if tps is None or not latencies:
        raise BenchError(f"cannot read pgbench's results:\n{stdout[-2000:]}")
    latencies.sort()
    return {
        "clients": clients,
        "tps": float(tps.group(1)),
        "transactions": len(latencies),
        "latency_mean_ms": round(statistics.fmean(latencies) / 1000, 4),
        "latency_p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] / 1000, 4),
        "commit_mean_ms": float(commit.group(1)) if commit else None,
    }


@contextmanager
def cancel_after(conn: psycopg.Connection, seconds: float, what: str) -> Iterator[None]:
    """Cancel the running statement (also a commit waiting for standbys) after `seconds`."""
    fired = threading.Event()

    def fire() -> None:
        fired.set()
        conn.cancel_safe()

    timer = threading.Timer(seconds, fire)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if fired.is_set():
            raise BenchError(f"{what} did not finish within {seconds:.0f} s")


def write_wal(setup: Setup, nbytes: int, timeout: float) -> dict[str, Any]:
    """INSERT batches of wide rows until `nbytes` of WAL were written and committed."""
    with setup.sql() as c:
        c.execute("CHECKPOINT")
        c.execute("DROP TABLE IF EXISTS bulk")
        c.execute("CREATE TABLE bulk (id bigint, pad text)")
        start = parse_lsn(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        rows = max(1000, min(nbytes, BULK_BATCH_BYTES) // (BULK_ROW_PAD + 100))
        lsn, first, batches = start, 0, 0
        t0 = time.monotonic()
        with cancel_after(c, timeout, f"writing {nbytes / MB:.0f} MB of WAL"):
            while lsn - start < nbytes:
                c.execute("INSERT INTO bulk SELECT g, repeat('x', %s::int) "
                          "FROM generate_series(%s::bigint, %s::bigint) g", (BULK_ROW_PAD, first + 1, first + rows))
                first += rows
                batches += 1
                lsn = parse_lsn(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        elapsed = time.monotonic() - t0
        c.execute("DROP TABLE bulk")
    return {"wal_bytes": lsn - start, "seconds": round(elapsed, 3), "wal_mb_s": round((lsn - start) / MB / elapsed, 1),
            "commits": batches, "end_lsn": lsn}


def per_txn(result: dict[str, Any], usage: dict[str, dict[str, float]]) -> None:
    """Add the receivers' CPU time per transaction (ms) to a pgbench result."""
    if not usage:
        return
    n = max(result["transactions"], 1)
    result["processes"] = {name: {**u, "cpu_ms_per_txn": round(1000 * u["cpu_s"] / n, 4),
                                  "wakeups_per_txn": round(u["wakeups"] / n, 2),
                                  "rw_syscalls_per_txn": round(u["rw_syscalls"] / n, 2)} for name, u in usage.items()}
    result["receivers_cpu_ms_per_txn"] = round(1000 * sum(u["cpu_s"] for u in usage.values()) / n, 4)
    if "proposer" in usage:
        result["sidecar_cpu_ms_per_txn"] = result["processes"]["proposer"]["cpu_ms_per_txn"]
        result["sidecar_wakeups_per_txn"] = result["processes"]["proposer"]["wakeups_per_txn"]
        result["sidecar_rw_syscalls_per_txn"] = result["processes"]["proposer"]["rw_syscalls_per_txn"]
    # Each receiver's (a safekeeper, or one pg_receivewal of native quorum): the mean over them.
    receivers = [u for name, u in result["processes"].items() if name != "proposer"]
    if receivers:
        result["receiver_cpu_ms_per_txn"] = round(statistics.mean(u["cpu_ms_per_txn"] for u in receivers), 4)
        result["receiver_wakeups_per_txn"] = round(statistics.mean(u["wakeups_per_txn"] for u in receivers), 2)
        result["receiver_rw_syscalls_per_txn"] = round(
            statistics.mean(u["rw_syscalls_per_txn"] for u in receivers), 2)


def with_usage(result: dict[str, Any], usage: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Add per-process CPU s, CPU s per GB of WAL and peak RSS to a WAL-writing result."""
    gb = result["wal_bytes"] / GB
    result["processes"] = {n: {**u, "cpu_s_per_gb": round(u["cpu_s"] / gb, 3)} for n, u in usage.items()}
    receivers = [u for n, u in usage.items() if n != "proposer"]
    if "proposer" in usage:
        result["sidecar_cpu_s_per_gb"] = result["processes"]["proposer"]["cpu_s_per_gb"]
        result["sidecar_peak_rss_mb"] = usage["proposer"]["peak_rss_mb"]
    if receivers or "proposer" in usage:
        result["all_receivers_cpu_s_per_gb"] = round(sum(u["cpu_s"] for u in usage.values()) / gb, 3)
        result["max_receiver_peak_rss_mb"] = max(u["peak_rss_mb"] for u in usage.values())
    return result


def measured_pgbench(setup: Setup, clients: int, duration: float, profile_prefix: Path | None,
                     gil: bool = False) -> dict[str, Any]:
    """pgbench with the receivers' CPU time per transaction (and py-spy on them with --profile)."""
    prof = Profiler(setup.measured_pids(), profile_prefix, gil) if profile_prefix else None
    meter = Meter(setup.measured_pids())
    t0 = time.monotonic()
    try:
        data = pgbench(setup, clients, duration, setup.base / "pgbench")
    finally:
        if prof:
            prof.stop()
    elapsed = time.monotonic() - t0
    setup.check_alive()
    usage = meter.finish()
    per_txn(data, usage)
    safekeepers = [u["cpu_s"] for name, u in usage.items() if name.startswith("safekeeper")]
    if safekeepers:
        data["safekeepers_cpu_cores"] = round(sum(safekeepers) / elapsed, 3)
    return data


def first_stored_lsn(wal_dir: Path, seg_size: int) -> int | None:
    """The start of the oldest segment file in a safekeeper's WAL directory; None before it has one."""
    segnos = []
    for f in wal_dir.iterdir() if wal_dir.is_dir() else ():
        try:
            segnos.append(parse_segment_file_name(f.name, seg_size)[1])
        except ValueError:
            continue  # .history files, the spare segment
    return min(segnos) * seg_size if segnos else None


class ReaderFlood:
    """scripts/bench_reader_flood.py against every safekeeper's reader port: a process of its own, not pinned
    (under --topology it may run on every CPU), at `priority` (FLOOD_PRIORITIES: "idle" stands in for another host)."""

    def __init__(self, setup: Setup, priority: str = "idle") -> None:
        d = setup.d
        with setup.sql() as c:
            seg = int(c.execute("SELECT setting FROM pg_settings WHERE name = 'wal_segment_size'").fetchone()[0])
        ports = [m for m in d.members.values() if isinstance(m, SafekeeperMember) and m.reader_address is not None]
        if not ports or d.reader_passfile is None:
            raise BenchError(f"{FLOOD} needs safekeepers with reader ports")
        # Right after the build a safekeeper outside the first quorum may not have joined the term yet.
        def stored() -> list[int] | None:
            lsns = [first_stored_lsn(m.data_dir / "wal", seg) for m in ports]
            return [lsn for lsn in lsns if lsn is not None] if None not in lsns else None

        starts = wait_until(stored, 120, "every safekeeper to store WAL")
        argv = (["chrt", "--idle", "0"] if priority == "idle" else []) + \
            [sys.executable, str(FLOOD_SCRIPT), "--passfile", str(d.reader_passfile)]
        for m, start in zip(ports, starts):
            argv += ["--port", f"{m.reader_address}@{format_lsn(start)}"]
        if (certs := d.certs_dir("flood", "client")) is not None:
            argv += ["--certs-dir", str(certs)]
        self.log_path = setup.base / "reader-flood.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                         text=True, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        """Until every stranger was answered once and every reader made a pass."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.stop()
            raise BenchError(f"the reader flood did not start within {timeout:.0f} s (exit {self.proc.poll()}):\n"
                             f"{line}{self.log_path.read_text(errors='replace')[-2000:]}")

    def stop(self) -> dict[str, Any]:
        """Stop it (SIGTERM): what it did, from its last line."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        lines = out.strip().splitlines()
        try:
            return json.loads(lines[-1]) if lines else {}
        except ValueError:
            return {}


def flooded_pgbench(setup: Setup, duration: float, profile_prefix: Path | None, gil: bool = False,
                    priority: str = "idle") -> dict[str, Any]:
    """pgbench-1 while the reader flood runs; the flood's own CPU over the same window."""
    flood = ReaderFlood(setup, priority)
    try:
        flood.wait_ready(timeout=120)
        meter = Meter({"flood": flood.pid})
        t0 = time.monotonic()
        data = measured_pgbench(setup, 1, duration, profile_prefix, gil)
        elapsed = time.monotonic() - t0
        usage = meter.finish()["flood"]
    finally:
        stats = flood.stop()
    if not stats:
        raise BenchError(f"the reader flood said nothing at its end:\n{flood.log_path.read_text(errors='replace')[-2000:]}")
    counts: dict[str, int] = stats["counts"]
    refused = sum(n for kind, n in counts.items() if kind.startswith(("garbage startup", "wrong password: refused")))
    data["flood"] = {
        "cpu_s": usage["cpu_s"], "cpu_cores": round(usage["cpu_s"] / elapsed, 3), "seconds": round(elapsed, 3),
        "refused_per_s": round(refused / stats["seconds"], 1),
        "read_mb_s": round(stats["read_bytes"] / MB / stats["seconds"], 1),
        "counts": counts, "ports": stats["ports"], "strangers_per_port": stats["strangers_per_port"],
        "readers_per_port": stats["readers_per_port"], "priority": priority,
    }
    return data


def idle_loaded_pgbench(setup: Setup, duration: float, profile_prefix: Path | None, gil: bool = False) -> dict[str, Any]:
    """pgbench-1 while one SCHED_IDLE busy loop per CPU runs; the loops are stopped by PID."""
    loops = [subprocess.Popen(["chrt", "--idle", "0", sys.executable, "-c", "while True: pass"],
                              stdin=subprocess.DEVNULL, start_new_session=True) for _ in range(os.cpu_count() or 1)]
    try:
        return measured_pgbench(setup, 1, duration, profile_prefix, gil)
    finally:
        for proc in loops:
            proc.kill()
            proc.wait()


def bulk(setup: Setup, nbytes: int, profile_prefix: Path | None, gil: bool = False) -> dict[str, Any]:
    meter = Meter(setup.measured_pids())
    prof = Profiler(setup.measured_pids(), profile_prefix, gil) if profile_prefix else None
    try:
        result = write_wal(setup, nbytes, timeout=600)
    finally:
        if prof:
            prof.stop()
    return with_usage(result, meter.finish())


def standby_lsn(setup: Setup, name: str, column: str) -> int | None:
    with setup.sql() as c:
        row = c.execute(f"SELECT {column}::text FROM pg_stat_replication WHERE application_name = %s "
                        "AND state = 'streaming'", (name,)).fetchone()
    return parse_lsn(row[0]) if row and row[0] else None


def down_receiver(setup: Setup) -> tuple[str, str, str]:
    """The receiver the one-down workloads stop, and the standby and column that show it level again."""
    if setup.config in SIDECAR_CONFIGS:
        return "safekeeper3", SIDECAR_APP, "replay_lsn"  # replay = flushed on every safekeeper
    return "r3", "r3", "flush_lsn"


def bring_back(setup: Setup, victim: str, target: int, timeout: float) -> float:
    """Restart the stopped receiver and wait until it has the WAL up to `target`: the seconds that took."""
    _, name, column = down_receiver(setup)
    t0 = time.monotonic()
    setup.start_receiver(victim)

    def level() -> bool:
        setup.check_alive()
        lsn = standby_lsn(setup, name, column)
        return lsn is not None and lsn >= target

    wait_until(level, timeout, f"{victim} to catch up")
    return time.monotonic() - t0


def pgbench_one_down(setup: Setup, duration: float, profile_prefix: Path | None, gil: bool = False,
                     timeout: float = 600) -> dict[str, Any]:
    """pgbench with 16 clients while one receiver is stopped; restarted and level again afterwards."""
    victim, _, _ = down_receiver(setup)
    setup.stop_receiver(victim)
    data = measured_pgbench(setup, 16, duration, profile_prefix, gil)
    with setup.sql() as c:
        target = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
    data["victim"] = victim
    data["catchup_seconds"] = round(bring_back(setup, victim, target, timeout), 3)
    return data


def catchup(setup: Setup, nbytes: int, timeout: float = 600) -> dict[str, Any]:
    """One receiver down while `nbytes` of WAL are written (CPU and RSS measured), then restarted."""
    victim, _, column = down_receiver(setup)
    with setup.sql() as c:
        c.execute("CHECKPOINT")
    setup.stop_receiver(victim)
    behind = standby_lsn(setup, SIDECAR_APP, column) if setup.config in SIDECAR_CONFIGS else None
    meter = Meter(setup.measured_pids())
    written = with_usage(write_wal(setup, nbytes, timeout=timeout), meter.finish())
    if behind is None:
        with setup.sql() as c:
            row = c.execute("SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                            (victim,)).fetchone()
        behind = parse_lsn(row[0])
    target = written["end_lsn"]
    elapsed = bring_back(setup, victim, target, timeout)
    return {"victim": victim, "dead_run": written, "catchup_bytes": target - behind,
            "catchup_seconds": round(elapsed, 3), "catchup_mb_s": round((target - behind) / MB / elapsed, 1),
            "sidecar_cpu_s_per_gb_dead": written.get("sidecar_cpu_s_per_gb"),
            "sidecar_peak_rss_mb_dead": written.get("sidecar_peak_rss_mb")}


# ---- the run ----------------------------------------------------------------------------------


def build_template(work: Path, scale: int, bin_dir: Path) -> Path:
    cluster = LocalCluster(work / f"template-scale{scale}", free_port(), log_file=work / f"template-scale{scale}.log")
    cluster.init(PRIMARY_SETTINGS)
    cluster.start()
    try:
        proc = subprocess.run([str(bin_dir / "pgbench"), "-i", "-q", "-s", str(scale), "-h", "127.0.0.1",
                               "-p", str(cluster.port), "-U", "postgres", "postgres"],
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise BenchError(f"pgbench -i failed:\n{proc.stderr[-2000:]}")
        with psycopg.connect(cluster.dsn(), autocommit=True) as c:
            c.execute("CHECKPOINT")
    finally:
        cluster.stop()
    return cluster.data_dir


def fsync_floor(work: Path, bin_dir: Path) -> dict[str, float] | None:
    """pg_test_fsync's single 8 kB write + fdatasync rate on the benchmark's disk."""
    try:
        proc = subprocess.run([str(bin_dir / "pg_test_fsync"), "-s", "1", "-f", str(work / "pg_test_fsync.tmp")],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"one 8kB write.*?fdatasync\s+([\d.]+) ops/sec\s+(\d+) usecs/op", proc.stdout, re.S)
    return {"fdatasync_ops_s": float(m.group(1)), "fdatasync_us": float(m.group(2))} if m else None


def setups(s: Settings) -> dict[int, tuple[str, ...]]:
    """The workloads to run per pgbench scale: one template cluster each, and one setup per round and config."""
    out: dict[int, tuple[str, ...]] = {}
    for w in s.workloads:
        scale = s.contended_scale if w == CONTENDED else s.scale
        out[scale] = (*out.get(scale, ()), w)
    return out


def run_config(s: Settings, config: str, rnd: int, work: Path, templates: dict[int, Path], bin_dir: Path,
               pin: Pinning | None, log: Callable[[str], None], results: list[dict[str, Any]]) -> None:
    """Build the configuration from each template in turn, run its workloads, append a row per workload."""
    for scale, workloads in setups(s).items():
        name = f"r{rnd}-{config}" + ("" if scale == s.scale else f"-scale{scale}")
        setup = Setup(config, work / name, templates[scale], bin_dir, pin)
        try:
            t0 = time.monotonic()
            setup.build()
            log(f"round {rnd} {config:14s} built (pgbench scale {scale}) in {time.monotonic() - t0:.1f} s")
            run_workloads(s, setup, rnd, workloads, log, results)
        except (BenchError, psycopg.Error, ClusterError, OSError, subprocess.SubprocessError) as e:
            results.append({"round": rnd, "config": config, "workload": "error", "error": str(e)})
            log(f"round {rnd} {config}: FAILED: {e}")
            log(f"--- tail of {setup.cluster.log_file} ---\n{setup.cluster.log_tail(15)}")
        finally:
            setup.teardown(s.keep)


def run_workloads(s: Settings, setup: Setup, rnd: int, workloads: tuple[str, ...], log: Callable[[str], None],
                  results: list[dict[str, Any]]) -> None:
    """Run `workloads` in order on one built setup."""
    config = setup.config

    def record(workload: str, data: dict[str, Any]) -> None:
        row = {"round": rnd, "config": config, "workload": workload, **data}
        if setup.pin is not None:
            row["cpus"] = setup.cpus()
        results.append(row)
        log(f"round {rnd} {config:14s} {workload:20s} {summary(row)}")

    prof_dir = s.out / "profile" / config if s.profile and config in SIDECAR_CONFIGS else None
    gil = s.profile == "gil"
    if rnd % 2 == 0 and "pgbench-1" in workloads and FLOOD in workloads:
        # With and without the flood take turns at running first: neither always has the fresher tables.
        workloads = tuple(FLOOD if w == "pgbench-1" else "pgbench-1" if w == FLOOD else w for w in workloads)
    for workload in workloads:
        prof = prof_dir / f"r{rnd}-{workload.replace('-', '', 1)}" if prof_dir else None  # r1-pgbench16-...
        if workload in ("pgbench-1", "pgbench-16", CONTENDED):
            record(workload, measured_pgbench(setup, 1 if workload == "pgbench-1" else 16, s.duration, prof, gil))
        elif workload == IDLE_LOAD:
            record(workload, idle_loaded_pgbench(setup, s.duration, prof, gil))
        elif workload == FLOOD and config in READER_CONFIGS:
            record(workload, flooded_pgbench(setup, s.duration, prof, gil, s.flood_priority))
        elif workload == ONE_DOWN and config in QUORUM_CONFIGS:
            record(workload, pgbench_one_down(setup, s.duration, prof, gil))
        elif workload == "bulk":
            data = bulk(setup, s.bulk_bytes, prof, gil)
            setup.check_alive()
            record("bulk", data)
        elif workload == "catchup" and config in QUORUM_CONFIGS:
            record("catchup", catchup(setup, s.catchup_bytes))
        elif workload == "wal-analytics" and config == "walsidecar" and rnd == s.rounds:
            results.append({"round": rnd, "config": config, "workload": "wal-analytics",
                            "rows": wal_analytics(setup.base / "safekeeper1" / "wal", log)})


def wal_analytics(wal_dir: Path, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Decoding throughput on the WAL a safekeeper stored; [] without the analytics extra."""
    try:
        import bench_wal_analytics
    except ImportError as e:
        log(f"wal-analytics skipped: {e} (pip install -e '.[analytics]')")
        return []
    cores = sorted({1, os.cpu_count() or 1})
    # Completed segments only: pg_waldump takes no .partial file as the end of its range.
    complete = wal_dir.with_name("wal-complete")
    complete.mkdir()
    for f in wal_dir.iterdir():
        if re.fullmatch(r"[0-9A-F]{24}", f.name):
            (complete / f.name).symlink_to(f)
    log(f"wal-analytics on {complete}: pg_waldump, the segment scan and Spark local{cores}")
    rows = bench_wal_analytics.run(complete, cores, repeat=3)
    for r in rows:
        log(f"wal-analytics {r['what']}: {r['mb_per_s']:.0f} MB/s ({r['mb_per_s_per_core']:.0f} per core)")
    return rows


def summary(row: dict[str, Any]) -> str:
    keys = ("victim", "tps", "latency_mean_ms", "latency_p99_ms", "commit_mean_ms", "receivers_cpu_ms_per_txn",
            "sidecar_cpu_ms_per_txn", "safekeepers_cpu_cores", "wal_mb_s", "sidecar_cpu_s_per_gb",
            "sidecar_peak_rss_mb", "all_receivers_cpu_s_per_gb", "catchup_mb_s", "sidecar_peak_rss_mb_dead")
    flood = row.get("flood") or {}
    return "  ".join([f"{k}={row[k]}" for k in keys if row.get(k) is not None]
                     + [f"flood_{k}={flood[k]}" for k in ("cpu_cores", "refused_per_s", "read_mb_s") if k in flood])


def run(s: Settings) -> dict[str, Any]:
    bin_dir = find_bin_dir()
    pin = Pinning.of(s.topology)
    s.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="walsidecar-bench-", dir=s.workdir))
    os.chmod(work, 0o755)
    log_file = (s.out / "bench.log").open("w")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    started = time.time()
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_start": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "pinned": pin.describe() if pin else None,
    }
    try:
        if s.fsync_floor:
            meta["fsync_floor"] = fsync_floor(work, bin_dir)
            log(f"fsync floor: {meta['fsync_floor']}")
        templates = {}
        for scale in setups(s):
            t0 = time.monotonic()
            templates[scale] = build_template(work, scale, bin_dir)
            log(f"template cluster (pgbench scale {scale}) built in {time.monotonic() - t0:.1f} s in {work}")
        for rnd in range(1, s.rounds + 1):
            for config in s.configs:
                run_config(s, config, rnd, work, templates, bin_dir, pin, log, rows)
    finally:
        meta["seconds"] = round(time.time() - started, 1)
        meta["machine"]["loadavg_at_end"] = os.getloadavg()
        if not s.keep:
            shutil.rmtree(work, ignore_errors=True)
        report = {**meta, "rounds": rows}
        (s.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
        table = markdown(report)
        (s.out / "results.md").write_text(table)
        chart(report, s.out / "chart.png", log)
        log(f"done in {meta['seconds']:.0f} s; results in {s.out}\n\n{table}")
        log_file.close()
    return report


# ---- reporting --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    label: str
    workload: str
    key: str
    higher_is_better: bool
    digits: int = 1
    configs: tuple[str, ...] = CONFIGS
    over: str = ""  # a workload: then the row is this median over that workload's median of `key`


METRICS = (
    Metric("pgbench 1 client: mean latency (ms)", "pgbench-1", "latency_mean_ms", False, 3),
    Metric("pgbench 1 client: p99 latency (ms)", "pgbench-1", "latency_p99_ms", False, 3),
    Metric("pgbench 1 client: COMMIT mean (ms)", "pgbench-1", "commit_mean_ms", False, 3),
    Metric("pgbench 1 client: TPS", "pgbench-1", "tps", True, 0),
    Metric("pgbench 1 client: sidecar (proposer) CPU ms per transaction", "pgbench-1", "sidecar_cpu_ms_per_txn",
           False, 3, SIDECAR_CONFIGS),
    Metric("pgbench 1 client: safekeepers' CPU (cores)", "pgbench-1", "safekeepers_cpu_cores", False, 2,
           READER_CONFIGS),
    Metric("pgbench 1 client: sidecar wake-ups per transaction", "pgbench-1", "sidecar_wakeups_per_txn", False, 1,
           SIDECAR_CONFIGS),
    Metric("pgbench 1 client: sidecar read/write-family syscalls per transaction", "pgbench-1",
           "sidecar_rw_syscalls_per_txn", False, 1, SIDECAR_CONFIGS),
    Metric("pgbench 1 client: CPU ms per transaction, each receiver", "pgbench-1", "receiver_cpu_ms_per_txn",
           False, 3, CONFIGS[1:]),
    Metric("pgbench 1 client: wake-ups per transaction, each receiver", "pgbench-1", "receiver_wakeups_per_txn",
           False, 1),
    Metric("pgbench 1 client: read/write-family syscalls per transaction, each receiver", "pgbench-1",
           "receiver_rw_syscalls_per_txn", False, 1),
    Metric("pgbench 1 client, reader-port flood: mean latency (ms)", FLOOD, "latency_mean_ms", False, 3,
           READER_CONFIGS),
    Metric("pgbench 1 client, reader-port flood: p99 latency (ms)", FLOOD, "latency_p99_ms", False, 3,
           READER_CONFIGS),
    Metric("1 client: mean latency with a reader-port flood ÷ without", FLOOD, "latency_mean_ms", False, 2,
           READER_CONFIGS, over="pgbench-1"),
    Metric("1 client: mean latency with SCHED_IDLE busy loops on every CPU ÷ without", IDLE_LOAD,
           "latency_mean_ms", False, 2, over="pgbench-1"),
    Metric("pgbench 1 client, reader-port flood: safekeepers' CPU (cores)", FLOOD, "safekeepers_cpu_cores", False,
           2, READER_CONFIGS),
    Metric("reader-port flood: the flood's own CPU (cores)", FLOOD, "flood.cpu_cores", False, 2, READER_CONFIGS),
    Metric("reader-port flood: logins refused per second, all ports", FLOOD, "flood.refused_per_s", True, 0,
           READER_CONFIGS),
    Metric("reader-port flood: WAL MB/s its readers read, all ports", FLOOD, "flood.read_mb_s", True, 0,
           READER_CONFIGS),
    Metric("pgbench 16 clients: TPS", "pgbench-16", "tps", True, 0),
    Metric("pgbench 16 clients: mean latency (ms)", "pgbench-16", "latency_mean_ms", False, 2),
    Metric("pgbench 16 clients: CPU ms per transaction, all receivers", "pgbench-16", "receivers_cpu_ms_per_txn",
           False, 3, CONFIGS[1:]),
    Metric("pgbench 16 clients: sidecar (proposer) CPU ms per transaction", "pgbench-16", "sidecar_cpu_ms_per_txn",
           False, 3, SIDECAR_CONFIGS),
    Metric("pgbench 16 clients, one receiver down: TPS", ONE_DOWN, "tps", True, 0, QUORUM_CONFIGS),
    Metric("one receiver down: TPS ÷ all up (16 clients)", ONE_DOWN, "tps", True, 2, QUORUM_CONFIGS,
           over="pgbench-16"),
    Metric("pgbench 16 clients, contended: TPS", CONTENDED, "tps", True, 0),
    Metric("pgbench 16 clients, contended: mean latency (ms)", CONTENDED, "latency_mean_ms", False, 2),
    Metric("pgbench 16 clients, contended: CPU ms per transaction, all receivers", CONTENDED,
           "receivers_cpu_ms_per_txn", False, 3, CONFIGS[1:]),
    Metric("pgbench 16 clients, contended: sidecar (proposer) CPU ms per transaction", CONTENDED,
           "sidecar_cpu_ms_per_txn", False, 3, SIDECAR_CONFIGS),
    Metric("bulk ingest: WAL MB/s", "bulk", "wal_mb_s", True, 0),
    Metric("bulk ingest: CPU s per GB, all receivers", "bulk", "all_receivers_cpu_s_per_gb", False, 2,
           CONFIGS[1:]),
    Metric("bulk ingest: sidecar (proposer) CPU s per GB", "bulk", "sidecar_cpu_s_per_gb", False, 2, SIDECAR_CONFIGS),
    Metric("bulk ingest: sidecar peak RSS (MB)", "bulk", "sidecar_peak_rss_mb", False, 0, SIDECAR_CONFIGS),
    Metric("one receiver down: WAL MB/s", "catchup", "dead_run.wal_mb_s", True, 0, QUORUM_CONFIGS),
    Metric("one safekeeper down: sidecar CPU s per GB", "catchup", "sidecar_cpu_s_per_gb_dead", False, 2,
           SIDECAR_CONFIGS),
    Metric("one safekeeper down: sidecar peak RSS (MB)", "catchup", "sidecar_peak_rss_mb_dead", False, 0,
           SIDECAR_CONFIGS),
    Metric("catch-up of the restarted receiver: MB/s", "catchup", "catchup_mb_s", True, 0, QUORUM_CONFIGS),
)


def values(report: dict[str, Any], m: Metric, config: str, workload: str = "") -> list[float]:
    """`m.key` of every round of `config` (in `workload`, by default the metric's)."""
    out = []
    for row in report["rounds"]:
        if row["config"] != config or row["workload"] != (workload or m.workload):
            continue
        v: Any = row
        for part in m.key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if isinstance(v, (int, float)):
            out.append(float(v))
    return out


def median(report: dict[str, Any], m: Metric, config: str) -> float | None:
    vs = values(report, m, config)
    if not vs:
        return None
    if not m.over:
        return statistics.median(vs)
    base = values(report, m, config, m.over)
    return statistics.median(vs) / statistics.median(base) if base and statistics.median(base) else None


def markdown(report: dict[str, Any]) -> str:
    """Medians over rounds; ratios are walsidecar's median over the other's."""
    s = report["settings"]
    configs = [c for c in CONFIGS if c in s["configs"]]
    head = ["metric (median of rounds)", *configs]
    # walsidecar ÷ walsidecar-insecure is what TLS costs; ÷ walsidecar-auth, what its encryption costs.
    # ÷ walsidecar-python, what the safekeepers' compiled stream loop gains.
    ratio_to = [c for c in ("native-quorum", NATIVE_TLS, "receivewal-1", "walsidecar-auth", "walsidecar-insecure",
                            PYTHON_LOOP) if c in configs and "walsidecar" in configs]
    head += [f"walsidecar ÷ {c}" for c in ratio_to]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in METRICS:
        meds = {c: median(report, m, c) if c in m.configs else None for c in configs}
        if all(v is None for v in meds.values()):
            continue
        cells = [m.label] + [_num(meds[c], m.digits) for c in configs]
        for c in ratio_to:
            ours, theirs = meds.get("walsidecar"), meds.get(c)
            cells.append(f"{ours / theirs:.2f}" if ours is not None and theirs else "–")
        lines.append("| " + " | ".join(cells) + " |")
    rounds = max((r["round"] for r in report["rounds"]), default=0)
    errors = [r for r in report["rounds"] if r["workload"] == "error"]
    floor = report.get("fsync_floor")
    notes = [
        "",
        f"{rounds} interleaved round(s); pgbench TPC-B scale {s['scale']} (contended: scale "
        f"{s.get('contended_scale', CONTENDED_SCALE)}), {s['duration']:g} s per pgbench run; "
        f"bulk ingest {s['bulk_bytes'] / MB:.0f} MB of WAL; catch-up after {s['catchup_bytes'] / MB:.0f} MB; "
        f"{report['machine']['cpus']} CPUs; load average {report['machine']['loadavg_at_start'][0]:.1f} at start. "
        "MB = 10^6 bytes.",
    ]
    if floor:
        notes.append(f"fsync floor (pg_test_fsync, one 8 kB write + fdatasync): {floor['fdatasync_us']:.0f} µs.")
    if pinned := report.get("pinned"):
        notes.append(f"Topology {pinned['topology']} (--topology): the primary PostgreSQL on CPU "
                     f"{_cpus(pinned['primary_cpus'])}, the sidecar on {_cpus(pinned['sidecar_cpus'])}, pgbench on "
                     f"{_cpus(pinned['pgbench_cpus'])}, the receivers on {_cpus(pinned['receiver_cpus'])}.")
    else:
        notes.append("Topology box (--topology): every process on every CPU.")
    notes += goals(report) + analytics_table(report)
    if errors:
        notes += ["", "Failed rounds:"] + [f"* round {r['round']} {r['config']}: {r['error'].splitlines()[0]}"
                                          for r in errors]
    return "\n".join(lines + notes) + "\n"


def analytics_table(report: dict[str, Any]) -> list[str]:
    """The wal-analytics rows of the run, if it had any."""
    rows = [r for run in report["rounds"] if run["workload"] == "wal-analytics" for r in run["rows"]]
    if not rows:
        return []
    out = ["", "WAL decoding, on the WAL safekeeper 1 stored (MB of segment files per second):", "",
           "| what | cores | MB/s | MB/s per core |", "|---|---:|---:|---:|"]
    out += [f"| {r['what']} | {r['cores']} | {r['mb_per_s']:,.0f} | {r['mb_per_s_per_core']:,.0f} |" for r in rows]
    return out


def goals(report: dict[str, Any]) -> list[str]:
    """The targets of the benchmark (docs/performance.md's goals, catch-up and memory), checked on walsidecar's medians."""
    by_label = {m.label: m for m in METRICS}

    def med(label: str, config: str = "walsidecar") -> float | None:
        return median(report, by_label[label], config)

    def ratio(label: str, of_label: str = "", of_config: str = "native-quorum") -> tuple[float, str] | None:
        ours, theirs = med(label), med(of_label or label, of_config)
        if ours is None or not theirs:
            return None
        return ours / theirs, f"{ours / theirs:.2f}: {_sig(ours)} vs {_sig(theirs)}"

    def alone(label: str, unit: str) -> tuple[float, str] | None:
        ours = med(label)
        return None if ours is None else (ours, f"{_sig(ours)} {unit}")

    settings = report["settings"]
    tps16 = "pgbench 16 clients: TPS"
    checks = [
        (f"contended pgbench (scale {settings.get('contended_scale', CONTENDED_SCALE)}, 16 clients): "
         "TPS ÷ native-quorum", "≥", 1.0, "", ratio("pgbench 16 clients, contended: TPS")),
        (f"pgbench scale {settings['scale']}, 16 clients: TPS ÷ native-quorum", "≥", 1.1, "", ratio(tps16)),
        ("1 client: mean latency ÷ native-quorum", "≤", 1.1, "", ratio("pgbench 1 client: mean latency (ms)")),
        ("1 client: p99 latency ÷ native-quorum", "≤", 0.8, "", ratio("pgbench 1 client: p99 latency (ms)")),
        ("1 client: mean latency with a reader-port flood ÷ without", "≤", 1.1, "",
         ratio("pgbench 1 client, reader-port flood: mean latency (ms)", "pgbench 1 client: mean latency (ms)",
               "walsidecar")),
        ("16 clients: CPU per transaction, all receivers ÷ native-quorum", "≤", 1.5, "",
         ratio("pgbench 16 clients: CPU ms per transaction, all receivers")),
        ("sidecar CPU per commit round trip (1 client)", "≤", 0.1, " ms",
         alone("pgbench 1 client: sidecar (proposer) CPU ms per transaction", "ms")),
        ("bulk ingest: WAL MB/s ÷ native-quorum", "≥", 1.3, "", ratio("bulk ingest: WAL MB/s")),
        ("one safekeeper down: TPS ÷ all up (16 clients)", "≥", 0.95, "",
         ratio("pgbench 16 clients, one receiver down: TPS", tps16, "walsidecar")),
        ("catch-up of the restarted safekeeper", "≥", 150, " MB/s",
         alone("catch-up of the restarted receiver: MB/s", "MB/s")),
        ("sidecar peak RSS with a safekeeper down", "≤", 300, " MB",
         alone("one safekeeper down: sidecar peak RSS (MB)", "MB")),
    ]
    out = ["", "Goals (walsidecar's medians):"]
    for what, op, bound, unit, got in checks:
        if got is None:
            continue
        value, detail = got
        ok = value >= bound if op == "≥" else value <= bound
        out.append(f"* {what} {op} {bound}{unit}: {'met' if ok else 'NOT met'} ({detail})")
    return out if len(out) > 2 else []


def _sig(v: float) -> str:
    """A measured value with the digits that matter at its size."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) >= 1 else f"{v:.3f}"


def _cpus(cpus: list[int]) -> str:
    return f"{cpus[0]}–{cpus[-1]}" if len(cpus) > 2 and cpus == list(range(cpus[0], cpus[-1] + 1)) else \
        ", ".join(map(str, cpus))


def _num(v: float | None, digits: int) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def chart(report: dict[str, Any], path: Path, log: Callable[[str], None]) -> None:
    """Bars of the medians per configuration, whiskers from the lowest to the highest round."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no chart (pip install -e '.[bench]')")
        return
    configs = [c for c in CONFIGS if c in report["settings"]["configs"]]
    panels = {("pgbench-1", "latency_mean_ms"), ("pgbench-16", "tps"), (CONTENDED, "tps"), (ONE_DOWN, "tps"),
              ("bulk", "wal_mb_s"), ("bulk", "all_receivers_cpu_s_per_gb"),
              ("catchup", "catchup_mb_s"), ("catchup", "sidecar_peak_rss_mb_dead")}
    shown = [m for m in METRICS if (m.workload, m.key) in panels and not m.over]
    shown = [m for m in shown if any(values(report, m, c) for c in configs)]
    if not shown:
        return
    colors = {"async": "#9e9e9e", "receivewal-1": "#64b5f6", "native-quorum": "#1565c0", "native-quorum-tls": "#0d47a1",
              "walsidecar": "#e65100",
              "walsidecar-auth": "#fb8c00", "walsidecar-insecure": "#ffb74d", "walsidecar-python": "#8d6e63",
              "walsidecar-floor": "#fff176", "walsidecar-floor-all": "#fdd835",
              "walsidecar-floor-all-tls": "#f9a825"}
    cols = 3
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, m in zip(axes.flat, shown):
        names, meds, lo, hi = [], [], [], []
        for c in configs:
            vs = values(report, m, c) if c in m.configs else []
            if not vs:
                continue
            med = statistics.median(vs)
            names.append(c)
            meds.append(med)
            lo.append(med - min(vs))
            hi.append(max(vs) - med)
        ax.bar(names, meds, yerr=[lo, hi], capsize=4, color=[colors[n] for n in names])
        ax.set_title(m.label + (" ↑" if m.higher_is_better else " ↓"), fontsize=9)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle("walsidecar benchmark: medians, whiskers min–max over rounds", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> Settings:
    first, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=first, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    p.add_argument("--duration", type=float, help="seconds per pgbench run (default 30; 2 with --quick)")
    p.add_argument("--only", default="", help="comma-separated configurations and/or workloads to run "
                   f"(configurations: {', '.join(CONFIGS)}; workloads: {', '.join(WORKLOADS)}); {ONE_DOWN} "
                   f"brings pgbench-16, what its TPS is divided by, and {FLOOD} brings pgbench-1")
    p.add_argument("--quick", action="store_true", help="a small run (about a minute) that checks the harness")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where results go (default bench-results)")
    p.add_argument("--scale", type=int, help="pgbench scale (default 20; 1 with --quick)")
    p.add_argument("--contended-scale", type=int,
                   help=f"pgbench scale of {CONTENDED}: one branch row per unit, which every transaction "
                   f"updates, so 16 clients queue behind the row locks (default {CONTENDED_SCALE}; 1 with --quick). "
                   "At another scale than --scale it runs on a cluster of its own")
    p.add_argument("--bulk-mb", type=int, help="MB of WAL for bulk ingest (default 1000; 32 with --quick)")
    p.add_argument("--catchup-mb", type=int, help="MB of WAL written while a receiver is down (default 1000)")
    p.add_argument("--workdir", type=Path, help="parent of the scratch directory (default: the system's temp dir)")
    p.add_argument("--profile", nargs="?", const="wall", default="", choices=["wall", "gil"],
                   help="py-spy the walsidecar processes during pgbench and bulk ingest (OUT/profile/CONFIG): "
                   "wall-clock samples, or with 'gil' only samples of running Python code")
    p.add_argument("--keep", action="store_true", help="keep the scratch directories (data, logs)")
    p.add_argument("--no-fsync-floor", action="store_true", help="skip the pg_test_fsync measurement")
    p.add_argument("--topology", choices=TOPOLOGIES, default="box",
                   help="which CPUs each part runs on: box (default: all on every CPU), hosts (the primary and the "
                   "sidecar on the first CPU, pgbench and the receivers on the others, as separate hosts would be) or "
                   "split (the primary and pgbench on the first CPU, the receivers and the sidecar on the others). "
                   "hosts and split need 2 CPUs or more; the report says which")
    p.add_argument("--flood-priority", choices=FLOOD_PRIORITIES, default="idle",
                   help=f"how {FLOOD}'s flood is scheduled: idle (default: SCHED_IDLE, only on CPU nothing else "
                   "wants, standing in for an attacker on another host) or normal (level with the primary, pgbench "
                   "and the receivers, as an attacker on the same host)")
    a = p.parse_args(argv)
    s = Settings(out=a.out, workdir=a.workdir, profile=a.profile, keep=a.keep, quick=a.quick, topology=a.topology,
                 flood_priority=a.flood_priority)
    if a.quick:
        s.rounds, s.duration, s.scale, s.bulk_bytes, s.catchup_bytes = 1, 2.0, 1, 32 * MB, 32 * MB
        s.contended_scale = 1  # as --scale: the contended workload runs on the same cluster
        s.fsync_floor = False
    s.rounds = a.rounds if a.rounds is not None else s.rounds
    s.duration = a.duration if a.duration is not None else s.duration
    s.scale = a.scale if a.scale is not None else s.scale
    s.contended_scale = a.contended_scale if a.contended_scale is not None else s.contended_scale
    s.bulk_bytes = a.bulk_mb * MB if a.bulk_mb is not None else s.bulk_bytes
    s.catchup_bytes = a.catchup_mb * MB if a.catchup_mb is not None else s.catchup_bytes
    s.fsync_floor = s.fsync_floor and not a.no_fsync_floor
    only = [x.strip() for x in a.only.split(",") if x.strip()]
    unknown = [x for x in only if x not in CONFIGS + WORKLOADS]
    if unknown:
        p.error(f"--only: unknown {', '.join(unknown)}")
    s.configs = tuple(c for c in CONFIGS if c in only) or DEFAULT_CONFIGS
    # --quick checks the harness in under a minute: Spark's start alone would take a good part of it.
    default = tuple(w for w in WORKLOADS if not (a.quick and w == "wal-analytics"))
    if ONE_DOWN in only:
        only.append("pgbench-16")
    if FLOOD in only or IDLE_LOAD in only:
        only.append("pgbench-1")
    s.workloads = tuple(w for w in WORKLOADS if w in only) or default
    if s.rounds < 1 or s.duration <= 0 or s.scale < 1 or s.contended_scale < 1:
        p.error("--rounds, --duration, --scale and --contended-scale must be positive")
    try:
        Pinning.of(s.topology)
    except BenchError as e:
        p.error(str(e))
    return s


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    # The walsidecar processes run this checkout's code, whatever the current directory.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    # SIGTERM and SIGHUP unwind like Ctrl-C, so every process started is stopped by its PID.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        report = run(s)
    except KeyboardInterrupt:
        print("bench: interrupted; everything started was stopped", file=sys.stderr)
        return 130
    return 1 if any(r["workload"] == "error" for r in report["rounds"]) else 0


if __name__ == "__main__":
    sys.exit(main())

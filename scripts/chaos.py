#!/usr/bin/env python3
"""Lost-write checker under chaos: kill safekeepers, the sidecar and the primary, cut safekeepers off
the network, and fail over to a standby, while writers commit.

Builds its own deployment on 127.0.0.1 (a PostgreSQL 15 primary, 3 safekeepers, the proposer),
runs writer threads that record every acknowledged commit, and each round does one thing of the
kinds asked for: kill -9 of one safekeeper, kill -9 of the sidecar, an immediate-mode stop of the
primary, or a partition (one or two safekeepers' links taken down, then brought back up); then it
waits for commits to flow again. A failover round kills the primary with kill -9, runs `walsidecar
failover` on the standby (which streams from safekeeper1's reader port), starts the sidecar on the new
primary and a new standby from a base backup of it, and times the primary's death to the next
acknowledged commit. A failover-live round runs `walsidecar failover` while the old primary and its
sidecar stay alive and keep taking writes, points the writers at the new primary and starts its sidecar,
and kills the old side only then: every commit either primary acknowledged must be on the new one (a
failover that refuses promotes nothing, and the old side must go on working). `--kinds ha` and `ha-live`
run under Patroni instead (scripts/chaos_ha.py): the leader's whole node killed, or, failover-live's form
there, only its Patroni, so that Patroni promotes the other node through `walsidecar failover-gate` while
the old primary and its sidecar keep taking writes. An archive-corruption
round (the safekeepers then archive to a file:// directory, or to S3 on a moto_server) plants a same-size object of wrong bytes under the name of the segment the
primary is writing, before it can be uploaded, and flips a byte in a segment already archived; each
must be named (`check`, `verify-archive`), and no safekeeper may remove a segment whose archived
object is not its WAL. With partitions, each safekeeper runs as a separate host in a network namespace of its own (tests/support/netns.py), reached
over a veth link that is really cut. At the end every acknowledged key must be in the table and every
safekeeper's WAL must equal the primary's byte for byte.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
# Run this checkout's package, in this process and in every child it starts.
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # netns.py
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

import click  # noqa: E402
from support import netns, s3  # noqa: E402
import psycopg  # noqa: E402
from tenacity import Retrying, retry_if_exception_type, wait_exponential  # noqa: E402

from sidecar.deployment import DeploymentError, LocalDeployment, MemberExited, Standby, free_port  # noqa: E402
from sidecar.pgcluster import LocalCluster  # noqa: E402
from sidecar.processes import sidecar_argv  # noqa: E402
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, format_lsn, parse_lsn, parse_segment_file_name, segment_file_name  # noqa: E402
from sidecar.objectstore import ObjectConflict, Storage, open_storage  # noqa: E402
from sidecar.safekeeper.control import load_control  # noqa: E402
from sidecar.wal.format import WalFormatError  # noqa: E402
from sidecar.wal.verify import check_segment_wal  # noqa: E402

APP = "walsidecar"
SAFEKEEPERS = 3
KEY_STRIDE = 10**12  # writer w inserts keys (w + 1) * KEY_STRIDE + 1, + 2, ...
PROGRESS_WRITES = 50  # acknowledged writes that prove commits flow
ACTIONS = ("safekeeper", "sidecar", "primary")  # the default kinds of round
KINDS = (*ACTIONS, "partition", "failover", "failover-live", "archive-corruption")
FAILOVER_KINDS = ("failover", "failover-live")  # the kinds that need a standby
# Under Patroni (scripts/chaos_ha.py), a deployment of its own: `ha` kills the leader's whole node, `ha-live` is
# failover-live's form there (only the leader's Patroni lost, its primary taking writes while the gate promotes).
HA_KINDS = ("ha", "ha-live")
# Seconds verify-archive (Spark, started once at the end) may take: a minute or two on a loaded 2-core machine.
VERIFY_TIMEOUT = 900
PARTITION_HOLD = (1.0, 4.0)  # seconds two safekeepers stay cut off, while no commit may be acknowledged
T = TypeVar("T")
SEGMENT_NAME = re.compile(r"[0-9A-F]{24}")


class ChaosFailure(Exception):
    """A round or the final check failed; the message says what and where to look."""


class Interrupted(Exception):
    """SIGINT or SIGTERM."""


@dataclass
class Summary:
    seed: int
    kinds: str = ",".join(ACTIONS)
    rounds: int = 0
    safekeeper_kills: int = 0
    sidecar_kills: int = 0
    primary_crashes: int = 0
    partitions: int = 0
    failovers: int = 0
    archive_plants: int = 0  # same-size objects of wrong bytes put under a segment's name before its upload
    archive_flips: int = 0  # bytes flipped in objects already archived
    unverified_removals: int = 0  # segments removed from a safekeeper while the archive lacks their WAL
    failover_seconds: list[float] = field(default_factory=list)  # primary's death to the next acknowledged commit
    promotions: int = 0  # `walsidecar failover` runs that promoted the standby (both failover kinds)
    refusals: int = 0  # failover-live rounds whose `walsidecar failover` refused: nothing promoted
    old_acks: int = 0  # commits the old primary acknowledged after a failover-live's `failover` returned
    acknowledged: int = 0
    lost: int = 0
    wal_mismatches: int = 0
    unknown: int = 0
    unsafe_acks: int = 0
    seconds: float = 0.0
    result: str = "fail"
    failure: str = ""
    data_dir: str = ""
    lost_keys: list[int] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)

    def line(self) -> str:
        """The one-line summary printed last."""
        return (f"summary: rounds={self.rounds} safekeeper_kills={self.safekeeper_kills} "
                f"sidecar_kills={self.sidecar_kills} primary_crashes={self.primary_crashes} "
                f"partitions={self.partitions} failovers={self.failovers}{self._failover_times()} "
                f"promotions={self.promotions} refusals={self.refusals} old_acks={self.old_acks} "
                f"{self._archive_counts()}"
                f"acknowledged={self.acknowledged} lost={self.lost} wal_mismatches={self.wal_mismatches} "
                f"unknown={self.unknown} unsafe_acks={self.unsafe_acks} seconds={self.seconds:.1f} "
                f"seed={self.seed} kinds={self.kinds} result={self.result}")


    def _archive_counts(self) -> str:
        if "archive-corruption" not in self.kinds.split(","):
            return ""
        return f"archive_plants={self.archive_plants} archive_flips={self.archive_flips} " \
               f"unverified_removals={self.unverified_removals} "

    def _failover_times(self) -> str:
        if not self.failover_seconds:
            return ""
        return f" failover_median={statistics.median(self.failover_seconds):.2f}s " \
               f"failover_max={max(self.failover_seconds):.2f}s"


# ---- ports and WAL files ---------------------------------------------------------------------


def pick_port(taken: set[int]) -> int:
    """A free 127.0.0.1 port, none used twice in one run (deployment.free_port)."""
    try:
        return free_port(taken=taken)
    except DeploymentError as e:
        raise ChaosFailure(str(e)) from None


def read_wal(directory: Path, start: int, end: int, seg_size: int = DEFAULT_SEGMENT_SIZE) -> Iterator[bytes]:
    """Bytes [start, end) of timeline 1 from PostgreSQL-named segments (final or .partial), per segment."""
    pos = start
    while pos < end:
        segno, offset = divmod(pos, seg_size)
        path = directory / segment_file_name(1, segno, seg_size)
        if not path.exists():
            path = path.with_name(path.name + ".partial")
        try:
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read(min(end - pos, seg_size - offset))
        except FileNotFoundError:
            return
        if not chunk:
            return
        yield chunk
        pos += len(chunk)


def first_held(directory: Path, seg_size: int = DEFAULT_SEGMENT_SIZE) -> int:
    """Start of the lowest timeline-1 segment in a safekeeper's WAL directory (0 when it holds none)."""
    segnos = []
    for path in directory.glob("00000001*"):
        try:
            segnos.append(parse_segment_file_name(path.name, seg_size)[1])
        except ValueError:
            continue
    return min(segnos) * seg_size if segnos else 0


def first_difference(ours: Path, theirs: Path, start: int, end: int) -> int | None:
    """First LSN in [start, end) where the two WAL directories differ (or one ends), or None."""
    pos = start
    for a, b in zip(read_wal(ours, start, end), read_wal(theirs, start, end)):
        if a != b:
            n = min(len(a), len(b))
            return pos + next((i for i in range(n) if a[i] != b[i]), n)
        pos += len(a)
    return pos if pos < end else None


# ---- the deployment --------------------------------------------------------------------------


class Deployment(LocalDeployment):
    """A primary, three safekeepers and the proposer, each started and stopped by this script.

    With `hosts` (network namespaces, one per safekeeper) each safekeeper runs inside its own and
    listens on its address there; the primary and the proposer stay in the root namespace.
    """

    def __init__(self, base: Path, hosts: netns.Hosts | None = None, standby: bool = False,
                 link_security: str = "tls", archive: str | None = None, s3_endpoint: str | None = None) -> None:
        taken: set[int] = set()
        places = {f"safekeeper{h.index}": h for h in hosts} if hosts is not None else None
        # With an archive (a URL) the safekeepers remove WAL below backup_lsn: what archive-corruption rounds
        # test. A short takeover: a killed safekeeper 1 (the uploader by rank) leaves no long gap in a mixed run.
        self.archive, self.s3_endpoint = archive, s3_endpoint
        endpoint = ["--s3-endpoint", s3_endpoint] if s3_endpoint else []
        extra = {f"safekeeper{i}": ["--archive", archive, *endpoint, "--archive-takeover", "5"]
                 for i in range(1, SAFEKEEPERS + 1)} if archive else None
        super().__init__(base, safekeepers=SAFEKEEPERS, places=places, pick_port=lambda: pick_port(taken),
                         link_security=link_security, extra=extra)
        self.hosts = hosts
        if standby:  # for failover rounds: a standby streaming from safekeeper1's reader port
            self.add(Standby(self, LocalCluster(base / "standby", pick_port(taken), log_file=base / "standby.log")))
        self._conn: psycopg.Connection | None = None

    def bring_up(self) -> None:
        """initdb, start the primary and the children (commits wait for the sidecar from now on)."""
        self.pg.init({"synchronous_standby_names": APP})
        self.start("primary")
        with psycopg.connect(self.dsn(), autocommit=True) as c:
            # Keeps every WAL segment from before the sidecar's first term, so the final check can
            # compare all of it. (No transaction id: this does not wait for the sidecar.)
            c.execute("SELECT pg_create_physical_replication_slot('chaos_keep', true)")
        self.start_all(wait=False)
        if "standby" in self.members:
            self.wait_streaming(120)
            self.start("standby")

    # ---- observing ----

    def query(self, sql: str) -> list[tuple[Any, ...]] | None:
        """Run one query on the primary; None while it cannot be reached."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self.dsn(), autocommit=True, connect_timeout=3)
            cur = self._conn.execute(sql)
            return cur.fetchall() if cur.description else []
        except psycopg.Error:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return None

    def replication(self) -> tuple[str, int, int] | None:
        """(sync_state, flush_lsn, replay_lsn) of the sidecar's row in pg_stat_replication."""
        rows = self.query("SELECT sync_state, flush_lsn::text, replay_lsn::text FROM pg_stat_replication "
                          f"WHERE application_name = '{APP}'")
        if not rows or rows[0][1] is None:
            return None
        state, flush, replay = rows[0]
        return state, parse_lsn(flush), parse_lsn(replay) if replay else 0

    def walsender_gone(self) -> bool:
        """True once the primary has no walsender left for the sidecar (none can release commits)."""
        rows = self.query(f"SELECT count(*) FROM pg_stat_replication WHERE application_name = '{APP}'")
        return rows is not None and rows[0][0] == 0

    def wal_flush(self) -> int | None:
        """The primary's pg_current_wal_flush_lsn()."""
        rows = self.query("SELECT pg_current_wal_flush_lsn()::text")
        return parse_lsn(rows[0][0]) if rows else None

    def wal_mismatches(self, end: int) -> list[str]:
        """Safekeepers whose WAL differs from the primary's between their first term's start and end."""
        bad = []
        for i in range(1, SAFEKEEPERS + 1):
            control = load_control(self.sk_dir(i))
            if control is None or not control.state.term_history:
                bad.append(f"safekeeper {i} has no term history")
                continue
            start = control.state.term_history[0].start_lsn
            if self.archive is not None:  # what it removed (below its backup_lsn) is compared in the archive
                start = max(start, first_held(self.sk_dir(i) / "wal"))
            diff = first_difference(self.sk_dir(i) / "wal", self.pg.pg_wal_dir, start, end)
            if diff is not None:
                bad.append(f"safekeeper {i} differs from the primary at {format_lsn(diff)} "
                           f"(compared {format_lsn(start)}..{format_lsn(end)})")
        return bad

    def switch_primary(self, server: LocalCluster) -> None:
        """Make `server` (a promoted standby) the primary that queries and the sidecar's next start use."""
        self.members["primary"].server = server  # type: ignore[attr-defined]
        # The cached connection may still reach the old primary, alive in a failover-live round.
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def sk_dir(self, i: int) -> Path:
        return self.data_dir(f"safekeeper{i}")

    def check_children(self) -> None:
        """Fail if a child that should run has exited."""
        try:
            self.check_running()
        except MemberExited as e:
            raise ChaosFailure(f"{e.name} exited unexpectedly with code {e.returncode}") from e

    def mark(self, name: str, text: str) -> None:
        """Append a marker line to a member's log, to find chaos events in it."""
        with self.log_path(name).open("a") as f:  # type: ignore[union-attr]
            f.write(f"==== chaos {time.strftime('%H:%M:%S')}: {text} ====\n")

    def log_tails(self, lines: int = 25) -> str:
        parts = [f"--- {c.log_path} ---\n{c.log_tail(lines)}" for c in [*self.safekeepers.values(), self.proposer] if c]
        parts.append(f"--- {self.pg.log_file} ---\n{self.pg.log_tail(lines)}")
        return "\n".join(parts)

    # ---- stopping ----

    def close(self) -> None:
        """Stop everything this deployment started: the primary via pg_ctl, children by PID."""
        if self._conn is not None:
            self._conn.close()
        self.stop_all()
        if self.hosts is not None:
            self.hosts.close()


# ---- writers ---------------------------------------------------------------------------------


class Writer(threading.Thread):
    """Inserts unique keys, one autocommit INSERT per commit, recording acknowledged ones."""

    def __init__(self, index: int, dsn: str) -> None:
        super().__init__(name=f"writer{index}", daemon=True)
        self.dsn = dsn
        self.next_key = (index + 1) * KEY_STRIDE
        self.acked: list[int] = []
        self.times: list[tuple[float, float]] = []  # (sent, returned) of each acknowledged commit
        # The dsn that acknowledged each commit: a failover-live round has two primaries at once.
        self.where: list[str] = []
        self.connected: str | None = None  # the dsn of the open connection
        self.unknown = 0
        self.stop_event = threading.Event()
        self._syncrep_warning = False

    def _on_notice(self, diag: psycopg.errors.Diagnostic) -> None:
        # A cancelled SyncRep wait returns COMMIT with this warning: committed locally only.
        if "synchronous replication" in (diag.message_primary or ""):
            self._syncrep_warning = True

    def _connect(self) -> psycopg.Connection | None:
        """Connect, backing off from 50 ms to 1 s between attempts; None once the writer is stopped."""
        retrying = Retrying(retry=retry_if_exception_type(psycopg.Error), wait=wait_exponential(0.05, max=1.0),
                            stop=lambda _: self.stop_event.is_set(), sleep=self.stop_event.wait, reraise=True)
        try:
            # self.dsn is read at each attempt: a failover points the writers at the new primary.
            conn = retrying(self._connect_once)
        except psycopg.Error:
            return None
        conn.add_notice_handler(self._on_notice)
        return conn

    def _connect_once(self) -> psycopg.Connection:
        dsn = self.dsn
        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
        self.connected = dsn
        return conn

    def acked_on(self, dsn: str, since: float) -> int:
        """Commits sent after `since` (monotonic) that `dsn` acknowledged."""
        count, n = 0, len(self.acked)  # where and times are appended before acked: index them below n
        for i in range(n - 1, -1, -1):
            if self.times[i][0] <= since:
                break
            count += self.where[i] == dsn
        return count

    def run(self) -> None:
        conn: psycopg.Connection | None = None
        while not self.stop_event.is_set():
            if conn is None:
                conn = self._connect()
                if conn is None:
                    break
            self.next_key += 1
            self._syncrep_warning = False
            sent = time.monotonic()
            try:
                conn.execute("INSERT INTO chaos (k) VALUES (%s)", (self.next_key,))
            except psycopg.Error:
                self.unknown += 1  # it may or may not have committed
                conn.close()
                conn, self.connected = None, None
                continue
            if self._syncrep_warning:
                self.unknown += 1
            else:
                self.where.append(self.connected or "")
                self.times.append((sent, time.monotonic()))
                self.acked.append(self.next_key)
        if conn is not None:
            conn.close()
        self.connected = None


# ---- the chaos run ---------------------------------------------------------------------------


class Chaos:
    """The writers, the seeded chaos schedule and the checks."""

    def __init__(self, deployment: Deployment, summary: Summary, rounds: int, writers: int,
                 round_timeout: float, kinds: tuple[str, ...] = ACTIONS) -> None:
        self.d = deployment
        self.summary = summary
        self.rounds = rounds
        self.kinds = kinds
        self.rng = random.Random(summary.seed)
        self.round_timeout = round_timeout
        self.writers = [Writer(i, deployment.dsn()) for i in range(writers)]
        self.started = time.monotonic()  # t=0 of the times printed
        self.flipped: dict[str, int] = {}  # archived objects with a flipped bit: name -> offset

    def acked(self) -> int:
        return sum(len(w.acked) for w in self.writers)

    def acked_between(self, start: float, end: float) -> int:
        """Commits sent after `start` and acknowledged before `end` (monotonic clock)."""
        return sum(1 for w in self.writers for sent, done in w.times[-10_000:] if sent > start and done < end)

    def acked_on(self, dsn: str, since: float) -> int:
        """Commits sent after `since` (monotonic clock) and acknowledged by the server at `dsn`."""
        return sum(w.acked_on(dsn, since) for w in self.writers)

    def stop_writers(self) -> None:
        """Ask every writer to stop after its current commit (they are daemon threads)."""
        for w in self.writers:
            w.stop_event.set()

    def unknown(self) -> int:
        return sum(w.unknown for w in self.writers)

    def wait(self, predicate: Callable[[], T], timeout: float, what: str) -> T:
        """Poll until predicate() returns something truthy and return it; ChaosFailure on timeout."""
        value = self.poll(predicate, timeout)
        if not value:
            raise ChaosFailure(f"timed out after {timeout:.0f}s waiting for {what}")
        return value

    def poll(self, predicate: Callable[[], T], timeout: float, check_children: bool = True) -> T | None:
        """Poll until predicate() returns something truthy and return it; None on timeout. With
        `check_children`, ChaosFailure as soon as a child that should run has exited."""
        t0 = time.monotonic()
        while True:
            if check_children:
                self.d.check_children()
            value = predicate()
            if value:
                return value
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(0.05)

    def healthy(self, since_acked: int, target_lsn: int) -> bool:
        """Sidecar is the sync standby, every safekeeper holds target_lsn, writes flow again."""
        rep = self.d.replication()
        return (rep is not None and rep[0] == "sync" and rep[2] >= target_lsn
                and self.acked() >= since_acked + PROGRESS_WRITES)

    def run(self) -> None:
        d = self.d
        d.bring_up()
        self.wait(lambda: (r := d.replication()) is not None and r[0] == "sync", self.round_timeout,
                  "the sidecar to become the synchronous standby")
        if d.query("CREATE TABLE chaos (k bigint PRIMARY KEY)") is None:
            raise ChaosFailure("could not create the chaos table")
        for w in self.writers:
            w.start()
        self.wait(lambda: self.acked() >= PROGRESS_WRITES, self.round_timeout, "the first writes")
        for n in range(1, self.rounds + 1):
            self.round(n)
        self.finish()

    def round(self, n: int) -> None:
        d, rng, s = self.d, self.rng, self.summary
        action = rng.choice(self.kinds)
        time.sleep(rng.uniform(0.0, 0.3))
        t0 = time.monotonic()
        before = self.acked()
        if action == "safekeeper":
            i = rng.randint(1, SAFEKEEPERS)
            name = f"safekeeper{i}"
            what = f"kill -9 safekeeper {i}"
            d.kill(name)
            s.safekeeper_kills += 1
            self.wait(lambda: self.acked() >= before + PROGRESS_WRITES, self.round_timeout,
                      f"{PROGRESS_WRITES} writes with safekeeper {i} down (2 of 3 remain)")
            d.mark(name, f"round {n}: restarting after kill -9")
            d.start(name)
        elif action == "sidecar":
            what = "kill -9 sidecar"
            d.kill("proposer")
            s.sidecar_kills += 1
            self.wait(d.walsender_gone, self.round_timeout, "the primary to drop the killed sidecar's walsender")
            gone = time.monotonic()
            time.sleep(rng.uniform(0.2, 1.0))
            # Nothing can release a commit sent from now until the restart: no sync standby is left.
            unsafe = self.acked_between(gone, time.monotonic())
            if unsafe:
                s.unsafe_acks += unsafe
                raise ChaosFailure(f"{unsafe} commits were acknowledged while no sidecar was attached")
            d.mark("proposer", f"round {n}: restarting after kill -9")
            d.start("proposer")
        elif action == "partition":
            what = self.partition(n)
        elif action == "failover":
            what = self.failover(n)
        elif action == "failover-live":
            what = self.failover_live(n)
        elif action == "archive-corruption":
            what = self.archive_corruption(n)
        else:
            what = "immediate stop of the primary"
            d.kill("primary")
            s.primary_crashes += 1
            time.sleep(rng.uniform(0.2, 1.0))
            d.start("primary")
        t1 = time.monotonic()
        restarted = self.acked()
        target = self.wait(d.wal_flush, self.round_timeout, "the primary to answer")
        self.wait(lambda: self.healthy(restarted, target), self.round_timeout,
                  f"recovery after {what}: the sidecar sync again, every safekeeper at "
                  f"{format_lsn(target)} and {PROGRESS_WRITES} more writes")
        down_for, recovered = t1 - t0, time.monotonic() - t1
        # Every safekeeper holds the WAL up to target: it must already be the primary's.
        # After a failover the safekeepers' WAL goes on on the new timeline: the lost-write ledger is the check.
        bad = d.wal_mismatches(target) if not s.promotions else []
        if bad:
            s.mismatches += bad
            s.wal_mismatches = len(s.mismatches)
            raise ChaosFailure(f"WAL mismatch after round {n} ({what}): " + "; ".join(bad))
        s.rounds = n
        print(f"round {n}/{self.rounds}: {what}: {restarted - before:+d} writes in {down_for:.1f}s, "
              f"recovered in {recovered:.1f}s; acknowledged {self.acked()}, unknown {self.unknown()}",
              flush=True)

    def partition(self, n: int) -> str:
        """Cut one or two safekeepers' links under load, then heal them; returns what was done.

        With one cut off, commits go on with the other two. With two, none sent after the cut may be
        acknowledged until the links are back (the caller then waits for commits to flow again).
        """
        d, rng, s = self.d, self.rng, self.summary
        assert d.hosts is not None, "partitions need the safekeepers in network namespaces"
        cut = sorted(rng.sample(range(1, SAFEKEEPERS + 1), rng.choice((1, 2))))
        names = " and ".join(f"safekeeper {i}" for i in cut)
        for name in ["proposer", *(f"safekeeper{i}" for i in cut)]:
            d.mark(name, f"round {n}: cutting the links of {names}")
        before = self.acked()
        s.partitions += 1
        try:
            for i in cut:
                d.hosts[i].cut()
            cut_at = time.monotonic()
            if len(cut) == 1:
                self.wait(lambda: self.acked() >= before + PROGRESS_WRITES, self.round_timeout,
                          f"{PROGRESS_WRITES} writes with {names} cut off (2 of 3 reachable)")
                time.sleep(rng.uniform(*PARTITION_HOLD))  # long enough for TCP to back off
            else:
                time.sleep(rng.uniform(*PARTITION_HOLD))
                unsafe = self.acked_between(cut_at, time.monotonic())
                if unsafe:
                    s.unsafe_acks += unsafe
                    raise ChaosFailure(f"{unsafe} commits were acknowledged with {names} cut off "
                                       "(1 of 3 reachable, no quorum)")
        finally:
            for i in cut:
                d.hosts[i].heal()
        for name in ["proposer", *(f"safekeeper{i}" for i in cut)]:
            d.mark(name, f"round {n}: links of {names} healed")
        return f"partition of {names}"

    def failover(self, n: int) -> str:
        """kill -9 the primary, `walsidecar failover` to the standby, the sidecar on the new primary, and a
        new standby from a base backup of it; returns what was done. Times death to the next acknowledgement."""
        d, s = self.d, self.summary
        standby = self.ready_standby()
        old = d.pg
        d.mark("proposer", f"round {n}: kill -9 of the primary, then failover")
        died = time.monotonic()
        os.kill(old.postmaster_pid(), signal.SIGKILL)
        killed = time.monotonic()  # commits sent after this can only be acknowledged by the new primary
        d.kill("proposer")  # its primary is gone; the new primary gets its own sidecar
        proc = self.run_failover(n, standby)
        if proc.returncode != 0:
            raise ChaosFailure(f"walsidecar failover exited with {proc.returncode}: {proc.stdout[-2000:]}"
                               f"{proc.stderr[-2000:]}")
        self.promote(standby)
        self.wait(lambda: any(sent > killed for w in self.writers for sent, _ in w.times[-50:]), self.round_timeout,
                  "the first acknowledged commit on the new primary")
        s.failover_seconds.append(min(done for w in self.writers for sent, done in w.times[-10_000:] if sent > killed)
                                  - died)
        s.failovers += 1
        s.promotions += 1
        self.replace_standby(n, standby, old)
        return f"kill -9 of the primary and failover to the standby ({s.failover_seconds[-1]:.2f}s to the next " \
               "acknowledged commit)"

    def failover_live(self, n: int) -> str:
        """`walsidecar failover` to the standby while the old primary and its sidecar stay alive and the
        writers keep committing on the old primary; then the writers pointed at the new primary and its
        sidecar started, and only then the old sidecar and the old primary killed (kill -9, by PID). Every
        commit acknowledged so far, by either primary, must be on the new one. A failover that refuses
        promotes nothing: the old side goes on (the caller's recovery wait checks it does)."""
        d, s = self.d, self.summary
        standby = self.ready_standby()
        old, old_dsn, old_sidecar = d.pg, d.dsn(), d.process("proposer")
        assert old_sidecar is not None
        d.mark("proposer", f"round {n}: failover while this sidecar (pid {old_sidecar.pid}) and its primary run on")
        began = time.monotonic()
        proc = self.run_failover(n, standby)
        returned = time.monotonic()
        ran = f"failover ran from t={began - self.started:.2f}s to t={returned - self.started:.2f}s"
        if proc.returncode != 0:
            s.refusals += 1
            state = self.in_recovery(standby)
            if state is not True:
                raise ChaosFailure(f"walsidecar failover exited with {proc.returncode} and the standby "
                                   + ("cannot be asked whether it is one" if state is None
                                      else "is a primary now, beside the old one"))
            why = next((line for line in reversed(proc.stdout.splitlines()) if "failover stopped" in line),
                       f"exit code {proc.returncode}")
            if "ends at E for good" in proc.stdout:
                # It fenced before it stopped: the old timeline takes commits again only once an operator
                # lifts the fence (`failover --undo`, as its output says); the fence stopped the old sidecar.
                self.run_failover(n, standby, "--undo")
                if not old_sidecar.running:
                    d.start("proposer")
            d.mark("proposer", f"round {n}: failover refused; the old side goes on")
            return f"failover with the old side alive, refused ({why.strip()})"
        self.promote(standby)
        # The old lineage's chance to have commits acknowledged: until its primary acknowledged
        # PROGRESS_WRITES more (the hole) or the new primary's sidecar is its synchronous standby (from
        # then on the safekeepers serve the new lineage). The children are not checked: a sidecar refused
        # on the new primary must not hide what the old one acknowledged meanwhile.
        self.poll(lambda: self.acked_on(old_dsn, returned) >= PROGRESS_WRITES
                  or ((r := d.replication()) is not None and r[0] == "sync"), self.round_timeout,
                  check_children=False)
        d.mark("proposer", f"round {n}: kill -9 of the old sidecar (pid {old_sidecar.pid}) and the old primary")
        old_sidecar.kill()
        if (pid := old.postmaster_pid()) is not None:
            os.kill(pid, signal.SIGKILL)
        # Commits of the old primary still in flight end (acknowledged or not) before the ledger is read.
        if not self.poll(lambda: all(w.connected != old_dsn for w in self.writers), self.round_timeout,
                         check_children=False):
            raise ChaosFailure(f"timed out after {self.round_timeout:.0f}s waiting for every writer to leave the "
                               "killed old primary")
        late = self.acked_on(old_dsn, returned)
        s.old_acks += late
        s.promotions += 1
        self.check_ledger(f"round {n} (failover with the old side alive: {ran}; the old primary acknowledged "
                          f"{late} commits after it returned)")
        self.replace_standby(n, standby, old)
        return f"failover with the old side alive, promoted; the old primary acknowledged {late} commits after " \
               "failover returned"

    def ready_standby(self) -> Standby:
        """The standby, once it replays (a new one is made by the failover round before)."""
        standby = self.d.members["standby"]
        assert isinstance(standby, Standby)
        self.wait(lambda: self.standby_replays(standby), self.round_timeout, "the standby to replay")
        return standby

    def run_failover(self, n: int, standby: Standby, *extra: str) -> subprocess.CompletedProcess[str]:
        """`walsidecar failover` to the standby (or with `--undo`, lifting a fence), its output appended to
        failover.log."""
        d = self.d
        target = list(extra) if "--undo" in extra else ["--standby-dsn", standby.server.dsn(), *extra]
        proc = subprocess.run(
            sidecar_argv("failover", *target, "--safekeepers", ",".join(d.addresses),
                         "--reader-passfile", str(d.reader_passfile), "--timeout", "60",
                         *d.link_args("failover", "proposer")),
            capture_output=True, text=True, timeout=self.round_timeout, stdin=subprocess.DEVNULL)
        with (d.base / "failover.log").open("a") as f:
            f.write(f"==== round {n} ====\n{proc.stdout}{proc.stderr}")
        return proc

    def promote(self, standby: Standby) -> None:
        """The promoted standby is the primary: the sidecar started on it, the writers pointed at it (each
        moves at its next connection)."""
        d = self.d
        d.switch_primary(standby.server)
        d.start("proposer")
        for w in self.writers:
            w.dsn = standby.server.dsn()

    def replace_standby(self, n: int, standby: Standby, old: LocalCluster) -> None:
        """Discard the old primary's data; a new standby copies the new primary."""
        old.teardown()
        shutil.rmtree(old.data_dir, ignore_errors=True)
        base, taken = self.d.base, set()  # type: ignore[var-annotated]
        standby.server = LocalCluster(base / f"pg{n}", pick_port(taken), log_file=base / f"postgres{n}.log")
        standby.start()

    @staticmethod
    def in_recovery(standby: Standby) -> bool | None:
        """pg_is_in_recovery() of the standby; None when it cannot be asked."""
        try:
            with psycopg.connect(standby.server.dsn(), autocommit=True, connect_timeout=3) as c:
                return c.execute("SELECT pg_is_in_recovery()").fetchone()[0]
        except psycopg.Error:
            return None

    # ---- archive corruption

    def archive_corruption(self, n: int) -> str:
        """A planted object before its segment's upload, then a byte flipped in an archived one; returns what was done."""
        planted = self.plant_before_upload(n)
        flipped = self.flip_archived(n)
        return f"planted a wrong {planted} before its upload" + (f", flipped a byte in the archived {flipped}"
                                                                   if flipped else "")

    def walsidecar(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(sidecar_argv(*args), capture_output=True, text=True,
                              timeout=timeout or self.round_timeout, stdin=subprocess.DEVNULL)

    def archive_wal(self) -> Storage:
        """Where the safekeepers put segments: <archive>/<cluster>/<system id>/wal, the cluster named by the id."""
        assert self.d.archive is not None, "archive-corruption rounds need the deployment's archive"
        control = load_control(self.d.sk_dir(1))
        if control is None or not control.state.system_id:
            raise ChaosFailure("safekeeper 1 has no system id yet")
        sysid = str(control.state.system_id)
        return open_storage(self.d.archive, s3_endpoint=self.d.s3_endpoint).child(f"{sysid}/{sysid}/wal")

    def archive_args(self, wal: Storage) -> list[str]:
        """The archive as verify-archive's SOURCE (and its endpoint)."""
        return [wal.location, *(["--s3-endpoint", self.d.s3_endpoint] if self.d.s3_endpoint else [])]

    def archived(self, wal: Storage, name: str) -> bytes | None:
        return wal.read(name) if wal.head(name) is not None else None

    def backup_lsns(self) -> list[int]:
        return [c.state.backup_lsn if (c := load_control(self.d.sk_dir(i))) is not None else 0
                for i in range(1, SAFEKEEPERS + 1)]

    def archive_failures(self, name: str) -> list[str]:
        """`walsidecar check`'s FAILED archive lines naming `name`."""
        d = self.d
        out = self.walsidecar("check", "--pg-dsn", d.dsn(), "--safekeepers", ",".join(d.addresses),
                              *d.link_args("check", "client"))
        return [line for line in out.stdout.splitlines() if "FAILED" in line and "archive" in line and name in line]

    def plant_before_upload(self, n: int) -> str:
        """Put random bytes of a segment's size under the name of the segment the primary writes now; once it is
        committed whole, every safekeeper must find the object is not its WAL, say so, and keep the segment.
        Then the operator's repair (the object moved aside) must let the checked segment go up in its place."""
        d, s, seg = self.d, self.summary, DEFAULT_SEGMENT_SIZE
        wal = self.archive_wal()
        planted = self.rng.randbytes(seg)
        for _ in range(10):
            # + 1: at a segment's very end (just after a switch) pg_walfile_name names the finished one.
            name = self.wait(lambda: (r := d.query("SELECT pg_walfile_name(pg_current_wal_insert_lsn() + 1)"))
                             and r[0][0], self.round_timeout, "the primary to answer")
            try:
                # As the safekeepers write: whole at once, and never over an object already there.
                if wal.put(name, planted):
                    break
            except ObjectConflict:  # the segment was finished and uploaded meanwhile: take the next one
                continue
        else:
            raise ChaosFailure("the segment the primary writes was archived each time before it could be planted")
        segno = parse_segment_file_name(name, seg)[1]
        s.archive_plants += 1
        for i in range(1, SAFEKEEPERS + 1):
            d.mark(f"safekeeper{i}", f"round {n}: planted a wrong {name} in the archive")
        # Commits go on after the switch, so the commit position passes the planted segment's end.
        self.wait(lambda: d.query("SELECT pg_switch_wal()") is not None, self.round_timeout, "pg_switch_wal()")
        try:
            failed = self.wait(lambda: len(lines := self.archive_failures(name)) == SAFEKEEPERS and lines,
                               self.round_timeout, f"walsidecar check to name the planted {name} for every safekeeper")
        except ChaosFailure:
            self.count_adopted(name, segno)  # say also whether they took it for their WAL
            raise
        gaps = self.walsidecar("verify-archive", *self.archive_args(wal), "--gaps-only", "--safekeepers", ",".join(d.addresses),
                               *d.link_args("verify-archive", "client"))
        if gaps.returncode != 1 or name not in gaps.stdout:
            raise ChaosFailure(f"verify-archive --safekeepers did not name the planted {name} (exit "
                               f"{gaps.returncode}): {gaps.stdout[-2000:]}{gaps.stderr[-2000:]}")
        if self.count_adopted(name, segno):
            raise ChaosFailure(f"round {n}: {s.unverified[-1]}; check said: {failed[0]}")
        aside = d.base / "set-aside"
        aside.mkdir(exist_ok=True)
        # The repair docs/operations.md gives: the object moved out of the archive.
        (aside / f"{name}.round-{n}").write_bytes(wal.read(name))
        wal.delete(name)
        end = (segno + 1) * seg
        self.wait(lambda: min(self.backup_lsns()) >= end, self.round_timeout,
                  f"every safekeeper to archive past {name} ({format_lsn(end)}) once the planted object is set aside")
        if self.archived(wal, name) != (d.pg.pg_wal_dir / name).read_bytes():
            raise ChaosFailure(f"the archived {name} differs from the primary's after the repair")
        return name

    def count_adopted(self, name: str, segno: int) -> bool:
        """What a safekeeper must not do: count the planted object as its segment (backup_lsn past it) or
        remove its own copy. Counted in unverified_removals; True if any did."""
        d, s, seg = self.d, self.summary, DEFAULT_SEGMENT_SIZE
        before = len(s.unverified)
        for i, backup in enumerate(self.backup_lsns(), 1):
            held = (d.sk_dir(i) / "wal" / name).exists()
            if backup > segno * seg or not held:
                s.unverified.append(f"safekeeper {i}: backup_lsn {format_lsn(backup)} with the planted {name} in the "
                                    "archive" + ("" if held else ", segment removed"))
        s.unverified_removals = len(s.unverified)
        return len(s.unverified) > before

    def flip_archived(self, n: int) -> str | None:
        """Flip one bit of a segment every safekeeper counts as archived (checked first against the primary's copy),
        where the WAL checks can see it. The flipped objects stay until the end of the run (verify_flips)."""
        d, s, seg = self.d, self.summary, DEFAULT_SEGMENT_SIZE
        backup = min(self.backup_lsns())
        if backup < 2 * seg:
            return None
        wal = self.archive_wal()
        archived = sorted(k for k in wal.list_files() if SEGMENT_NAME.fullmatch(k) and k.startswith("00000001")
                          and parse_segment_file_name(k, seg)[1] < backup // seg and k not in self.flipped)
        if not archived:
            return None
        name = self.rng.choice(archived)
        segno = parse_segment_file_name(name, seg)[1]
        good = (d.pg.pg_wal_dir / name).read_bytes()
        data = wal.read(name)
        if data != good:
            s.unverified.append(f"{name} below every safekeeper's backup_lsn {format_lsn(backup)} is not the "
                                "primary's WAL")
            s.unverified_removals = len(s.unverified)
            raise ChaosFailure(f"round {n}: {s.unverified[-1]}")
        # A flip in the zeros after a WAL switch or in alignment padding changes no record: PostgreSQL would
        # replay such an object as well. Pick a byte the WAL checks (restore-wal's, verify-archive's) cover.
        end = len(data.rstrip(b"\0"))
        for _ in range(1000):
            offset, bit = self.rng.randrange(end), 1 << self.rng.randrange(8)
            bad = bytearray(data)
            bad[offset] ^= bit
            try:
                check_segment_wal(bytes(bad), segno * seg, seg, system_id=None, timeline=1)
            except WalFormatError:
                break
        else:
            raise ChaosFailure(f"no flipped byte of {name} fails the WAL checks")
        wal.replace(name, bytes(bad))
        s.archive_flips += 1
        self.flipped[name] = offset
        d.mark("safekeeper1", f"round {n}: flipped bit {bit:#x} at offset {offset} of the archived {name}")
        return name

    def verify_flips(self) -> None:
        """verify-archive must name every flipped object; then the operator puts the primary's copies back, so
        that the final check finds the archive whole. (Once, at the end: it runs Spark, which takes a while.)"""
        d, wal = self.d, self.archive_wal()
        names = sorted(self.flipped)
        # verify-archive names 20 problems at most: a range of segments holding 20 of the flipped ones at a time.
        for chunk in (names[i:i + 20] for i in range(0, len(names), 20)):
            out = self.walsidecar("verify-archive", *self.archive_args(wal), "--first", chunk[0], "--last", chunk[-1],
                                  "--no-progress", "--master", "local[1]", timeout=VERIFY_TIMEOUT)
            missed = [f"{name} (offset {self.flipped[name]})" for name in chunk if name not in out.stdout]
            if out.returncode != 1 or missed:
                raise ChaosFailure(f"verify-archive exited {out.returncode} and did not name the flipped "
                                   f"{', '.join(missed)}: {out.stdout[-3000:]}{out.stderr[-2000:]}")
            print(f"verify-archive named the {len(chunk)} flipped object(s) of {chunk[0]}..{chunk[-1]}: "
                  + "; ".join(line.strip() for line in out.stdout.splitlines() if "FAILED" in line or "also" in line),
                  flush=True)
        for name in self.flipped:
            wal.replace(name, (d.pg.pg_wal_dir / name).read_bytes())

    def removed_without_copy(self, end: int) -> list[str]:
        """Segments below `end` some safekeeper removed while the archive lacks them or holds other bytes than
        the primary's (which keeps every segment of the run: the chaos_keep slot)."""
        d, seg = self.d, DEFAULT_SEGMENT_SIZE
        wal = self.archive_wal()
        bad = []
        for i in range(1, SAFEKEEPERS + 1):
            control = load_control(d.sk_dir(i))
            if control is None or not control.state.term_history:
                continue
            for segno in range(control.state.term_history[0].start_lsn // seg, end // seg):
                name = segment_file_name(1, segno, seg)
                if (d.sk_dir(i) / "wal" / name).exists():
                    continue
                obj = self.archived(wal, name)
                if obj is None:
                    bad.append(f"safekeeper {i} removed {name}, which the archive lacks")
                elif obj != (d.pg.pg_wal_dir / name).read_bytes():
                    bad.append(f"safekeeper {i} removed {name}, whose archived object is not the primary's WAL")
        return bad

    @staticmethod
    def standby_replays(standby: Standby) -> bool:
        try:
            with psycopg.connect(standby.server.dsn(), autocommit=True, connect_timeout=3) as c:
                return c.execute("SELECT pg_last_wal_replay_lsn() IS NOT NULL").fetchone()[0]
        except psycopg.Error:
            return False

    def finish(self) -> None:
        """Stop writers, wait for every safekeeper, check keys and WAL."""
        d, s = self.d, self.summary
        self.stop_writers()
        for w in self.writers:
            w.join(timeout=60)
            if w.is_alive():
                raise ChaosFailure(f"{w.name} is stuck in a commit after the writers were stopped")
        s.acknowledged, s.unknown = len({k for w in self.writers for k in w.acked}), self.unknown()
        # Every acknowledged commit is below the primary's flush position once the writers stopped;
        # the commit LSN reported afterwards is at or above it.
        stopped_at = self.wait(d.wal_flush, self.round_timeout, "the primary to answer")
        end = self.wait(lambda: (r := d.replication()) is not None and r[0] == "sync" and r[1] >= stopped_at
                        and r[1], self.round_timeout, "the commit LSN to pass the last write")
        self.wait(lambda: (r := d.replication()) is not None and r[2] >= end, self.round_timeout,
                  f"every safekeeper to hold the WAL up to {format_lsn(end)}")
        acked, present = self.ledger()
        s.mismatches += d.wal_mismatches(end) if not s.promotions else []
        if d.archive is not None and not s.promotions:
            if self.flipped:
                self.verify_flips()
            s.unverified += self.removed_without_copy(end)
            s.unverified_removals = len(s.unverified)
            for u in s.unverified:
                print(f"REMOVED WITHOUT A VERIFIED COPY: {u}", file=sys.stderr)
        s.wal_mismatches = len(s.mismatches)
        if not s.mismatches and not s.promotions:
            print(f"every safekeeper's WAL equals the primary's up to the commit LSN {format_lsn(end)}; "
                  f"{len(present)} rows, {len(acked)} acknowledged", flush=True)
        for m in s.mismatches:
            print(f"WAL MISMATCH: {m}", file=sys.stderr)

    def ledger(self) -> tuple[set[int], set[int]]:
        """The acknowledged keys and the keys in the primary's table; every acknowledged key missing from
        the table is counted lost in the summary and printed."""
        s = self.summary
        acked = {k for w in self.writers for k in w.acked}  # before the query: each is visible to it
        rows = self.d.query("SELECT k FROM chaos")
        if rows is None:
            raise ChaosFailure("cannot read the chaos table from the primary")
        present = {r[0] for r in rows}
        lost = sorted(acked - present)
        s.lost, s.lost_keys = len(lost), lost[:20]
        if lost:
            print(f"LOST WRITES: {len(lost)} of {len(acked)} acknowledged keys are missing on the primary "
                  f"({self.d.dsn()}), e.g.:", file=sys.stderr)
            for k in lost[:10]:
                print(f"  key {k}: {self.acknowledgement(k)}", file=sys.stderr)
        return acked, present

    def check_ledger(self, when: str) -> None:
        """ChaosFailure when an acknowledged key is missing on the primary now."""
        self.ledger()
        if self.summary.lost:
            raise ChaosFailure(f"{self.summary.lost} acknowledged writes are missing on the new primary after {when}")

    def acknowledgement(self, key: int) -> str:
        """Which server acknowledged `key`, and when (for the lost-write report)."""
        w = self.writers[key // KEY_STRIDE - 1]
        i = w.acked.index(key)
        sent, done = w.times[i]
        return f"acknowledged by {w.where[i]} at t={done - self.started:.2f}s (sent at t={sent - self.started:.2f}s)"


def parse_kinds(text: str) -> tuple[str, ...]:
    """The --kinds list, in the order given, checked against KINDS."""
    chosen = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in chosen if k not in KINDS]
    if unknown or not chosen:
        raise click.BadParameter(f"{', '.join(unknown) or 'nothing'}: choose from {', '.join(KINDS)}",
                                 param_hint="--kinds")
    return chosen


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signal.Signals(signum).name)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rounds", type=click.IntRange(min=1), required=True, help="Chaos rounds to run.")
@click.option("--seed", type=int, default=None, help="Seed of the chaos schedule (default: random, printed).")
@click.option("--dir", "base_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the deployment lives (must not exist or be empty; default: a new /tmp dir).")
@click.option("--writers", type=click.IntRange(min=1), default=4, show_default=True, help="Writer threads.")
@click.option("--round-timeout", type=click.FloatRange(min=1), default=120, show_default=True,
              help="Seconds a round may take to recover before it counts as a failure.")
@click.option("--kinds", default=",".join(ACTIONS), show_default=True,
              help=f"Comma-separated kinds of round to choose from: {', '.join(KINDS)}; or, under Patroni "
                   "(scripts/chaos_ha.py, not mixed with those), `ha` (the leader's whole node SIGKILLed, failed over "
                   "automatically) and `ha-live` (failover-live under Patroni: only the leader's Patroni killed or "
                   "stopped, the old primary and its sidecar taking writes while the gate promotes the other node). "
                   "`partition` runs each safekeeper in a network namespace of its own (needs root and iproute2).")
@click.option("--keep", is_flag=True, help="Keep the data directory even when every check passes.")
@click.option("--link-security", type=click.Choice(["tls", "auth-only"]), default="tls", show_default=True,
              help="The safekeeper links: TLS, or auth-only (certificates checked, no encryption).")
@click.option("--archive-store", type=click.Choice(["file", "s3"]), default="file", show_default=True,
              help="With archive-corruption rounds: the safekeepers' archive, a file:// directory under the run's, or "
                   "a bucket of a moto_server this script starts on 127.0.0.1.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the summary as JSON to this file.")
def main(rounds: int, seed: int | None, base_dir: Path | None, writers: int, round_timeout: float,
         kinds: str, keep: bool, link_security: str, archive_store: str, json_file: Path | None) -> None:
    """Kill safekeepers, the sidecar and the primary, and cut safekeepers off the network, at random
    while writers commit, then check that no acknowledged write was lost and that every safekeeper's
    WAL equals the primary's. With archive-corruption rounds, also that no safekeeper removed a segment
    whose WAL the archive does not hold.

    Exits 0 when every check passed, 1 on a lost write, a WAL mismatch, a segment removed without its
    archived copy or a failed round.
    """
    ha_kinds = tuple(dict.fromkeys(k.strip() for k in kinds.split(",") if k.strip() in HA_KINDS))
    if ha_kinds:
        # Under Patroni the deployment is another one (scripts/chaos_ha.py): automatic failovers.
        others = [k.strip() for k in kinds.split(",") if k.strip() and k.strip() not in HA_KINDS]
        if others:
            raise click.BadParameter(f"the Patroni kinds ({', '.join(HA_KINDS)}) run in a deployment of their own: "
                                     f"not with {', '.join(others)}", param_hint="--kinds")
        sys.path.insert(0, str(REPO / "scripts"))
        from chaos_ha import run as run_ha
        sys.exit(run_ha(rounds, seed, base_dir, writers, round_timeout, keep, json_file, ha_kinds))
    chosen = parse_kinds(kinds)
    partitions = "partition" in chosen
    if partitions and (reason := netns.unavailable()):
        raise click.UsageError(f"--kinds partition: {reason}")
    seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    if base_dir is None:
        base = Path(tempfile.mkdtemp(prefix="walsidecar-chaos-", dir="/tmp"))
    else:
        base = base_dir.absolute()
        if base.exists() and any(base.iterdir()):
            raise click.BadParameter(f"{base} exists and is not empty", param_hint="--dir")
        base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o755)  # the postgres OS user must reach the cluster below it
    summary = Summary(seed=seed, kinds=",".join(chosen), data_dir=str(base))
    print(f"chaos: {rounds} rounds of {', '.join(chosen)}, seed {seed}, {writers} writers, in {base}", flush=True)
    t0 = time.monotonic()
    d: Deployment | None = None
    chaos: Chaos | None = None
    # Also when started with SIGINT ignored (a background job of a script): Ctrl-C must clean up.
    old_int = signal.signal(signal.SIGINT, _raise_interrupted)
    old_term = signal.signal(signal.SIGTERM, _raise_interrupted)
    code = 1
    hosts: netns.Hosts | None = None
    servers = contextlib.ExitStack()  # moto_server, stopped by its PID however the run ends
    try:
        if partitions:
            hosts = netns.Hosts(SAFEKEEPERS)
            print("chaos: safekeepers run in network namespaces at "
                  + ", ".join(f"{h.namespace} ({h.address})" for h in hosts), flush=True)
        archive, endpoint = None, None
        if "archive-corruption" in chosen and archive_store == "s3":
            os.environ.update(s3.AWS_ENV)  # dummy credentials, inherited by the safekeepers and the tools
            os.environ.pop("AWS_ENDPOINT_URL", None)
            endpoint = servers.enter_context(s3.moto_server(base))
            s3.make_bucket(endpoint, "chaos")
            archive = "s3://chaos/archive"
            print(f"chaos: the archive is s3://chaos/archive at {endpoint} (moto_server)", flush=True)
        elif "archive-corruption" in chosen:
            archive = f"file://{base / 'archive'}"
        d = Deployment(base, hosts, standby=any(k in chosen for k in FAILOVER_KINDS), link_security=link_security,
                       archive=archive, s3_endpoint=endpoint)
        chaos = Chaos(d, summary, rounds, writers, round_timeout, chosen)
        chaos.run()
        ok = summary.lost == 0 and summary.wal_mismatches == 0 and summary.unsafe_acks == 0 \
            and summary.unverified_removals == 0
        summary.result = "ok" if ok else "fail"
        code = 0 if ok else 1
    except ChaosFailure as e:
        summary.failure = str(e)
        print(f"CHAOS FAILURE: {e}", file=sys.stderr)
        if d is not None:
            print(d.log_tails(), file=sys.stderr)
    except (KeyboardInterrupt, Interrupted):
        summary.failure = summary.result = "interrupted"
        print("chaos: interrupted; stopping everything", file=sys.stderr)
        code = 130
    except Exception as e:  # a primary that fails to start, a full disk, a bug here: still clean up
        summary.failure = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        print(f"CHAOS ERROR: {summary.failure}", file=sys.stderr)
        if d is not None:
            print(d.log_tails(), file=sys.stderr)
    finally:
        # Cleanup must not be cut short by a second Ctrl-C; children run in their own sessions.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if chaos is not None:
            chaos.stop_writers()
            summary.acknowledged = summary.acknowledged or chaos.acked()
            summary.unknown = summary.unknown or chaos.unknown()
        if d is not None:
            d.close()
        servers.close()
        if hosts is not None:
            hosts.close()  # again, in case the deployment was never made
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    summary.seconds = time.monotonic() - t0
    if json_file is not None:
        json_file.write_text(json.dumps(asdict(summary), indent=2) + "\n")
    if code == 0 and not keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"chaos: data and logs kept in {base}", flush=True)
    print(summary.line(), flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()

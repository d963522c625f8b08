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
acknowledged commit. With partitions, each safekeeper runs as a separate host in a
network namespace of its own (tests/support/netns.py), reached over a veth link that is really cut.
At the end every acknowledged key must be in the table and every safekeeper's WAL must equal the
primary's byte for byte.
"""

from __future__ import annotations

import json
import os
import random
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
from support import netns  # noqa: E402
import psycopg  # noqa: E402
from tenacity import Retrying, retry_if_exception_type, wait_exponential  # noqa: E402

from sidecar.deployment import DeploymentError, LocalDeployment, MemberExited, Standby, free_port  # noqa: E402
from sidecar.pgcluster import LocalCluster  # noqa: E402
from sidecar.processes import sidecar_argv  # noqa: E402
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, format_lsn, parse_lsn, segment_file_name  # noqa: E402
from sidecar.safekeeper.control import load_control  # noqa: E402

APP = "walsidecar"
SAFEKEEPERS = 3
KEY_STRIDE = 10**12  # writer w inserts keys (w + 1) * KEY_STRIDE + 1, + 2, ...
PROGRESS_WRITES = 50  # acknowledged writes that prove commits flow
ACTIONS = ("safekeeper", "sidecar", "primary")  # the default kinds of round
KINDS = (*ACTIONS, "partition", "failover")
PARTITION_HOLD = (1.0, 4.0)  # seconds two safekeepers stay cut off, while no commit may be acknowledged
T = TypeVar("T")


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
    failover_seconds: list[float] = field(default_factory=list)  # primary's death to the next acknowledged commit
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

    def line(self) -> str:
        """The one-line summary printed last."""
        return (f"summary: rounds={self.rounds} safekeeper_kills={self.safekeeper_kills} "
                f"sidecar_kills={self.sidecar_kills} primary_crashes={self.primary_crashes} "
                f"partitions={self.partitions} failovers={self.failovers}{self._failover_times()} "
                f"acknowledged={self.acknowledged} lost={self.lost} wal_mismatches={self.wal_mismatches} "
                f"unknown={self.unknown} unsafe_acks={self.unsafe_acks} seconds={self.seconds:.1f} "
                f"seed={self.seed} kinds={self.kinds} result={self.result}")


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
                 link_security: str = "tls") -> None:
        taken: set[int] = set()
        places = {f"safekeeper{h.index}": h for h in hosts} if hosts is not None else None
        super().__init__(base, safekeepers=SAFEKEEPERS, places=places, pick_port=lambda: pick_port(taken),
                         link_security=link_security)
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
            diff = first_difference(self.sk_dir(i) / "wal", self.pg.pg_wal_dir, start, end)
            if diff is not None:
                bad.append(f"safekeeper {i} differs from the primary at {format_lsn(diff)} "
                           f"(compared {format_lsn(start)}..{format_lsn(end)})")
        return bad

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
            conn = retrying(lambda: psycopg.connect(self.dsn, autocommit=True, connect_timeout=5))
        except psycopg.Error:
            return None
        conn.add_notice_handler(self._on_notice)
        return conn

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
                conn = None
                continue
            if self._syncrep_warning:
                self.unknown += 1
            else:
                self.times.append((sent, time.monotonic()))
                self.acked.append(self.next_key)
        if conn is not None:
            conn.close()


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

    def acked(self) -> int:
        return sum(len(w.acked) for w in self.writers)

    def acked_between(self, start: float, end: float) -> int:
        """Commits sent after `start` and acknowledged before `end` (monotonic clock)."""
        return sum(1 for w in self.writers for sent, done in w.times[-10_000:] if sent > start and done < end)

    def stop_writers(self) -> None:
        """Ask every writer to stop after its current commit (they are daemon threads)."""
        for w in self.writers:
            w.stop_event.set()

    def unknown(self) -> int:
        return sum(w.unknown for w in self.writers)

    def wait(self, predicate: Callable[[], T], timeout: float, what: str) -> T:
        """Poll until predicate() returns something truthy and return it; ChaosFailure on timeout."""
        t0 = time.monotonic()
        while True:
            self.d.check_children()
            value = predicate()
            if value:
                return value
            if time.monotonic() - t0 > timeout:
                raise ChaosFailure(f"timed out after {timeout:.0f}s waiting for {what}")
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
        bad = d.wal_mismatches(target) if not s.failovers else []
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
        standby = d.members["standby"]
        assert isinstance(standby, Standby)
        self.wait(lambda: self.standby_replays(standby), self.round_timeout, "the standby to replay")
        old = d.pg
        d.mark("proposer", f"round {n}: kill -9 of the primary, then failover")
        died = time.monotonic()
        os.kill(old.postmaster_pid(), signal.SIGKILL)
        killed = time.monotonic()  # commits sent after this can only be acknowledged by the new primary
        d.kill("proposer")  # its primary is gone; the new primary gets its own sidecar
        proc = subprocess.run(
            sidecar_argv("failover", "--standby-dsn", standby.server.dsn(), "--safekeepers", ",".join(d.addresses),
                         "--reader-passfile", str(d.reader_passfile), "--timeout", "60",
                         *d.link_args("failover", "proposer")),
            capture_output=True, text=True, timeout=self.round_timeout, stdin=subprocess.DEVNULL)
        with (d.base / "failover.log").open("a") as f:
            f.write(f"==== round {n} ====\n{proc.stdout}{proc.stderr}")
        if proc.returncode != 0:
            raise ChaosFailure(f"walsidecar failover exited with {proc.returncode}: {proc.stdout[-2000:]}"
                               f"{proc.stderr[-2000:]}")
        # The standby is the primary now; the old one's data is discarded, a new standby copies the new one.
        d.members["primary"].server, new = standby.server, standby.server  # type: ignore[attr-defined]
        d.start("proposer")
        for w in self.writers:
            w.dsn = new.dsn()
        self.wait(lambda: any(sent > killed for w in self.writers for sent, _ in w.times[-50:]), self.round_timeout,
                  "the first acknowledged commit on the new primary")
        s.failover_seconds.append(min(done for w in self.writers for sent, done in w.times[-10_000:] if sent > killed)
                                  - died)
        s.failovers += 1
        old.teardown()
        shutil.rmtree(old.data_dir, ignore_errors=True)
        taken: set[int] = set()
        standby.server = LocalCluster(d.base / f"pg{n}", pick_port(taken), log_file=d.base / f"postgres{n}.log")
        standby.start()
        return f"kill -9 of the primary and failover to the standby ({s.failover_seconds[-1]:.2f}s to the next " \
               "acknowledged commit)"

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
        acked = {k for w in self.writers for k in w.acked}
        s.acknowledged, s.unknown = len(acked), self.unknown()
        # Every acknowledged commit is below the primary's flush position once the writers stopped;
        # the commit LSN reported afterwards is at or above it.
        stopped_at = self.wait(d.wal_flush, self.round_timeout, "the primary to answer")
        end = self.wait(lambda: (r := d.replication()) is not None and r[0] == "sync" and r[1] >= stopped_at
                        and r[1], self.round_timeout, "the commit LSN to pass the last write")
        self.wait(lambda: (r := d.replication()) is not None and r[2] >= end, self.round_timeout,
                  f"every safekeeper to hold the WAL up to {format_lsn(end)}")
        rows = d.query("SELECT k FROM chaos")
        if rows is None:
            raise ChaosFailure("cannot read the chaos table from the primary")
        present = {r[0] for r in rows}
        lost = sorted(acked - present)
        s.lost, s.lost_keys = len(lost), lost[:20]
        s.mismatches += d.wal_mismatches(end) if not s.failovers else []
        s.wal_mismatches = len(s.mismatches)
        if not s.mismatches:
            print(f"every safekeeper's WAL equals the primary's up to the commit LSN {format_lsn(end)}; "
                  f"{len(present)} rows, {len(acked)} acknowledged", flush=True)
        for m in s.mismatches:
            print(f"WAL MISMATCH: {m}", file=sys.stderr)
        if lost:
            print(f"LOST WRITES: {len(lost)} acknowledged keys are missing, e.g. {lost[:20]}", file=sys.stderr)


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
              help=f"Comma-separated kinds of round to choose from: {', '.join(KINDS)}. "
                   "`partition` runs each safekeeper in a network namespace of its own (needs root and iproute2).")
@click.option("--keep", is_flag=True, help="Keep the data directory even when every check passes.")
@click.option("--link-security", type=click.Choice(["tls", "auth-only"]), default="tls", show_default=True,
              help="The safekeeper links: TLS, or auth-only (certificates checked, no encryption).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the summary as JSON to this file.")
def main(rounds: int, seed: int | None, base_dir: Path | None, writers: int, round_timeout: float,
         kinds: str, keep: bool, link_security: str, json_file: Path | None) -> None:
    """Kill safekeepers, the sidecar and the primary, and cut safekeepers off the network, at random
    while writers commit, then check that no acknowledged write was lost and that every safekeeper's
    WAL equals the primary's.

    Exits 0 when every check passed, 1 on a lost write, a WAL mismatch or a failed round.
    """
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
    try:
        if partitions:
            hosts = netns.Hosts(SAFEKEEPERS)
            print("chaos: safekeepers run in network namespaces at "
                  + ", ".join(f"{h.namespace} ({h.address})" for h in hosts), flush=True)
        d = Deployment(base, hosts, standby="failover" in chosen, link_security=link_security)
        chaos = Chaos(d, summary, rounds, writers, round_timeout, chosen)
        chaos.run()
        ok = summary.lost == 0 and summary.wal_mismatches == 0 and summary.unsafe_acks == 0
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

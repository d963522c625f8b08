"""Crash scenarios end to end: a real primary, three safekeeper processes and the sidecar on 127.0.0.1."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psycopg
import pytest

from support.backends import PgServer
from support.deployment import APP, Deployment, Writer, syncrep_waiters, wal_matches_primary
from support.helpers import wait_for
from support.procs import ManagedProcess, ProcessTracker
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, parse_lsn
from sidecar.safekeeper.control import load_control

pytestmark = pytest.mark.integration

SK = (1, 2, 3)


def oldest_primary_lsn(d: Deployment) -> int:
    """Start of the oldest segment still in the primary's pg_wal (checkpoints recycle older ones)."""
    segs = [int(p.name[8:16], 16) * 0x100000000 // DEFAULT_SEGMENT_SIZE + int(p.name[16:24], 16)
            for p in d.pg.pg_wal_dir.iterdir() if re.fullmatch(r"[0-9A-F]{24}", p.name)]
    return min(segs) * DEFAULT_SEGMENT_SIZE


def compare_start(d: Deployment) -> int:
    """Where byte comparisons with the primary can begin: the first term's start, if still on the primary."""
    return max(d.history_start(1), oldest_primary_lsn(d))


def terms(d: Deployment) -> list[int]:
    return [d.term(i) for i in SK]


def current_term_start(d: Deployment, i: int) -> int | None:
    """Where safekeeper i's current term starts, once it has adopted that term's history."""
    state = load_control(d.sk_dir(i)).state
    last = state.term_history[-1] if state.term_history else None
    return last.start_lsn if last is not None and last.term == state.term else None


class HugeRecords(threading.Thread):
    """Emits 48 MB non-transactional logical messages back to back; `in_flight` is the insert
    position read just before the current one (None between statements)."""

    # Large enough that inserting one outlasts the poll and the immediate stop, even on a
    # loaded machine: the crash must land while the record is still incomplete.
    SIZE = 48 << 20

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.in_flight: int | None = None
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                while not self.stop_event.is_set():
                    self.in_flight = parse_lsn(c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
                    c.execute("SELECT pg_logical_emit_message(false, 'h', repeat('h', %s))", (self.SIZE,))
                    self.in_flight = None
        except psycopg.Error:
            pass  # the crash


def crash_inside_a_huge_record(d: Deployment, huge: HugeRecords, timeout: float = 20) -> int:
    """Crash the primary once the safekeepers hold part of a record still being inserted.

    Returns the write position (highest safekeeper flush) seen just before the crash.
    """
    with psycopg.connect(d.pg.dsn(), autocommit=True) as c:
        def inside() -> int:
            start = huge.in_flight
            row = c.execute("SELECT write_lsn::text FROM pg_stat_replication WHERE application_name = %s",
                            (APP,)).fetchone()
            written = parse_lsn(row[0]) if row and row[0] else 0
            # 2 MB past the position read before the statement: inside the 48 MB record (the
            # concurrent Writer adds a few hundred bytes per commit, far less meanwhile).
            return written if start is not None and written > start + (2 << 20) else 0

        written = wait_for(inside, timeout=timeout, interval=0.002, what="safekeepers to hold part of a huge record")
    d.pg.crash()
    return written


def test_primary_crash_mid_record_starts_a_new_term_and_cuts_the_torn_tail(
        pg_factory: Callable[..., PgServer], procs: ProcessTracker, test_dir: Path) -> None:
    """Immediate stop while the safekeepers hold the first part of a multi-page record.

    The safekeepers' votes report the end of the last complete record, the new term starts
    there and `Elected` cuts the partial record; the restarted primary then streams its own
    bytes from that point. No acknowledged commit may be missing after any restart.
    """
    # Tiny WAL buffers and an eager WAL writer: a big record's first pages reach pg_wal, and so
    # the safekeepers, while the backend is still inserting the rest of it.
    pg: PgServer = pg_factory(settings={"synchronous_standby_names": APP, "wal_buffers": "64kB",
                                        "wal_writer_delay": "10ms"})
    d = Deployment(pg, procs, test_dir)
    d.start_all()
    torn = 0
    writers: list[Writer] = []
    for cycle in range(4):
        if cycle >= 2 and torn:
            break
        with d.sql() as c:
            c.execute(f"CREATE TABLE load{cycle} (id int, pad text)")
        writer, huge = Writer(d.pg.dsn(), table=f"load{cycle}"), HugeRecords(d.pg.dsn())
        writers.append(writer)
        writer.start()
        wait_for(lambda: len(writer.acked) >= 20, timeout=30, what=f"commits before crash {cycle}")
        huge.start()
        term_before = max(terms(d))
        written = crash_inside_a_huge_record(d, huge)
        for t in (writer, huge):
            t.join(timeout=30)
            assert not t.is_alive(), "a writer survived the crash"
        assert writer.error is not None, "the writer must have seen the crash"

        d.pg.start()
        # Same sidecar process: its stream ended with the primary; it reattaches and runs a new term.
        d.wait_sync()
        wait_for(lambda: min(terms(d)) > term_before, timeout=30,
                 what=f"a term above {term_before} on every safekeeper after crash {cycle}")
        # The term is persisted at the vote, the history at Elected, a moment later.
        term_start = wait_for(lambda: current_term_start(d, 1), timeout=30, what="the new term's history")
        # The new term starts at a record boundary below bytes a quorum had flushed: those were
        # the torn record's first part, cut on every safekeeper by Elected.
        torn += term_start < written
        with d.sql() as c:
            for n, w in enumerate(writers):
                ids = {r[0] for r in c.execute(f"SELECT id FROM load{n}")}
                assert set(w.acked) <= ids, f"acknowledged commits lost: {sorted(set(w.acked) - ids)[:10]}"

    assert torn, "no crash hit a record the safekeepers partly held: the scenario was not exercised"
    with d.sql() as c:
        c.execute("SELECT pg_logical_emit_message(true, 'p', repeat('x', 100000))")
        c.execute("INSERT INTO load0 VALUES (-1, 'after the last restart')")
    end = d.flush_lsn()
    start = compare_start(d)
    for i in SK:
        wait_for(lambda: wal_matches_primary(d, i, start, end), timeout=30,
                 what=f"safekeeper {i} to equal the primary's WAL from {start:X} up to {end:X}")


class FlushSampler(threading.Thread):
    """Samples pg_stat_replication.flush_lsn of the sidecar on one connection until stopped."""

    def __init__(self, d: Deployment) -> None:
        super().__init__(daemon=True)
        self.dsn = d.pg.dsn()
        self.samples: list[int] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            while not self.stop_event.wait(0.01):
                row = c.execute("SELECT flush_lsn::text FROM pg_stat_replication WHERE application_name = %s",
                                (APP,)).fetchone()
                if row and row[0]:
                    self.samples.append(parse_lsn(row[0]))

    def stop(self) -> list[int]:
        self.stop_event.set()
        self.join(timeout=10)
        return self.samples


@dataclass
class Committer:
    """One INSERT transaction in its own thread.

    `before_commit` is the insert position just before COMMIT (its commit record starts at or
    above it), `done_at` when COMMIT returned and `flush_after` the sidecar's reported flush
    read right after that.
    """

    dsn: str
    row_id: int
    rows: int = 1  # rows of 500 bytes in the same transaction
    before_commit: int = 0
    done_at: float | None = None
    flush_after: int = 0
    error: BaseException | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                with c.transaction():
                    c.execute("INSERT INTO load SELECT %s, repeat('w', 500) FROM generate_series(1, %s::int)",
                              (self.row_id, self.rows))
                    lsn = c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
                    self.before_commit = parse_lsn(lsn)
                self.done_at = time.monotonic()
                row = c.execute("SELECT flush_lsn::text FROM pg_stat_replication WHERE application_name = %s",
                                (APP,)).fetchone()
                self.flush_after = parse_lsn(row[0]) if row and row[0] else 0
        except psycopg.Error as e:
            self.error = e


def test_quorum_loss_holds_every_commit_until_the_quorum_returns(deployment: Deployment) -> None:
    """Without a quorum concurrent commits all wait in SyncRep and flush_lsn stands still."""
    d = deployment
    sampler = FlushSampler(d)
    sampler.start()
    d.safekeepers[2].kill9()
    d.safekeepers[3].kill9()
    committers = [Committer(d.pg.dsn(), n) for n in range(1, 7)]
    wait_for(lambda: syncrep_waiters(d) >= len(committers), timeout=30, what="every commit to wait in SyncRep")
    with d.sql() as c:
        local_flush = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
    reported = d.flush_lsn()
    assert reported < local_flush, "the waiting commit records must lie above the reported flush"

    # Bounded wait: show that nothing is acknowledged and the reported flush does not move.
    time.sleep(2)
    assert all(c.done_at is None and c.error is None for c in committers), "a commit returned without a quorum"
    assert syncrep_waiters(d) == len(committers)
    assert d.flush_lsn() == reported, "flush_lsn moved with one safekeeper of three"

    quorum_back = time.monotonic()
    d.start_safekeeper(3)
    for c in committers:
        c.thread.join(timeout=30)
        assert c.error is None, c.error
        assert c.done_at is not None, f"commit {c.row_id} still waits after the quorum returned"
        assert c.done_at > quorum_back
        # A commit returns only once the quorum flush has passed its commit record.
        assert c.flush_after > c.before_commit, (c.row_id, c.before_commit, c.flush_after)
    assert d.flush_lsn() >= local_flush
    samples = sampler.stop()
    assert samples and samples[0] <= reported < samples[-1]
    assert samples == sorted(samples), "pg_stat_replication.flush_lsn went backwards"
    with d.sql() as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM load ORDER BY id")]
    assert ids == [c.row_id for c in committers]


def test_second_sidecar_waits_for_the_lock_and_takes_over(deployment: Deployment) -> None:
    """A second sidecar on the same primary waits without fencing the first, then takes over."""
    d = deployment
    writer = Writer(d.pg.dsn())
    writer.start()
    wait_for(lambda: len(writer.acked) >= 20, timeout=30, what="commits through the first sidecar")
    first = d.proposer
    assert first is not None
    terms_before = terms(d)
    with d.sql() as c:
        walsender = c.execute("SELECT pid FROM pg_stat_replication WHERE application_name = %s", (APP,)).fetchone()
    second = d.start_proposer()
    wait_for(lambda: "holds the lock on this primary; waiting" in second.log_text(), timeout=30,
             what="the second sidecar to wait for the advisory lock")

    # Bounded wait: while the second waits, the first keeps the term and commits keep completing.
    seen = len(writer.acked)
    time.sleep(3)
    assert len(writer.acked) > seen + 20, "commits stalled while a second sidecar waited"
    assert second.is_running() and first.is_running()
    assert terms(d) == terms_before, "the waiting sidecar changed the safekeepers' term"
    with d.sql() as c:
        row = c.execute("SELECT pid, sync_state FROM pg_stat_replication WHERE application_name = %s",
                        (APP,)).fetchone()
    assert row == (walsender[0], "sync"), "the first sidecar is no longer the synchronous standby"
    assert "elected" not in second.log_text()

    first.kill9()
    wait_for(lambda: min(terms(d)) > max(terms_before), timeout=30, what="the second sidecar's term")
    d.wait_sync()
    seen = len(writer.acked)
    wait_for(lambda: len(writer.acked) >= seen + 50, timeout=30, what="commits through the second sidecar")
    acked = writer.stop()
    assert writer.error is None, writer.error
    assert "streaming" in second.log_text()
    end = d.flush_lsn()
    start = compare_start(d)
    for i in SK:
        wait_for(lambda: wal_matches_primary(d, i, start, end), timeout=30,
                 what=f"safekeeper {i} to equal the primary's WAL up to {end:X}")
    with d.sql() as c:
        assert {r[0] for r in c.execute("SELECT id FROM load")} >= set(acked)


ELECTED = re.compile(r"elected\s.*?start_lsn=(\S+) term=(\d+) truncate_lsn=(\S+)")


def elected_lines(text: str) -> list[tuple[int, int, int]]:
    """(term, start_lsn, truncate_lsn) of every `elected` line in a safekeeper's log."""
    return [(int(t), parse_lsn(s), parse_lsn(cut)) for s, t, cut in ELECTED.findall(text)]


def replication_write_lsn(d: Deployment) -> int:
    """Highest position any safekeeper flushed in the current term (the sidecar's `write`)."""
    with d.sql() as c:
        row = c.execute("SELECT write_lsn::text FROM pg_stat_replication WHERE application_name = %s",
                        (APP,)).fetchone()
    return parse_lsn(row[0]) if row and row[0] else 0


def test_safekeeper_with_a_stale_tail_is_cut_at_the_divergence_point(deployment: Deployment) -> None:
    """A safekeeper that alone holds unacknowledged WAL of an old term misses two terms, then returns.

    Only a stock primary writes WAL, so the stale tail's bytes are the ones the primary kept (it
    never lost them): they are identical to the primary's. What differs is their term: the
    others hold that range as WAL of a later term, so the returning safekeeper must still cut
    at that term's start and take the range again. The test proves that cut and convergence.
    """
    d = deployment
    with d.sql() as c:
        c.execute("INSERT INTO load SELECT g, 'before' FROM generate_series(1, 100) g")
    d.safekeepers[2].kill9()
    d.safekeepers[3].kill9()
    # About 1 MB that only safekeeper 1 receives: never acknowledged, so its commit waits.
    hanging = Committer(d.pg.dsn(), 0, rows=2000)
    wait_for(lambda: syncrep_waiters(d) >= 1, timeout=30, what="the commit to wait in SyncRep")
    stale_end = wait_for(lambda: (w := replication_write_lsn(d)) > d.flush_lsn() and w, timeout=30,
                         what="safekeeper 1 to hold WAL beyond the reported flush")
    stale_term = d.term(1)
    d.proposer.kill9()
    d.safekeepers[1].kill9()
    assert hanging.done_at is None, "a commit returned with one safekeeper of three"

    # Two more terms without safekeeper 1, with writes in each.
    d.start_safekeeper(2)
    d.start_safekeeper(3)
    for n in range(2):
        d.start_proposer()
        d.wait_sync()
        with d.sql() as c:
            c.execute("INSERT INTO load SELECT g, repeat('n', 200) FROM generate_series(%s::int, %s::int) g",
                      (10_000 * (n + 1), 10_000 * (n + 1) + 500))
        if n == 0:
            d.proposer.kill9()
    hanging.thread.join(timeout=30)
    assert hanging.done_at is not None, "the waiting commit completes in the new term"
    term_starts = {e.term: e.start_lsn for e in load_control(d.sk_dir(2)).state.term_history}
    later = sorted(t for t in term_starts if t > stale_term)
    assert len(later) >= 2, f"safekeeper 1 must miss at least two terms: {term_starts}"
    divergence = term_starts[later[0]]
    assert divergence < stale_end, "the stale tail must reach past the next term's start"

    returning = d.start_safekeeper(1)
    opened = wait_for(lambda: re.search(r"safekeeper opened .*?flush_lsn=(\S+)", returning.log_text()),
                      timeout=30, what="safekeeper 1 to scan its WAL")
    assert parse_lsn(opened[1]) > divergence, "safekeeper 1 must come back holding WAL past the divergence point"
    current = max(terms(d))
    wait_for(lambda: d.term(1) == current, timeout=30, what="safekeeper 1 to join the current term")
    cuts = wait_for(lambda: [e for e in elected_lines(d.safekeepers[1].log_text()) if e[0] == current],
                    timeout=30, what="safekeeper 1 to log its election in the current term")
    assert cuts[-1][2] == divergence, f"safekeeper 1 was cut at {cuts[-1][2]:X}, not at {divergence:X}"
    # The log line precedes the control file write: poll for the adopted history.
    wait_for(lambda: load_control(d.sk_dir(1)).state.term_history == load_control(d.sk_dir(2)).state.term_history,
             timeout=30, what="safekeeper 1 to persist the current term's history")

    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (-1, 'after the return')")
    end = d.flush_lsn()
    start = compare_start(d)
    for i in SK:
        wait_for(lambda: wal_matches_primary(d, i, start, end), timeout=30,
                 what=f"safekeeper {i} to equal the primary's WAL up to {end:X}")


@dataclass(frozen=True)
class SafekeeperSnapshot:
    """Everything an election could change on one safekeeper: WAL files and the control state."""

    files: dict[str, bytes]
    term: int
    term_history: tuple
    commit_lsn: int


def snapshot(d: Deployment, i: int) -> SafekeeperSnapshot:
    wal = d.sk_dir(i) / "wal"
    state = load_control(d.sk_dir(i)).state
    return SafekeeperSnapshot({p.name: p.read_bytes() for p in sorted(wal.iterdir())}, state.term,
                              state.term_history, state.commit_lsn)


def assert_unchanged(before: dict[int, SafekeeperSnapshot], d: Deployment) -> None:
    """Every safekeeper's WAL files, term history and commit_lsn are as before; the term too."""
    for i, old in before.items():
        new = snapshot(d, i)
        assert new.files.keys() == old.files.keys(), f"safekeeper {i}'s WAL files changed"
        for name, data in old.files.items():
            assert new.files[name] == data, f"safekeeper {i}'s {name} changed"
        assert (new.term_history, new.commit_lsn) == (old.term_history, old.commit_lsn), f"safekeeper {i}"
    for i, old in before.items():
        # The pre-vote probe promises nothing: a refused primary must not even raise the term.
        assert snapshot(d, i).term == old.term, (
            f"safekeeper {i}'s persisted term changed from {old.term} to {snapshot(d, i).term} although "
            "the primary was refused: the pre-vote probe should have stopped before any VoteRequest")


def wait_exit(proc: ManagedProcess, timeout: float = 30) -> int:
    """The exit status of a process expected to stop by itself."""
    wait_for(lambda: not proc.is_running(), timeout=timeout, what=f"{proc.name} to exit")
    return proc.returncode


def test_primary_restored_from_an_older_copy_is_refused(deployment: Deployment) -> None:
    """A primary without WAL the quorum committed: the sidecar exits, the safekeepers are untouched."""
    d = deployment
    d.pg.stop()
    old_copy = d.base / "pg-old-copy"
    # As root, cp -a keeps the postgres owner and modes the server insists on.
    subprocess.run(["cp", "-a", str(d.pg.data_dir), str(old_copy)], check=True)
    d.pg.start()
    d.wait_sync()
    with d.sql() as c:
        c.execute("INSERT INTO load SELECT g, repeat('n', 500) FROM generate_series(1, 20000) g")
    ahead = d.flush_lsn()

    d.pg.stop()
    d.proposer.kill9()
    for i in SK:
        d.safekeepers[i].kill9()
    shutil.rmtree(d.pg.data_dir)
    subprocess.run(["cp", "-a", str(old_copy), str(d.pg.data_dir)], check=True)
    d.pg.start()
    with d.sql() as c:
        restored = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
    assert restored < ahead
    for i in SK:
        d.start_safekeeper(i)
    for i in SK:  # a safekeeper that is listening has finished scanning its WAL
        wait_for(lambda: "listening" in d.safekeepers[i].log_text(), timeout=30, what=f"safekeeper {i} up")
    before = {i: snapshot(d, i) for i in SK}

    # E: the end of the most advanced safekeeper's WAL, as each found it on start.
    quorum_end = max(parse_lsn(re.search(r"safekeeper opened .*?flush_lsn=(\S+)", d.safekeepers[i].log_text())[1])
                     for i in SK)
    assert quorum_end >= ahead

    proposer = d.start_proposer()
    assert wait_exit(proposer) != 0, "the sidecar must not stream from a primary that lacks committed WAL"
    out = proposer.log_text()
    m = re.search(r"refusing to stream: the primary lacks quorum-committed WAL between (\S+) and (\S+):", out)
    assert m, out
    assert restored <= parse_lsn(m[1]) < parse_lsn(m[2]) == quorum_end, m[0]
    assert_unchanged(before, d)


def test_primary_of_another_cluster_is_refused(deployment: Deployment, pg_factory: Callable[..., PgServer]) -> None:
    """Safekeepers of one cluster refuse another cluster's primary; the sidecar says so and exits."""
    d = deployment
    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (1, 'x')")
    # The commit needed only two safekeepers: let the third catch up too, so the snapshot is
    # of a settled state and not of one still being written.
    end, start = d.flush_lsn(), d.history_start(1)
    for i in SK:
        wait_for(lambda: wal_matches_primary(d, i, start, end), timeout=30, what=f"safekeeper {i} to catch up")
    d.proposer.kill9()
    before = {i: snapshot(d, i) for i in SK}
    other: PgServer = pg_factory(name="other", settings={"synchronous_standby_names": APP})
    proposer = d.procs.start(
        [sys.executable, "-m", "sidecar", "start", "--pg-dsn", other.dsn(), "--safekeepers", ",".join(d.addresses),
         *d.tls("proposer")], name="other-proposer")
    assert wait_exit(proposer) != 0, "the sidecar must give up: no quorum can ever accept this primary"
    out = proposer.log_text()
    final = [line for line in out.splitlines() if "refusing to stream" in line]
    assert final, out
    # Two refusals of three already rule out a quorum of two: those two are named, with the reason.
    named = [a for a in d.addresses if a in final[-1]]
    assert len(named) >= 2 and "system id" in final[-1] and "another cluster" in final[-1], final[-1]
    errors = [line for line in out.splitlines() if "[error" in line and "safekeeper refused" in line]
    assert {a for a in d.addresses for line in errors if f"peer={a}" in line} >= set(named), errors
    assert_unchanged(before, d)

"""A safekeeper's lost disk against real PostgreSQL 15: an empty directory learns its term from its peers
before it votes, as many of them as the cluster's membership asks, and a brand-new safekeeper replaces a dead
one after the primary recycled the WAL it needs and the others removed it (archived).

(The acknowledged commit a wiped safekeeper could lose by voting with an empty WAL needs an election over
it and a peer lacking that commit at one chosen moment; the simulator finds it without the rule,
tests/unit/sim/test_simulation.py.)"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest

from support.deployment import APP, Deployment, Writer, read_wal, start_commit, syncrep_waiters, wait_holds_primary_wal
from support.helpers import wait_for, walsidecar
from support.procs import ProcessTracker
from sidecar.deployment import SafekeeperMember
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, segment_file_name

pytestmark = pytest.mark.integration


@pytest.fixture
def peered(pg_factory, procs: ProcessTracker, test_dir: Path) -> Deployment:  # noqa: ANN001
    """The usual deployment, each safekeeper naming the others as --peers."""
    d = Deployment(pg_factory(settings={"synchronous_standby_names": APP}), procs, test_dir, peers=True)
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
    return d


def test_a_wiped_safekeeper_learns_its_term_from_its_peers_before_voting(peered: Deployment) -> None:
    d = peered
    writer = Writer(d.pg.dsn())
    writer.start()
    wait_for(lambda: len(writer.acked) >= 50, timeout=60, what="writes before the disk loss")
    d.safekeepers[2].kill9()
    shutil.rmtree(d.sk_dir(2))
    d.safekeepers[3].kill9()  # N=3: safekeeper 2 must hear both of the others
    term = max(d.term(1), d.term(3))
    d.start_safekeeper(2)
    wait_for(lambda: "not voting until enough peers" in d.safekeepers[2].log_text(), timeout=30,
             what="safekeeper 2 to wait for safekeeper 3's term")
    wait_for(lambda: "empty data directory" in d.proposer.log_text(), timeout=30,
             what="the proposer to log safekeeper 2's refusal")
    assert d.term(2) == 0, "an amnesic safekeeper persisted a term before learning it"
    d.start_safekeeper(3)
    wait_for(lambda: "learned the term from the peers" in d.safekeepers[2].log_text(), timeout=30,
             what="safekeeper 2 to learn its term")
    assert d.term(2) >= term
    seen = len(writer.acked)
    wait_for(lambda: len(writer.acked) >= seen + 100, timeout=60, what="writes after safekeeper 2 came back")
    acked = writer.stop()
    assert writer.error is None
    wait_holds_primary_wal(d, 2, "the wiped safekeeper to hold the primary's WAL again")
    with d.sql() as c:
        assert {r[0] for r in c.execute("SELECT id FROM load")} >= set(acked)


def test_a_short_peers_list_does_not_let_one_peer_suffice(peered: Deployment, procs: ProcessTracker) -> None:
    """L-7: in a 3-safekeeper cluster a wiped safekeeper given one peer in --peers needs both others all the same:
    the cluster's size comes from the membership its peer tells (and the proposer's greeting), not the list."""
    d = peered
    d.safekeepers[3].kill9()
    shutil.rmtree(d.sk_dir(3))
    argv = d.members["safekeeper3"].argv()
    at = argv.index("--peers")
    argv[at + 1] = d.addresses[0]  # safekeeper 1 only
    sk3 = procs.start(argv, name="safekeeper3-short-peers")
    wait_for(lambda: "peer told its term" in sk3.log_text(), timeout=30, what="safekeeper 1 to tell its term")
    wait_for(lambda: any(s in sk3.log_text() for s in ("learned the term", "--peers lists fewer safekeepers")),
             timeout=30, what="safekeeper 3 to learn its term or say its list is short")
    assert d.term(3) == 0 and "learned the term" not in sk3.log_text(), "one peer of two was enough"
    assert "members=3" in sk3.log_text()
    with d.sql() as c:  # safekeepers 1 and 2 are a quorum
        c.execute("INSERT INTO load VALUES (1, 'one down, one amnesic')")


def test_a_new_safekeeper_replaces_a_dead_one_from_the_archive_and_its_peers(
        pg_factory, procs: ProcessTracker, test_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The primary recycled what the new safekeeper needs and the others removed it once archived: the
    archive gives what no one else holds, a peer's reader port the rest."""
    pg = pg_factory(settings={"synchronous_standby_names": APP, "max_wal_size": "32MB", "min_wal_size": "32MB",
                              "wal_keep_size": "0"})
    d = Deployment(pg, procs, test_dir, peers=True)
    # The proposer reads a peer's reader port as reader `walsidecar`, with libpq's own password file.
    monkeypatch.setenv("PGPASSFILE", str(d.reader_passfile))
    archive = ("--archive", f"file://{test_dir}/archive")
    proposer_args = ("--primary-retention", "1MB", *archive)
    for i in (1, 2, 3):
        d.start_safekeeper(i, *archive)
    d.start_proposer(*proposer_args)
    d.wait_sync()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
    start = d.history_start(1)
    first = segment_file_name(1, start // DEFAULT_SEGMENT_SIZE)
    # Dead within the first segment: the horizon slot no longer keeps what it lacks.
    d.safekeepers[3].kill9()
    shutil.rmtree(d.sk_dir(3))
    with d.sql() as c:
        c.execute("CREATE TABLE big AS SELECT g, repeat('z', 300) AS pad FROM generate_series(1, 60000) g")

    def gone() -> bool:
        with d.sql() as c:
            c.execute("INSERT INTO load SELECT g, repeat('r', 200) FROM generate_series(1, 2000) g")
            c.execute("SELECT pg_switch_wal()")
            c.execute("CHECKPOINT")
        return not (d.pg.pg_wal_dir / first).exists() and \
            not any((d.sk_dir(i) / "wal" / first).exists() for i in (1, 2))

    # The horizon slot keeps only 1 MB below the commit position; the safekeepers remove what is archived.
    wait_for(gone, timeout=90, what=f"the primary to recycle {first} and the safekeepers to remove it")
    check = walsidecar("check", "--pg-dsn", d.pg.dsn(), "--safekeepers", ",".join(d.addresses), *d.tls("client"))
    assert "the primary keeps" in check.stdout and "bytes of WAL for the safekeepers" in check.stdout, check.stdout
    # Audit I-1: the archived copy of what only the archive holds is damaged. Reading it again gives the
    # same bytes, so catch-up must stop there and say so once, not retry for ever, while commits go on.
    archived = next((test_dir / "archive").glob(f"*/*/wal/{first}"))
    good = archived.read_bytes()
    archived.write_bytes(b"\xff" * 8 + good[8:])  # no page header any more
    d.proposer.kill9()
    del d.members["safekeeper3"]
    d.add(SafekeeperMember(d, "safekeeper4", node_id=4, port=d.pick_port()))
    d.start("safekeeper4")  # not archiving: it keeps every byte it gets, for the comparison below
    d.start_proposer(*proposer_args)
    d.wait_sync()
    stopped = "catch-up stopped: a segment in the archive fails the WAL checks"
    wait_for(lambda: stopped in d.proposer.log_text(), timeout=60, what="the catch-up to stop at the damaged segment")
    with d.sql() as c:
        for i in range(200):
            c.execute("INSERT INTO load VALUES (%s, 'while the archive is damaged')", (i,))
    log = d.proposer.log_text()
    assert log.count(stopped) == 1 and first in log, log[-3000:]
    assert "catch-up failed; will retry" not in log
    # The operator puts the good object back; the next connection catches up from it.
    archived.write_bytes(good)
    d.proposer.kill9()
    d.start_proposer(*proposer_args)
    d.wait_sync()
    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (0, 'after the replacement')")
    end = d.flush_lsn()
    sk4 = d.data_dir("safekeeper4") / "wal"
    wait_for(lambda: len(read_wal(sk4, start, end)) == end - start, timeout=120,
             what="safekeeper 4 to hold all the WAL from the first term's start")
    # What safekeeper 1 still holds, the archive below it: copied in that order, as removal follows upload.
    expected = test_dir / "expected"
    expected.mkdir()
    for f in (test_dir / "archive").glob("*/*/wal/0*"):
        shutil.copyfile(f, expected / f.name)
    for f in (d.sk_dir(1) / "wal").iterdir():
        with contextlib.suppress(FileNotFoundError):
            shutil.copyfile(f, expected / f.name)
    assert read_wal(sk4, start, end) == read_wal(expected, start, end)
    log = d.proposer.log_text()
    assert "caught up from the archive" in log and "catching up from a safekeeper's reader port" in log
    assert "learned the term from the peers" in d.safekeepers[4].log_text()
    # Commits still wait for a quorum, which now counts safekeeper 4.
    d.safekeepers[1].kill9()
    d.safekeepers[2].kill9()
    thread, result = start_commit(d.pg.dsn(), "INSERT INTO load VALUES (-1, 'waits')")
    wait_for(lambda: syncrep_waiters(d) >= 1, timeout=30, what="the commit to wait for the quorum")
    assert not result
    d.start_safekeeper(1, *archive)
    thread.join(timeout=60)
    assert result.get("done"), result

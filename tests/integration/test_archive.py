"""The safekeepers' WAL archive on S3 (moto_server as a process): committed segments, byte-identical, no gap."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from support.deployment import APP, Deployment, Writer, backup_lsn, commit_lsn_of
from support.helpers import wait_for, walsidecar
from support.installed import installed_argv
from support.procs import ProcessTracker
from support.recovery import base_backup, recover
from support.s3 import AWS_ENV, aws_env, make_bucket, moto_server
from sidecar.archivedwal import partial_name
from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG
from sidecar.config import RestoreWalSettings
from sidecar.lsn import format_lsn, parse_lsn, parse_segment_file_name, segment_file_name
from sidecar.objectstore import Storage, open_storage
from sidecar.ops.restore import Exit, restore_wal
from sidecar.safekeeper.control import load_control

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
BUCKET = "wal"
TAKEOVER = 2.0  # seconds per rank before a higher id uploads what the archive lacks


@pytest.fixture
def s3(test_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    aws_env(monkeypatch)  # the safekeepers inherit the credentials
    with moto_server(test_dir) as endpoint:
        make_bucket(endpoint, BUCKET)
        yield endpoint


@pytest.fixture
def archiving(pg_factory: Callable[..., object], procs: ProcessTracker, test_dir: Path, s3: str) -> Deployment:
    d = Deployment(pg_factory(settings={"synchronous_standby_names": APP}), procs, test_dir)
    for i in (1, 2, 3):
        d.extra[f"safekeeper{i}"] = ["--archive", f"s3://{BUCKET}/archive", "--s3-endpoint", s3,
                                     "--archive-takeover", str(TAKEOVER)]
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
    return d


def lowest_segment(d: Deployment, i: int) -> int:
    return min(parse_segment_file_name(p.name, SEG)[1] for p in (d.sk_dir(i) / "wal").iterdir())


def switch_segments(d: Deployment, n: int) -> int:
    """Fill and switch n segments; the end of WAL after a commit in the next one."""
    with d.sql() as c:
        for _ in range(n):
            c.execute("INSERT INTO load SELECT g, repeat('r', 300) FROM generate_series(1, 5000) g")
            c.execute("SELECT pg_switch_wal()")
        return commit_lsn_of(c, "INSERT INTO load VALUES (-1, 'after the switch')")


def archived_segments(store: Storage) -> dict[str, int]:
    return {n: s for n, s in store.list_files().items() if len(n) == 24}


def assert_identical_and_gapless(d: Deployment, store: Storage, first: int, end: int) -> None:
    """Every segment in [first, end) is in the archive, whole and byte-identical to the primary's."""
    names = archived_segments(store)
    segnos = sorted(parse_segment_file_name(n, SEG)[1] for n in names)
    assert segnos[0] == first // SEG and segnos == list(range(segnos[0], segnos[-1] + 1)), names
    assert segnos[-1] + 1 >= end // SEG
    for name in names:
        assert store.read(name) == (d.pg.pg_wal_dir / name).read_bytes(), f"{name} differs from the primary's"


def test_committed_segments_are_archived_and_another_safekeeper_takes_over(
        archiving: Deployment, s3: str, test_dir: Path) -> None:
    d = archiving
    with d.sql() as c:
        sysid = c.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]
    store = open_storage(f"s3://{BUCKET}/archive/{sysid}/{sysid}/wal", s3_endpoint=s3)  # --cluster: the system id
    first = d.history_start(1)

    end = switch_segments(d, 3)
    done = end - end % SEG
    wait_for(lambda: all(backup_lsn(d, i) >= done for i in (1, 2, 3)), timeout=60,
             what=f"every safekeeper's backup_lsn to reach {format_lsn(done)}")
    assert_identical_and_gapless(d, store, first, done)
    # With an archive each safekeeper removes what it holds below backup_lsn.
    wait_for(lambda: all(lowest_segment(d, i) >= done // SEG for i in (1, 2, 3)), timeout=30,
             what=f"every safekeeper to remove its WAL below {format_lsn(done)}")

    # The uploader (safekeeper 1, the lowest id) dies under load; safekeeper 2 takes over after its grace.
    writer = Writer(d.pg.dsn())
    writer.start()
    d.members["safekeeper1"].kill()
    end = switch_segments(d, 3)
    acked = writer.stop()
    assert acked and writer.error is None
    done = end - end % SEG
    wait_for(lambda: backup_lsn(d, 2) >= done and backup_lsn(d, 3) >= done, timeout=60,
             what=f"safekeepers 2 and 3 to archive up to {format_lsn(done)} without safekeeper 1")
    assert_identical_and_gapless(d, store, first, done)
    assert not [k for k in store.list() if not k.startswith(tuple(archived_segments(store)))], \
        "only whole segments in the archive"

    addrs = ",".join(d.addresses[1:])
    gaps = walsidecar("verify-archive", store.location, "--s3-endpoint", s3, "--safekeepers", addrs,
                      *d.tls("client"), "--gaps-only")
    assert gaps.returncode == 0 and "OK: no gap" in gaps.stdout, gaps.stdout + gaps.stderr

    # A term that ends (a new proposer) and a graceful stop: each safekeeper uploads the segment it is
    # writing, under a name giving the term that wrote it and where it ends.
    old_term = load_control(d.sk_dir(2)).state.term_history[-1].term
    d.stop("proposer")
    d.start("proposer")
    d.wait_sync()
    wait_for(lambda: any(f".term-{old_term}." in k for k in store.list_files()), timeout=30,
             what=f"a partial segment of term {old_term}")
    with d.sql() as c:
        commit_lsn_of(c, "INSERT INTO load VALUES (-2, 'in the new term')")
    d.stop("safekeeper2")
    new_term = load_control(d.sk_dir(2)).state.term_history[-1].term
    partials = [k for k in store.list_files() if k.endswith(".partial")]
    assert {int(k.split(".term-")[1].split(".")[0]) for k in partials} == {old_term, new_term} and new_term > old_term
    for name in partials:
        end = parse_lsn(name.split(".end-")[1].removesuffix(".partial").replace("-", "/"))
        segment = name[:24]
        assert name == partial_name(segment, int(name.split(".term-")[1].split(".")[0]), end)
        assert parse_segment_file_name(segment, SEG)[1] == end // SEG
        data, used = store.read(name), end % SEG
        assert len(data) == SEG and data[:used] == (d.pg.pg_wal_dir / segment).read_bytes()[:used], name
        assert data[used:] == bytes(SEG - used)

    # Once its segment is archived whole, a segment's partials go: the whole one holds every committed byte.
    d.start("safekeeper2")
    switch_segments(d, 1)
    segments = {name[:24] for name in partials}
    wait_for(lambda: segments <= set(archived_segments(store))
             and not [k for k in store.list_files() if k.endswith(".partial") and k[:24] in segments],
             timeout=60, what=f"the partials of {sorted(segments)} to go once those segments are archived whole")


def test_with_a_broker_the_upload_lease_holder_uploads(pg_factory: Callable[..., object], procs: ProcessTracker,
                                                       test_dir: Path, s3: str, etcd: object) -> None:
    d = Deployment(pg_factory(settings={"synchronous_standby_names": APP}), procs, test_dir)
    for i in (1, 2, 3):
        # No takeover by rank: with a broker only the lease decides.
        d.extra[f"safekeeper{i}"] = ["--archive", f"s3://{BUCKET}/leased", "--s3-endpoint", s3, "--cluster", "prod",
                                     "--broker", etcd.url, "--broker-lease", "3"]  # type: ignore[attr-defined]
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
        sysid = c.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]
    end = switch_segments(d, 2)
    done = end - end % SEG
    wait_for(lambda: all(backup_lsn(d, i) >= done for i in (1, 2, 3)), timeout=60,
             what=f"every safekeeper's backup_lsn to reach {format_lsn(done)}")
    store = open_storage(f"s3://{BUCKET}/leased/prod/{sysid}/wal", s3_endpoint=s3)
    assert_identical_and_gapless(d, store, d.history_start(1), done)
    uploaders = [i for i in (1, 2, 3) if "segment archived " in d.members[f"safekeeper{i}"].log_path.read_text()]
    assert len(uploaders) == 1, uploaders
    # etcd gone: commits go on (the broker is never on the commit path); etcd back: archiving resumes.
    etcd.stop()  # type: ignore[attr-defined]
    end = switch_segments(d, 2)  # returns once the quorum acknowledged its last commit
    etcd.start()  # type: ignore[attr-defined]
    done = end - end % SEG
    wait_for(lambda: all(backup_lsn(d, i) >= done for i in (1, 2, 3)), timeout=90,
             what=f"archiving to resume up to {format_lsn(done)} once etcd is back")
    assert_identical_and_gapless(d, store, d.history_start(1), done)


def restore_settings(d: Deployment, s3: str, *, readers: bool = True, **extra: object) -> RestoreWalSettings:
    """restore-wal's settings: the safekeepers' reader ports (when `readers`) and the archive."""
    archive = {"archive": f"s3://{BUCKET}/archive", "s3_endpoint": s3, **extra}
    if not readers:
        return RestoreWalSettings(**archive)
    return RestoreWalSettings(safekeeper_readers=tuple(str(a) for a in d.reader_addresses),
                              reader_passfile=d.reader_passfile, certs_dir=d.certs_dir("reader", "client"), **archive)


def test_restore_wal_falls_back_to_the_archive_and_never_hands_out_a_partial(
        archiving: Deployment, s3: str, test_dir: Path) -> None:
    d = archiving
    with d.sql() as c:
        sysid = c.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]
    store = open_storage(f"s3://{BUCKET}/archive/{sysid}/{sysid}/wal", s3_endpoint=s3)
    end = switch_segments(d, 2)
    done = end - end % SEG
    wait_for(lambda: all(backup_lsn(d, i) >= done for i in (1, 2, 3)), timeout=60,
             what=f"every safekeeper's backup_lsn to reach {format_lsn(done)}")
    wait_for(lambda: all(lowest_segment(d, i) >= done // SEG for i in (1, 2, 3)), timeout=30,
             what=f"every safekeeper to remove its WAL below {format_lsn(done)}")
    # check's archive line: every safekeeper's backup_lsn close behind its commit_lsn.
    check = walsidecar("check", "--pg-dsn", d.pg.dsn(), "--safekeepers", ",".join(d.addresses), *d.tls("client"))
    assert sum(line.strip().startswith("archive: OK (safekeeper ") for line in check.stdout.splitlines()) == 3, \
        check.stdout + check.stderr
    removed = segment_file_name(1, done // SEG - 1)
    out = test_dir / "RECOVERYXLOG"
    primary = (d.pg.pg_wal_dir / removed).read_bytes()

    # The safekeepers removed it: alone they do not have it, and it is committed (missing, not "not
    # there", which would end archive recovery before it); with --archive it comes from there, checked.
    only_safekeepers = restore_settings(d, s3).model_copy(update={"archive": None})
    assert restore_wal(only_safekeepers, removed, out) == Exit.MISSING and not out.exists()
    assert restore_wal(restore_settings(d, s3), removed, out) == Exit.RESTORED
    assert out.read_bytes() == primary
    out.unlink()

    # From the archive alone (no safekeeper, no certificates): the system is the only one there.
    alone = restore_settings(d, s3, readers=False)
    assert restore_wal(alone, removed, out) == Exit.RESTORED and out.read_bytes() == primary
    out.unlink()
    assert restore_wal(restore_settings(d, s3, readers=False, system_id=sysid + 1), removed, out) == Exit.NOT_FOUND

    # A partial segment in the archive is never given for its segment's name, nor under its own.
    current = segment_file_name(1, end // SEG)
    partial = partial_name(current, 99, end)
    store.replace(partial, (d.pg.pg_wal_dir / current).read_bytes()[:end % SEG] + bytes(SEG - end % SEG))
    assert restore_wal(alone, current, out) == Exit.NOT_FOUND
    assert restore_wal(alone, partial, out) == Exit.NOT_FOUND
    # A damaged object under a segment's name is refused, as bad WAL from a safekeeper is.
    damaged = segment_file_name(1, end // SEG + 1)
    store.replace(damaged, primary)  # another segment's bytes: its page addresses are wrong here
    assert restore_wal(alone, damaged, out) == Exit.BAD_DATA
    assert not out.exists()

    # Two systems in the archive and nothing to choose: a usage error, the exit code says so.
    open_storage(f"s3://{BUCKET}/archive/other/1/wal", s3_endpoint=s3).replace(removed, primary)
    assert restore_wal(alone, removed, out) == Exit.USAGE
    assert restore_wal(restore_settings(d, s3, readers=False, system_id=sysid), removed, out) == Exit.RESTORED
    assert out.read_bytes() == primary


def test_a_primary_comes_back_from_a_base_backup_and_the_archive_alone(archiving: Deployment, s3: str,
                                                                       test_dir: Path) -> None:
    d = archiving
    home = test_dir / "restored"
    home.mkdir()
    if os.geteuid() == 0:  # pg_basebackup runs as the postgres OS user
        pw = pwd.getpwnam("postgres")
        os.chown(home, pw.pw_uid, pw.pw_gid)
    restored = base_backup(home, d.pg.dsn())
    writer = Writer(d.pg.dsn())
    writer.start()
    switch_segments(d, 2)
    wait_for(lambda: len(writer.acked) >= 100, timeout=60, what="acknowledged single-row commits")
    acked = writer.stop()
    assert writer.error is None
    # Every acknowledged row in a complete, committed segment: the archive holds complete segments only.
    end = switch_segments(d, 1)
    done = end - end % SEG
    wait_for(lambda: all(backup_lsn(d, i) >= done for i in (1, 2, 3)), timeout=60,
             what=f"every safekeeper's backup_lsn to reach {format_lsn(done)}")
    with d.sql() as c:
        sysid = c.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]

    # The primary and every safekeeper are gone.
    for name in ("proposer", "safekeeper1", "safekeeper2", "safekeeper3"):
        d.members[name].kill()
    d.pg.crash()
    shutil.rmtree(d.pg.data_dir)

    # restore_command runs as the postgres OS user, the installed command as in production.
    credentials = [f"{k}={v}" for k, v in AWS_ENV.items()]
    command = shlex.join(["env", *credentials, *installed_argv(
        "restore-wal", "%f", "%p", "--archive", f"s3://{BUCKET}/archive", "--s3-endpoint", s3,
        "--system-id", str(sysid))])
    try:
        recover(restored, command, recovery_target_timeline="latest")
        with psycopg.connect(restored.dsn(), autocommit=True) as c:
            written = {r[0] for r in c.execute("SELECT id FROM load WHERE pad = repeat('x', 200)")}
            bulk = c.execute("SELECT count(*) FROM load WHERE pad = repeat('r', 300)").fetchone()[0]
        assert not set(acked) - written, f"{len(set(acked) - written)} acknowledged rows lost"
        assert bulk == 3 * 5000
        assert restored.log_text().count('restored log file "0000000100') >= 3, restored.log_text()[-3000:]
    finally:
        restored.teardown()

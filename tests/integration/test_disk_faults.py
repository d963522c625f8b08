"""Disk faults on real processes and real filesystems: a full disk, damaged segments, a failed fsync.

The full disk is a size-limited tmpfs the test mounts as one safekeeper's data directory (the
tests run as root). Damage is done to a stopped safekeeper's files. A failed fsync comes from
a real device: ext4 on a loop device whose sparse backing file sits on a small tmpfs, so
writeback fails once the tmpfs is full, as on a thin-provisioned volume (device-mapper's error
target is not available in this kernel). The background flusher's failure is also tested in
this process, with os.fdatasync patched to raise EIO, because only there can the test choose
which sync fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import psycopg
import pytest

from support.deployment import Deployment, Writer, wait_replayed
from support.helpers import created, free_port, run, until, wait_for
from support.procs import ManagedProcess
from sidecar import framing
from sidecar.consensus import codec
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, ElectedReply, Greeting, GreetingReply, TermEntry, VoteReply,
    VoteRequest,
)
from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG
from sidecar.lsn import format_lsn, parse_lsn, parse_segment_file_name
from sidecar.safekeeper.monitor import SafekeeperMonitor
from sidecar.safekeeper.server import Safekeeper
from sidecar.safekeeper.storage import WalStorage

SYSID = 7_300_000_000_000_000_009


# ---- helpers ------------------------------------------------------------------------------------

def http_get(addr: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(addr: str, name: str) -> float:
    _, text = http_get(addr, "/metrics")
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def emit_wal(d: Deployment, mib: int) -> int:
    """Commit `mib` 1 MiB logical messages; return the primary's insert position after them."""
    with d.sql() as c:
        for _ in range(mib):
            c.execute("SELECT pg_logical_emit_message(true, 'disk', repeat('w', 1 << 20))")
        return parse_lsn(c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])


class WalPump(threading.Thread):
    """Commits 1 MiB logical messages back to back, so the safekeepers' WAL grows fast."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                while not self.stop_event.is_set():
                    c.execute("SELECT pg_logical_emit_message(true, 'disk', repeat('w', 1 << 20))")
        except psycopg.Error:
            pass

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=120)


def all_acked_present(d: Deployment, acked: list[int]) -> None:
    with d.sql() as c:
        present = {r[0] for r in c.execute("SELECT id FROM load").fetchall()}
    lost = sorted(set(acked) - present)
    assert not lost, f"{len(lost)} acknowledged rows lost, e.g. {lost[:10]}"


def wait_exit(proc: ManagedProcess, timeout: float = 60) -> int:
    return wait_for(lambda: proc.returncode is not None, timeout=timeout, what=f"{proc.name} to exit") and \
        proc.returncode  # type: ignore[return-value]


def commits_continue(d: Deployment, n: int = 20) -> None:
    """`n` commits, each acknowledged by the quorum that is left."""
    with d.sql() as c:
        c.execute("CREATE TABLE IF NOT EXISTS probe (i int)")
        for i in range(n):
            c.execute("INSERT INTO probe VALUES (%s)", (i,))


def wal_files(d: Deployment, i: int) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((d.sk_dir(i) / "wal").iterdir())}


# ---- a full disk --------------------------------------------------------------------------------

@pytest.mark.integration
def test_a_full_disk_stops_one_safekeeper_and_commits_go_on(pg_factory, procs, test_dir: Path) -> None:
    from support.deployment import APP

    pg = pg_factory(settings={"synchronous_standby_names": APP})
    d = Deployment(pg, procs, test_dir)
    small = d.sk_dir(1)
    small.mkdir()
    # Three 16 MiB segments' worth: the first segment and the spare, then the next segment takes
    # the spare and the new spare finds no room (a warning), then the one after finds no room.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(small)], check=True)
    try:
        metrics = f"127.0.0.1:{free_port()}"
        d.start_safekeeper(1, "--metrics", metrics)
        for i in (2, 3):
            d.start_safekeeper(i)
        d.start_proposer()
        d.wait_sync()
        with d.sql() as c:
            c.execute("CREATE TABLE load (id int, pad text)")
        writer, pump = Writer(pg.dsn()), WalPump(pg.dsn())
        writer.start()
        pump.start()
        try:
            sk1 = d.safekeepers[1]
            wait_for(lambda: "disk full: no longer acknowledging WAL" in sk1.log_text(), timeout=180,
                     what="safekeeper 1 to say its disk is full")
            status, body = http_get(metrics, "/health")
            assert status == 503 and "disk full" in body, (status, body)
            assert metric(metrics, "walsidecar_safekeeper_disk_full") == 1
            assert metric(metrics, "walsidecar_safekeeper_disk_full_errors_total") >= 1
            assert sk1.is_running(), "a full disk fences the safekeeper; it stays up to say why"
            assert "disk full" in json.loads(http_get(metrics, "/status")[1])["stopped"]
            # Commits go on with the other two.
            fenced_at = len(writer.acked)
            wait_for(lambda: len(writer.acked) >= fenced_at + 50, timeout=120, what="commits without safekeeper 1")
        finally:
            pump.stop()
            acked = writer.stop()
        assert writer.error is None, writer.error
        all_acked_present(d, acked)
        assert "Traceback" not in sk1.log_text()

        # Space comes back (the operator grows the volume); after a restart it catches up.
        subprocess.run(["mount", "-o", "remount,size=512m", str(small)], check=True)
        sk1.interrupt()
        d.start_safekeeper(1, "--metrics", metrics)
        target = emit_wal(d, 2)
        wait_replayed(d, target, timeout=120, what="every safekeeper, the refilled one too, to hold the newest WAL")
        assert http_get(metrics, "/health")[0] == 200
        all_acked_present(d, acked)
    finally:
        for p in procs.started:
            if p.name == "safekeeper1" and p.is_running():
                p.kill9()
        subprocess.run(["umount", "-l", str(small)], check=False)


# ---- damaged segments ---------------------------------------------------------------------------

def cut_short(path: Path) -> int:
    size = path.stat().st_size // 3
    os.truncate(path, size)
    return size


def flip_header(path: Path) -> int:
    flip(path, 100 * 8192 + 9)  # inside xlp_pageaddr of page 100
    return 100 * 8192


def flip_record(path: Path) -> None:
    flip(path, 700 * 8192 + 4000)  # inside a 1 MiB message that began in this segment


def remove(path: Path) -> int:
    path.unlink()
    return 0


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x20]))


@pytest.mark.integration
def test_a_damaged_segment_stops_the_restart_and_commits_go_on(deployment: Deployment) -> None:
    d = deployment
    # Enough WAL for a middle segment between the first and the last completed ones.
    target = emit_wal(d, 56)
    wait_replayed(d, target, timeout=120, what="every safekeeper to hold the WAL")
    d.safekeepers[1].interrupt()
    wal = d.sk_dir(1) / "wal"
    finals = sorted(p for p in wal.iterdir() if not p.name.endswith(".partial"))
    assert len(finals) >= 3, [p.name for p in finals]
    middle, last = finals[len(finals) // 2], finals[-1]
    pristine = wal_files(d, 1)
    saved = d.base / "sk1-pristine"
    shutil.copytree(wal, saved)
    cases = [
        (cut_short, last, "cut short"),
        (flip_header, middle, "bad page header"),
        (flip_record, middle, "CRC mismatch"),
        (remove, middle, "is missing"),
    ]
    for damage, path, words in cases:
        offset = damage(path)
        damaged = wal_files(d, 1)
        proc = d.start_safekeeper(1)
        assert wait_exit(proc) == 1
        log = proc.log_text()
        segno = parse_segment_file_name(path.name, SEG)[1]
        assert path.name in log and words in log, log
        if offset is not None:
            assert format_lsn(segno * SEG + offset) in log, log
        assert "Traceback" not in log and "refuses to start" in log, log
        assert wal_files(d, 1) == damaged, "a refused start changed the safekeeper's files"
        commits_continue(d)
        shutil.rmtree(wal)
        shutil.copytree(saved, wal)
    assert wal_files(d, 1) == pristine
    d.start_safekeeper(1)
    target = emit_wal(d, 1)
    wait_replayed(d, target, timeout=120, what="the repaired safekeeper to catch up")


# ---- a failed fdatasync on a real device --------------------------------------------------------

class ThinDevice:
    """ext4 on a loop device whose sparse 1 GiB backing file lives on a small tmpfs: once the
    tmpfs is full, writeback fails and fdatasync reports it (ENOSPC from the block layer), as on
    a thin-provisioned volume that ran out. No journal, so metadata writes cannot abort it."""

    def __init__(self, base: Path, mountpoint: Path) -> None:
        self.back, self.mountpoint = base / "thin-backing", mountpoint
        self.loop: str | None = None

    def __enter__(self) -> ThinDevice:
        self.back.mkdir()
        self.mountpoint.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1100m", "tmpfs", str(self.back)], check=True)
        img = self.back / "img"
        subprocess.run(["truncate", "-s", "1g", str(img)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", str(img)], check=True)
        self.loop = subprocess.run(["losetup", "-f", "--show", str(img)], check=True, capture_output=True,
                                   text=True).stdout.strip()
        subprocess.run(["mount", self.loop, str(self.mountpoint)], check=True)
        os.chmod(self.mountpoint, 0o700)
        return self

    def room(self, size: int) -> None:
        """Let the backing file grow by `size` bytes more than it holds now."""
        os.sync()
        used = (self.back / "img").stat().st_blocks * 512
        subprocess.run(["mount", "-o", f"remount,size={(used + size) >> 10}k", str(self.back)], check=True)

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["umount", "-l", str(self.mountpoint)], check=False)
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], check=False)
        subprocess.run(["umount", "-l", str(self.back)], check=False)


@pytest.mark.integration
def test_a_failed_fdatasync_stops_the_safekeeper_and_the_restart_cuts_back(pg_factory, procs, test_dir: Path) -> None:
    from support.deployment import APP, wal_matches_primary

    pg = pg_factory(settings={"synchronous_standby_names": APP})
    d = Deployment(pg, procs, test_dir)
    with ThinDevice(test_dir, d.sk_dir(1)) as thin:
        try:
            d.start_all()
            with d.sql() as c:
                c.execute("CREATE TABLE load (id int, pad text)")
            spare = d.sk_dir(1) / "wal.spare"
            wait_for(lambda: spare.exists() and spare.stat().st_size == SEG, what="the spare segment")
            # Room for 2 MiB more. Segments are made of zero-filled spares, whose blocks are on
            # the device already, so what meets the full device first is the next spare (a
            # warning) and then the next fsync of new blocks: the control file's, or the WAL's.
            thin.room(2 << 20)
            writer, pump = Writer(pg.dsn()), WalPump(pg.dsn())
            writer.start()
            pump.start()
            try:
                sk1 = d.safekeepers[1]
                assert wait_exit(sk1, timeout=180) == 1
                failed = wait_for(lambda: (m := (d.sk_dir(1) / "wal.in-doubt").read_bytes().rstrip(b"\0")) and m)
                marker = json.loads(failed)
                assert "fdatasync of WAL segment" in marker["reason"] or "safekeeper.control" in marker["reason"]
                assert "No space left on device" in marker["reason"], marker
                assert marker["durable_lsn"] <= marker["written_lsn"]
                log = sk1.log_text()
                assert "fatal error; stopping the safekeeper" in log, log[-3000:]
                assert f"in_doubt_from={format_lsn(marker['durable_lsn'])}" in log, log[-3000:]
                assert log.count("fatal error") == 1 and "Traceback" not in log
                stopped_at = len(writer.acked)
                wait_for(lambda: len(writer.acked) >= stopped_at + 50, timeout=120, what="commits without it")
            finally:
                pump.stop()
                acked = writer.stop()
            assert writer.error is None, writer.error
            all_acked_present(d, acked)

            thin.room(600 << 20)  # the volume is grown; the page cache is still not trusted
            proc = d.start_safekeeper(1)
            target = emit_wal(d, 2)
            wait_replayed(d, target, timeout=120, what="the restarted safekeeper to catch up")
            log = proc.log_text()
            assert "cutting the WAL back to what was durable" in log and format_lsn(marker["durable_lsn"]) in log
            assert not (d.sk_dir(1) / "wal.in-doubt").read_bytes().strip(b"\0")
            start = d.history_start(1)
            assert wal_matches_primary(d, 1, start, target), "the refetched WAL differs from the primary's"
            all_acked_present(d, acked)
        finally:
            procs.kill_all()


# ---- start-up errors of the command -------------------------------------------------------------

def safekeeper_cli(data_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, WALSIDECAR_INSECURE="1")
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "safekeeper", "--id", "1", "--listen", f"127.0.0.1:{free_port()}",
         "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60, env=env)


def test_a_read_only_data_dir_is_a_clean_error(tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], check=True)
    try:
        r = safekeeper_cli(mnt / "sk")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "cannot start from" in r.stderr and "Read-only file system" in r.stderr, r.stderr


def test_a_data_dir_under_a_file_is_a_clean_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("not a directory")
    r = safekeeper_cli(tmp_path / "f" / "sk")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "cannot start from" in r.stderr, r.stderr
    assert "Not a directory" in r.stderr, r.stderr


def test_an_invalid_segment_size_in_the_control_file_is_a_clean_error(tmp_path: Path) -> None:
    from sidecar.consensus.state import AcceptorState
    from sidecar.safekeeper.control import ControlData, save_control

    save_control(tmp_path, ControlData(1, AcceptorState(system_id=SYSID, wal_seg_size=3 << 20, pg_version=15,
                                                         timeline=1)))
    r = safekeeper_cli(tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "holds an invalid value" in r.stderr and "power of two" in r.stderr, r.stderr


def test_a_missing_last_completed_segment_is_a_clean_error(tmp_path: Path) -> None:
    from sidecar.consensus.state import AcceptorState
    from sidecar.safekeeper.control import ControlData, save_control

    seg = 1 << 20
    st = WalStorage(tmp_path / "wal", seg, 1)
    st.open_at(seg)
    st.write(seg, os.urandom(2 * seg + 10))
    st.flush()
    st.close()
    (tmp_path / "wal" / "000000010000000000000002").unlink()
    save_control(tmp_path, ControlData(1, AcceptorState(system_id=SYSID, wal_seg_size=seg, pg_version=15,
                                                         timeline=1)))
    r = safekeeper_cli(tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "000000010000000000000002" in r.stderr and "missing" in r.stderr, r.stderr


# ---- a failed fdatasync in the proposer's connection thread -------------------------------------

def test_a_failed_fdatasync_stops_the_safekeeper(tmp_path: Path, monkeypatch) -> None:
    """DOS-6: the connection's thread syncs what it wrote (group commit); EIO there is fatal at once."""
    from support.walbuilder import WalBuilder

    rest = 300_000

    b = WalBuilder(SEG, seg_size=SEG, sysid=SYSID)
    b.fill_to(SEG + 100_000 + rest, 300)
    durable = next(r for r in b.records if r.end_lsn > SEG + 100_000).end_lsn
    wal = b.bytes()

    async def main() -> None:
        sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
        mon = SafekeeperMonitor(sk)
        server = asyncio.ensure_future(sk.serve())
        await until(lambda: sk.listening_port is not None, "the safekeeper to listen")
        port = sk.listening_port
        reader, writer = await framing.open_connection("127.0.0.1", port)

        async def send(msg):
            framing.write(writer, codec.encode(msg))
            return await asyncio.wait_for(reader.read_message(), 10)

        assert isinstance(await send(Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15)), GreetingReply)
        assert isinstance(await send(VoteRequest(1)), VoteReply)
        assert isinstance(await send(Elected(1, SEG, (TermEntry(1, SEG),))), ElectedReply)
        first = await send(Append(1, SEG, 0, 0, wal[:durable - SEG]))
        assert isinstance(first, AppendReply) and first.flush_lsn == durable

        def eio(fd: int) -> None:
            raise OSError(errno.EIO, "Input/output error (injected)")

        monkeypatch.setattr(os, "fdatasync", eio)
        tail = wal[durable - SEG:]
        framing.write(writer, codec.encode(Append(1, durable, 0, 0, tail)))
        await until(lambda: sk.fatal is not None, "the failed sync to stop the safekeeper")
        health = mon.health()
        assert health.status == 503 and b"in doubt" in health.body, health
        with contextlib.suppress(asyncio.CancelledError):  # as run_until_signal takes it
            await asyncio.wait_for(server, 10)  # serve() ends: the command exits with status 1
        assert server.done()
        writer.close()
        marker = json.loads((tmp_path / "wal.in-doubt").read_bytes().rstrip(b"\0"))
        assert (marker["durable_lsn"], marker["written_lsn"]) == (durable, b.end)

    run(main())
    monkeypatch.undo()
    # The next start cuts the WAL back to what was durable, whatever the page cache holds.
    sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
    try:
        assert sk.storage.in_doubt() is None and not (tmp_path / "wal.in-doubt").read_bytes().strip(b"\0")
        assert sk.acceptor.write_lsn == durable
        assert sk.storage.read(SEG, 2 * SEG) == wal[:durable - SEG]
    finally:
        sk.storage.close()


# ---- a full disk, seen from the tools ------------------------------------------------------------

def test_a_full_disk_is_what_check_health_and_metrics_say(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from sidecar.skclient import ProbeError, probe_safekeeper
    from support.walbuilder import WalBuilder

    seg = 1 << 20
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)], check=True)
    b = WalBuilder(seg, seg_size=seg, sysid=SYSID)
    b.fill_to(5 * seg, 300)
    wal = b.bytes()

    async def main() -> None:
        sk = Safekeeper.open(1, created(small, 1), "127.0.0.1", 0)
        mon = SafekeeperMonitor(sk)
        server = asyncio.ensure_future(sk.serve())
        await until(lambda: sk.listening_port is not None, "the safekeeper to listen")
        addr = "127.0.0.1:%d" % sk.listening_port
        reader, writer = await framing.open_connection(*addr.split(":"))

        async def send(msg):
            framing.write(writer, codec.encode(msg))
            return await asyncio.wait_for(reader.read_message(), 10)

        assert isinstance(await send(Greeting(PROTOCOL_VERSION, "p", SYSID, 1, seg, 15)), GreetingReply)
        await send(VoteRequest(1))
        await send(Elected(1, seg, (TermEntry(1, seg),)))
        acked = seg
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            for off in range(0, len(wal), 200_000):  # until the disk is full and the link drops
                reply = await send(Append(1, seg + off, 0, 0, wal[off:off + 200_000]))
                if isinstance(reply, AppendReply):
                    acked = max(acked, reply.flush_lsn)
        writer.close()
        assert sk.disk_full and sk.fatal is None and not server.done(), "a full disk fences, it does not exit"
        with pytest.raises(ProbeError, match="it refused: disk full: no space for WAL"):
            await probe_safekeeper(addr, 5)
        health = mon.health()
        assert health.status == 503 and health.body.startswith(b"disk full"), health
        text = generate_latest(sk.stats.registry).decode()
        assert "walsidecar_safekeeper_disk_full 1.0" in text.replace('{safekeeper_id="1"}', "")
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        # Everything acknowledged is there at the next start.
        again = Safekeeper.open(1, created(small, 1), "127.0.0.1", 0)
        try:
            assert again.acceptor.write_lsn >= max(r.end_lsn for r in b.records if r.end_lsn <= acked)
        finally:
            again.storage.close()

    try:
        run(main())
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)

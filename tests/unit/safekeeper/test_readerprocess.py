"""The reader process's own pieces: WAL files read by name from another process, the link's pin moves."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from support.helpers import run, until
from support.pgfrontend import Client
from sidecar import pgrepl
from sidecar.consensus.reading import ServerState
from sidecar.lsn import segment_file_name
from sidecar.safekeeper.pgserver import ReaderPort
from sidecar.safekeeper.readerhost import ReaderProcess
from sidecar.safekeeper.readerprocess import RemotePin, RemoteSafekeeper, Snapshot, WalFiles
from sidecar.safekeeper.slots import Slots
from sidecar.safekeeper.storage import NoWal, StorageError, WalPin

SEG = 1 << 20


def put(wal: Path, tli: int, segno: int, fill: int, partial: bool = False, size: int = SEG) -> Path:
    path = wal / (segment_file_name(tli, segno, SEG) + (".partial" if partial else ""))
    path.write_bytes(bytes([fill]) * size)
    return path


def test_segments_are_found_again_when_renamed_and_gone_ones_are_named(tmp_path: Path) -> None:
    files = WalFiles(tmp_path)
    partial = put(tmp_path, 1, 3, 0xAA, partial=True)
    assert files.read(3 * SEG + 10, 5, SEG) == b"\xaa" * 5
    # Synced and given its final name, then the primary's timeline 2 adopted: renamed twice.
    final = partial.rename(tmp_path / segment_file_name(1, 3, SEG))
    assert files.read(3 * SEG, 2, SEG) == b"\xaa" * 2
    final.rename(tmp_path / segment_file_name(2, 3, SEG))
    assert files.read(4 * SEG - 2, 2, SEG) == b"\xaa" * 2
    # A read across two segments; a final name wins over a .partial of the same segment.
    put(tmp_path, 2, 4, 0xBB, partial=True)
    put(tmp_path, 2, 4, 0xCC)
    assert files.read(4 * SEG - 1, 2, SEG) == b"\xaa\xcc"
    os.unlink(tmp_path / segment_file_name(2, 3, SEG))  # removed
    with pytest.raises(StorageError, match="segment from 0/300000 is not stored"):
        files.read(3 * SEG, 1, SEG)
    with pytest.raises(StorageError, match="no WAL yet"):
        files.read(0, 1, 0)


def test_a_short_file_reads_as_zeros_as_the_safekeepers_own_read(tmp_path: Path) -> None:
    put(tmp_path, 1, 0, 0x11, size=100)
    assert WalFiles(tmp_path).read(98, 4, SEG) == b"\x11\x11\0\0"


class Told:
    def __init__(self) -> None:
        self.told: list[tuple[str, object]] = []

    def tell(self, kind: str, body: object) -> None:
        self.told.append((kind, body))


def test_a_pin_tells_the_safekeeper_only_when_it_leaves_a_segment() -> None:
    link = Told()
    pin = RemotePin(link, 7, 10)  # type: ignore[arg-type]
    for lsn in (100, 5000, SEG - 1, 9):
        pin.move(lsn, SEG)
    assert link.told == []
    pin.move(SEG + 5, SEG)
    pin.move(3 * SEG, SEG)
    pin.release()
    assert link.told == [("pin_move", (7, SEG + 5)), ("pin_move", (7, 3 * SEG)), ("pin_release", 7)]


def test_a_snapshot_older_than_the_one_held_is_not_taken() -> None:
    """A pin's answer carries the snapshot it was taken under; pushes that arrived before the answer was
    taken up may be newer. Taking it would move the positions back (PositionWatch refuses that)."""
    def snap(seq: int, flush: int) -> Snapshot:
        return Snapshot(seq, ServerState(3, flush, flush, 0, 1, (), SEG), 7301, SEG)
    sk = RemoteSafekeeper(1, Path("/nonexistent"), None, None, snap(1, 100))  # type: ignore[arg-type]
    sk.update(snap(3, 300))
    sk.update(snap(2, 200))  # the pin's answer, older
    assert sk.reader_state().flush_lsn == 300 and sk.positions.value.flush_lsn == 300


class Host:
    """What the reader process's host needs of a safekeeper: a real Slots, WAL files in a directory."""

    node_id = 5
    system_id = 7301
    wal_seg_size = SEG

    def __init__(self, tmp: Path) -> None:
        from sidecar.safekeeper.positions import Positions, PositionWatch
        self.positions = PositionWatch(Positions(3, 2 * SEG, 2 * SEG - 100, 0))
        self.slots = Slots(tmp)
        self.pins: list[object] = []

    def reader_state(self) -> ServerState:
        p = self.positions.value
        return ServerState(p.term, p.flush_lsn, p.commit_lsn, p.generation, 1, (), SEG)

    def pin_wal(self, lsn: int, holder: str) -> WalPin:
        pin = NoWal().pin(lsn, holder)
        self.pins.append(pin)
        return pin


def hosted(tmp: Path, test) -> None:  # noqa: ANN001
    """Run `test(host_process, host)` against a real reader process, trust authentication."""
    wal = tmp / "wal"
    wal.mkdir()
    put(wal, 1, 1, 0x5A)

    async def main() -> None:
        host = Host(tmp)
        rp = ReaderProcess(host, ReaderPort("127.0.0.1", 0, None, insecure=True), wal, b"k" * 32)
        await rp.start()
        try:
            await test(rp, host)
        finally:
            await rp.close()
    run(main(), timeout=60)


def test_the_reader_process_serves_slots_and_wal_from_the_safekeepers_own(tmp_path: Path) -> None:
    async def test(rp: ReaderProcess, host: Host) -> None:
        assert rp.pid is not None and rp.pid != os.getpid()
        await until(lambda: os.sched_getscheduler(rp.pid) == os.SCHED_IDLE,
                    "the reader process to run under SCHED_IDLE")
        c = await Client.connect(rp.port)
        c.startup(user="r", replication="true")
        assert (await c.until(b"Z"))[-1][0] == b"Z"
        c.query("START_REPLICATION SLOT nope PHYSICAL 0/100000")
        got = await c.until(b"Z")
        assert got[0][0] == b"E" and b"does not exist" in got[0][1]
        c.query("CREATE_REPLICATION_SLOT s PHYSICAL")
        await c.until(b"Z")
        assert host.slots.get("s") is not None  # the safekeeper's, saved in its data directory
        c.query("START_REPLICATION SLOT s PHYSICAL 0/100000")
        assert (await c.message())[0] == b"W"
        await until(lambda: rp.streaming == 1 and host.slots.get("s").active, "the stream to be counted")
        msg = pgrepl.parse_copy_data((await c.message())[1])
        assert isinstance(msg, pgrepl.XLogData) and msg.start == SEG and set(msg.data) == {0x5A}
        c.send(b"d", pgrepl.encode_status(SEG + 50, SEG + 50, 0, 0, False))
        await until(lambda: host.slots.get("s").restart_lsn == SEG + 50, "the slot to move")
        # The reader process dies: what it held is let go, and it is started again.
        first = rp.pid
        os.kill(first, signal.SIGKILL)
        await until(lambda: not host.slots.get("s").active and rp.pid != first, "a new reader process")
        c2 = await Client.connect(rp.port)
        c2.startup(user="r", replication="true")
        assert (await c2.until(b"Z"))[-1][0] == b"Z"
    hosted(tmp_path, test)

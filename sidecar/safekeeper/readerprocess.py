"""The reader port's own process: pgserver.py and walsender.py, away from the proposer's stream.

Every reader connection, and every stranger's before it logs in, is Python that would otherwise
run under the GIL the proposer stream's thread needs after each receive, write and fdatasync,
and on the cores it needs. So the safekeeper serves its reader port from a child process
(`python -m sidecar.safekeeper.readerprocess`) that it starts, under SCHED_IDLE: a flood on the
reader port then runs only on CPU the stream does not want, and shares no interpreter with it.

The child changes nothing the safekeeper acknowledges or reports. It reads the WAL directory
read-only (`WalFiles`), listens on the socket the safekeeper bound and passed down, and learns
the rest over a socket pair to the safekeeper (readerhost.py, the other end):

* the safekeeper sends its reader state (positions, timeline history, stored range, cuts) when
  the child asks for it, which it does when a walsender waits for the positions to move: one
  snapshot per wait, the latest, and none while no reader waits (so commits cost the safekeeper
  nothing more while nobody streams);
* the cut generation is also in 8 bytes of shared memory, written before a cut is made, so that
  a read that raced a cut is thrown away even before the push that follows it arrives;
* slots and WAL pins stay the safekeeper's, which alone decides removal: the child asks for them
  (`RemoteSlots`, `reader_pin`) and tells it where its streams are.

The child exits when the socket pair closes (the safekeeper stopped or died: the kernel also
kills it then, PR_SET_PDEATHSIG); SIGINT and SIGTERM are the safekeeper's to act on, not its.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import pickle
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.consensus.reading import ServerState
from sidecar.lsn import format_lsn, parse_segment_file_name
from sidecar.safekeeper.positions import Positions, PositionWatch
from sidecar.safekeeper.slots import Slot, SlotError
from sidecar.safekeeper.storage import StorageError, read_segment_file, segment_file_rank

# The reader process runs under SCHED_IDLE: the kernel runs it only on CPU that nothing else wants, and any
# of the safekeeper's threads that wakes takes the CPU from it at once, which a nice value alone does not
# do (a niced task keeps its slice; each of a commit's wake-ups can wait behind one). Where SCHED_IDLE is
# refused, it is niced by READER_NICE instead.
READER_NICE = 19
GENERATION = struct.Struct("<Q")  # the shared cut generation
COUNTS_INTERVAL = 0.5  # seconds: how stale the safekeeper's count of reader connections may be
_FRAME = struct.Struct(">I")
_MAX_FRAME = 64 << 20
_PR_SET_PDEATHSIG = 1


# ---- the socket pair's messages: (kind, request id, body), pickled, length-prefixed --------------
# Both ends are this package, over a socket pair no one else holds: pickle reads only what we wrote.

async def receive(reader: asyncio.StreamReader) -> tuple[str, int, Any]:
    """The next message; IncompleteReadError at the other end's close."""
    n = _FRAME.unpack(await reader.readexactly(_FRAME.size))[0]
    if n > _MAX_FRAME:
        raise ConnectionError(f"a message of {n} bytes from the other end of the reader link")
    kind, rid, body = pickle.loads(await reader.readexactly(n))
    return kind, rid, body


def send(writer: asyncio.StreamWriter, kind: str, rid: int = 0, body: Any = None) -> None:
    data = pickle.dumps((kind, rid, body), protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_FRAME.pack(len(data)) + data)


@dataclass(frozen=True)
class Snapshot:
    """What the safekeeper pushes: its reader state and what names it; `seq` orders them (a pin's answer
    may carry one older than a push that arrived before the answer was taken up)."""

    seq: int
    state: ServerState
    system_id: int
    wal_seg_size: int


@dataclass(frozen=True)
class Failure:
    """A request the safekeeper refused: a SlotError (sqlstate) or a StorageError (None)."""

    message: str
    sqlstate: str | None

    def exception(self) -> Exception:
        return SlotError(self.message, self.sqlstate) if self.sqlstate is not None else StorageError(self.message)


# ---- the child's side ------------------------------------------------------------------------

class WalFiles:
    """The safekeeper's WAL directory, read from another process: segment files by number, any name.

    Names change under it (a .partial is renamed final once synced, a timeline adoption renames
    segments, removal deletes them): a segment not found where it was is looked up again once.
    """

    def __init__(self, wal_dir: Path) -> None:
        self.wal_dir = wal_dir
        self._names: dict[int, str] = {}
        self._lock = threading.Lock()  # reads run in worker threads

    def read(self, lsn: int, size: int, seg_size: int) -> bytes:
        if not seg_size:
            raise StorageError("this safekeeper stores no WAL yet")
        pieces, pos, end = [], lsn, lsn + size
        while pos < end:
            segno, off = divmod(pos, seg_size)
            n = min(end - pos, seg_size - off)
            pieces.append(read_segment_file(self._open(segno, seg_size), off, n))
            pos += n
        return b"".join(pieces)

    def _open(self, segno: int, seg_size: int) -> int:
        for attempt in range(3):
            with self._lock:
                if attempt or segno not in self._names:
                    self._scan(seg_size)
                name = self._names.get(segno)
            if name is None:
                break
            try:
                return os.open(self.wal_dir / name, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
        raise StorageError(f"the WAL segment from {format_lsn(segno * seg_size)} is not stored in {self.wal_dir}")

    def _scan(self, seg_size: int) -> None:
        """Each segment's file as the safekeeper picks it (storage.segment_file_rank)."""
        best: dict[int, tuple[tuple[bool, int], str]] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.wal_dir):
                try:
                    tli, segno, partial = parse_segment_file_name(entry.name, seg_size)
                except ValueError:
                    continue
                key = (segment_file_rank(tli, partial), entry.name)
                if segno not in best or key > best[segno]:
                    best[segno] = key
        self._names = {segno: name for segno, (_, name) in best.items()}


class RemotePin:
    """A WAL pin the safekeeper holds for one of the child's streams; moves are told a segment at a time."""

    def __init__(self, link: Link, pin_id: int, lsn: int) -> None:
        self.link, self.pin_id, self.lsn = link, pin_id, lsn

    def move(self, lsn: int, seg_size: int) -> None:
        if lsn > self.lsn:
            old, self.lsn = self.lsn, lsn
            if seg_size and old // seg_size != lsn // seg_size:
                self.link.tell("pin_move", (self.pin_id, lsn))

    def release(self) -> None:
        self.link.tell("pin_release", self.pin_id)


class RemoteSlots:
    """The safekeeper's slots as a reader connection uses them; each call names its connection."""

    def __init__(self, link: Link) -> None:
        self.link = link

    async def create(self, name: str, temporary: bool, restart_lsn: int, timeline: int, reader: str = "",
                     owner: object | None = None) -> Slot:
        slot: Slot = await self.link.ask("slot_create", (_key(owner), name, temporary, restart_lsn, timeline,
                                                         reader))
        slot.owner = owner
        return slot

    async def drop(self, name: str, owner: object | None = None) -> None:
        await self.link.ask("slot_drop", (_key(owner), name))

    async def acquire(self, name: str, owner: object | None = None) -> Slot:
        slot: Slot = await self.link.ask("slot_acquire", (_key(owner), name))
        slot.owner = owner
        return slot

    async def lookup(self, name: str) -> Slot | None:
        return await self.link.ask("slot_lookup", name)

    def release(self, slot: Slot) -> None:
        slot.active = False
        self.link.tell("slot_release", (_key(slot.owner), slot.name))

    def stream_ended(self, slot: Slot) -> None:
        slot.active = False
        self.link.tell("slot_stream_ended", (_key(slot.owner), slot.name))

    def advance(self, slot: Slot, flush_lsn: int, timeline: int) -> None:
        if flush_lsn > slot.restart_lsn and not slot.invalidated:
            slot.restart_lsn, slot.timeline = flush_lsn, timeline
            self.link.tell("slot_advance", (_key(slot.owner), slot.name, flush_lsn, timeline))


def _key(owner: object | None) -> int | None:
    """A connection, as the safekeeper knows it: its id() in this process (unique while it lives)."""
    return id(owner) if owner is not None else None


class Link:
    """The child's end of the socket pair: requests and their answers, notices, and the pushed snapshots."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._next = 0
        self._waiting: dict[int, asyncio.Future[Any]] = {}

    async def ask(self, kind: str, body: Any) -> Any:
        self._next += 1
        rid = self._next
        answer = self._waiting[rid] = asyncio.get_running_loop().create_future()
        send(self.writer, kind, rid, body)
        try:
            got = await answer
        finally:
            self._waiting.pop(rid, None)
        if isinstance(got, Failure):
            raise got.exception()
        return got

    def tell(self, kind: str, body: Any) -> None:
        send(self.writer, kind, 0, body)

    def answered(self, rid: int, body: Any) -> None:
        answer = self._waiting.get(rid)
        if answer is not None and not answer.done():
            answer.set_result(body)

    def closed(self) -> None:
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(ConnectionError("the safekeeper closed the reader link"))


class RemoteSafekeeper:
    """What pgserver.py and walsender.py need of the safekeeper (pgserver.Served), from the child."""

    def __init__(self, node_id: int, wal_dir: Path, link: Link, generation: mmap.mmap, first: Snapshot) -> None:
        self.node_id = node_id
        self.link = link
        self.slots = RemoteSlots(link)
        self.files = WalFiles(wal_dir)
        self._generation = generation
        self.snapshot = first
        p = first.state
        self.positions = PositionWatch(Positions(p.term, p.flush_lsn, p.commit_lsn, p.generation))
        self.positions.on_wait = self._want

    def _want(self) -> None:
        """A walsender waits: the safekeeper sends the next snapshot once its positions move past ours."""
        self.link.tell("want", tuple(self.positions.value))

    def update(self, snapshot: Snapshot) -> None:
        if snapshot.seq <= self.snapshot.seq:
            return
        self.snapshot = snapshot
        p = snapshot.state
        now = Positions(p.term, p.flush_lsn, p.commit_lsn, p.generation)
        if now == self.positions.value and self.positions.waiting:
            self._want()  # asked for with older positions, answered with ours (a pin's answer came first)
        self.positions.publish(now)

    @property
    def system_id(self) -> int:
        return self.snapshot.system_id

    @property
    def wal_seg_size(self) -> int:
        return self.snapshot.wal_seg_size

    def reader_state(self) -> ServerState:
        return self.snapshot.state

    def read_wal(self, lsn: int, size: int) -> bytes:
        return self.files.read(lsn, size, self.snapshot.wal_seg_size)

    def cut_generation(self) -> int:
        return int(GENERATION.unpack_from(self._generation, 0)[0])

    async def current_state(self) -> ServerState:
        self.update(await self.link.ask("snapshot", None))
        return self.snapshot.state

    async def reader_pin(self, lsn: int, holder: str) -> RemotePin:
        """Held by the safekeeper before this returns; the snapshot is the one it pinned under, so the
        stored range a cursor checks is not older than the pin."""
        pin_id, snapshot = await self.link.ask("pin", (lsn, holder))
        self.update(snapshot)
        return RemotePin(self.link, pin_id, lsn)


async def _serve(ctl: socket.socket, listener: socket.socket, generation: mmap.mmap, scheduling: str) -> None:
    from sidecar.logs import get_logger
    from sidecar.safekeeper.pgserver import ReaderPort, ReaderServer

    reader, writer = await asyncio.open_connection(sock=ctl)
    try:
        kind, _, spec = await receive(reader)
        kind, _, first = await receive(reader)
    except (asyncio.IncompleteReadError, ConnectionError):
        return  # the safekeeper stopped before it told us what to serve
    link = Link(reader, writer)
    sk = RemoteSafekeeper(spec["node_id"], Path(spec["wal_dir"]), link, generation, first)
    options = ReaderPort.from_spec(spec["port"])
    server = ReaderServer(sk, options, mock_secret=spec["mock_secret"], sock=listener)
    counted, due = (-1, -1), False
    loop = asyncio.get_running_loop()

    def tell_counts() -> None:
        nonlocal counted, due
        due = False
        now = (len(server.connections), server.streaming)
        if now != counted:
            counted = now
            link.tell("counts", now)

    def count() -> None:
        # At most every COUNTS_INTERVAL: a flood of connections does not wake the safekeeper for each.
        nonlocal due
        if not due:
            due = True
            loop.call_later(COUNTS_INTERVAL, tell_counts)
    server.on_count = count
    await server.start()
    get_logger(node=spec["node_id"], port="reader").info("reader process serving", pid=os.getpid(),
                                                          scheduling=scheduling)
    try:
        while True:
            try:
                kind, rid, body = await receive(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if kind == "state":
                sk.update(body)
            elif kind == "answer":
                link.answered(rid, body)
    finally:
        link.closed()
        await server.close()
        get_logger(node=spec["node_id"], port="reader").info("reader process stopping: the safekeeper closed "
                                                              "its link")


def main() -> None:
    """Entry point: `LOG_FORMAT LOG_LEVEL LINK_FD LISTEN_FD GENERATION_FD`, as readerhost.py starts it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        return  # the safekeeper died before the line above took effect
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the safekeeper stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fmt, level, ctl_fd, listen_fd, generation_fd = sys.argv[1:6]
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # the threads it starts inherit it
        scheduling = "SCHED_IDLE"
    except (OSError, AttributeError):
        os.nice(READER_NICE)
        scheduling = f"nice {READER_NICE}"
    ctl = socket.socket(fileno=int(ctl_fd))
    listener = socket.socket(fileno=int(listen_fd))
    generation = mmap.mmap(int(generation_fd), GENERATION.size, prot=mmap.PROT_READ)
    os.close(int(generation_fd))
    from sidecar.logs import configure
    configure(fmt, level)
    asyncio.run(_serve(ctl, listener, generation, scheduling))


if __name__ == "__main__":
    # Run as the imported module, not as __main__: what the link unpickles must be of the same classes.
    from sidecar.safekeeper import readerprocess
    readerprocess.main()

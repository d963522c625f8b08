"""The reader port's process (readerprocess.py) from the safekeeper's side: start it, answer it, restart it.

The safekeeper binds the reader port itself, so that an address it cannot have stops it at start
with the usual message, then hands the socket to the child. It sends the child its reader state
when the child asks (a walsender of it waits) and its positions moved past what it sent, writes
the cut generation into shared memory before each cut, and answers the child's requests for slots
and WAL pins with its own `Slots` and `WalStorage`, which stay the only owners of both. Whatever the
child held (pins, acquired slots, temporary slots) is let go when it exits; if that was not the
safekeeper's doing, it is started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import os
import socket
import sys
from typing import Any, Protocol

from sidecar.address import cannot_listen
from sidecar.consensus.reading import ServerState
from sidecar.logs import current as log_settings, get_logger
from sidecar.safekeeper.pgserver import ReaderPort
from sidecar.safekeeper.positions import PositionWatch
from sidecar.safekeeper.readerprocess import GENERATION, Failure, Snapshot, receive, send
from sidecar.safekeeper.slots import Slot, SlotError, Slots
from sidecar.safekeeper.storage import StorageError, WalPin

RESTART_DELAY = 1.0  # seconds between a reader process that died and the next one
STOP_WAIT = 5.0  # seconds the reader process has to exit once its link is closed, before SIGKILL
_LISTEN_BACKLOG = 128


class Hosting(Protocol):
    """What the host needs of the safekeeper."""

    node_id: int
    positions: PositionWatch
    slots: Slots

    def reader_state(self) -> ServerState: ...

    def pin_wal(self, lsn: int, holder: str) -> WalPin: ...

    @property
    def system_id(self) -> int: ...

    @property
    def wal_seg_size(self) -> int: ...


class ReaderProcess:
    """The reader port of one safekeeper, served by a child process."""

    def __init__(self, sk: Hosting, options: ReaderPort, wal_dir: os.PathLike[str], mock_secret: bytes) -> None:
        self.sk, self.options = sk, options
        self.wal_dir, self.mock_secret = wal_dir, mock_secret
        self.log = get_logger(node=sk.node_id, port="reader")
        self.port = options.port
        self.connections = 0  # as the child last told
        self.streaming = 0
        self.pid: int | None = None
        self._listener: socket.socket | None = None
        self._generation_fd = -1
        self._generation: mmap.mmap | None = None
        self._written_generation = 0
        self._closing = False
        self._supervisor: asyncio.Task[None] | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._ctl: socket.socket | None = None
        self._seq = 0  # of the snapshots sent

    # ---- the cut generation, from any thread (the safekeeper writes it under its acceptor lock)

    def cut_coming(self, generation: int) -> None:
        """The acceptor's cut generation is `generation`: written before the cut it announces is made."""
        if generation != self._written_generation and self._generation is not None:
            GENERATION.pack_into(self._generation, 0, generation)
            self._written_generation = generation

    # ---- life ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the port and start the child; OSError naming the address when it cannot be bound."""
        o = self.options
        listener = socket.socket(socket.AF_INET6 if ":" in o.host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            await _bind(listener, o.host, o.port, self.log)
            listener.listen(_LISTEN_BACKLOG)
        except OSError as e:
            listener.close()
            raise cannot_listen(o.host, o.port, "the reader port (--pg-listen)", e) from e
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._generation_fd = os.memfd_create("walsidecar-cut-generation", os.MFD_CLOEXEC)
        os.ftruncate(self._generation_fd, GENERATION.size)
        self._generation = mmap.mmap(self._generation_fd, GENERATION.size)
        self.cut_coming(self.sk.reader_state().generation)
        await self._spawn()
        self._supervisor = asyncio.create_task(self._supervise())

    async def close(self) -> None:
        self._closing = True
        if self._ctl is not None:
            with contextlib.suppress(OSError):
                self._ctl.shutdown(socket.SHUT_RDWR)  # the child sees the end of its link and stops
        proc = self._proc
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), STOP_WAIT)
            except TimeoutError:
                self.log.warning("the reader process did not stop; killing it", pid=proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        if self._listener is not None:
            self._listener.close()
        if self._generation is not None:
            self._generation.close()
            os.close(self._generation_fd)
            self._generation = None

    async def _spawn(self) -> None:
        assert self._listener is not None
        mine, theirs = socket.socketpair()
        fmt, level = log_settings()
        fds = (theirs.fileno(), self._listener.fileno(), self._generation_fd)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar.safekeeper.readerprocess", fmt, level,
            *map(str, fds), stdin=asyncio.subprocess.DEVNULL, pass_fds=fds)
        theirs.close()
        self._proc, self._ctl, self.pid = proc, mine, proc.pid
        self.log.info("reader process started", pid=proc.pid)

    async def _supervise(self) -> None:
        while True:
            assert self._proc is not None and self._ctl is not None
            proc, ctl = self._proc, self._ctl
            held = _Held()
            try:
                await self._converse(ctl, held)
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                pass
            finally:
                held.let_go(self.sk.slots)
                ctl.close()
                self.connections = self.streaming = 0
            code = await proc.wait()
            if self._closing:
                return
            self.log.warning("the reader process exited; starting it again", pid=proc.pid, exit_code=code,
                             delay_seconds=RESTART_DELAY)
            await asyncio.sleep(RESTART_DELAY)
            if self._closing:
                return
            await self._spawn()

    async def _converse(self, ctl: socket.socket, held: _Held) -> None:
        reader, writer = await asyncio.open_connection(sock=ctl)
        spec = {"node_id": self.sk.node_id, "wal_dir": os.fspath(self.wal_dir), "port": self.options.to_spec(),
                "mock_secret": self.mock_secret}
        send(writer, "spec", 0, spec)
        send(writer, "state", 0, self._snapshot())
        pusher = asyncio.create_task(self._push(writer, held))
        try:
            while True:
                kind, rid, body = await receive(reader)
                try:
                    answer = await self._answer(kind, body, held)
                except (SlotError, StorageError) as e:
                    answer = Failure(str(e), getattr(e, "sqlstate", None))
                if rid:
                    send(writer, "answer", rid, answer)
        finally:
            pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await pusher
            writer.close()

    def _snapshot(self) -> Snapshot:
        self._seq += 1
        return Snapshot(self._seq, self.sk.reader_state(), self.sk.system_id, self.sk.wal_seg_size)

    async def _push(self, writer: asyncio.StreamWriter, held: _Held) -> None:
        """Each time the child asks, the latest reader state once its positions differ from the child's."""
        while True:
            await held.wanted.wait()
            held.wanted.clear()
            past = held.past
            await self.sk.positions.wait(lambda now: tuple(now) != past)
            send(writer, "state", 0, self._snapshot())
            await writer.drain()

    async def _answer(self, kind: str, body: Any, held: _Held) -> Any:
        slots = self.sk.slots
        match kind:
            case "snapshot":
                return self._snapshot()
            case "want":  # body: the positions the child has
                held.past = tuple(body)
                held.wanted.set()
            case "counts":
                self.connections, self.streaming = body
            case "pin":
                lsn, holder = body
                pin = self.sk.pin_wal(lsn, holder)
                return held.add_pin(pin), self._snapshot()
            case "pin_move":
                pin_id, lsn = body
                pin = held.pins.get(pin_id)
                if pin is not None:
                    pin.move(lsn, self.sk.wal_seg_size)
            case "pin_release":
                pin = held.pins.pop(body, None)
                if pin is not None:
                    pin.release()
            case "slot_create":
                owner, name, temporary, lsn, timeline, reader = body
                slot = await slots.create(name, temporary, lsn, timeline, reader=reader, owner=owner)
                if temporary:
                    held.slots[(owner, name)] = slot
                return slot
            case "slot_drop":
                owner, name = body
                await slots.drop(name, owner=owner)
                held.slots.pop((owner, name), None)
            case "slot_acquire":
                owner, name = body
                slot = await slots.acquire(name, owner=owner)
                held.slots[(owner, name)] = slot
                return slot
            case "slot_lookup":
                return await slots.lookup(body)
            case "slot_release":
                slot = held.slots.pop(tuple(body), None)
                if slot is not None:
                    slots.release(slot)
            case "slot_stream_ended":
                slot = held.slots.get(tuple(body))
                if slot is not None:
                    slots.stream_ended(slot)
                    if not slot.temporary:
                        del held.slots[tuple(body)]
            case "slot_advance":
                owner, name, lsn, timeline = body
                slot = held.slots.get((owner, name))
                if slot is not None:
                    slots.advance(slot, lsn, timeline)
            case _:
                raise ConnectionError(f"the reader process asked for {kind!r}")
        return None


class _Held:
    """What one reader process holds of the safekeeper's: let go when it exits."""

    def __init__(self) -> None:
        self.wanted = asyncio.Event()  # the child asked for the next snapshot
        self.past: tuple[int, ...] = ()  # the positions it has
        self.pins: dict[int, WalPin] = {}
        self.slots: dict[tuple[int | None, str], Slot] = {}
        self._next = 0

    def add_pin(self, pin: WalPin) -> int:
        self._next += 1
        self.pins[self._next] = pin
        return self._next

    def let_go(self, slots: Slots) -> None:
        for pin in self.pins.values():
            pin.release()
        for slot in self.slots.values():
            slots.release(slot)
        self.pins.clear()
        self.slots.clear()


async def _bind(listener: socket.socket, host: str, port: int, log: Any) -> None:
    """Bind, waiting a little while the port is still held by a reader process whose safekeeper was killed:
    the kernel kills it with its parent (PR_SET_PDEATHSIG), but after that parent could be restarted."""
    for attempt in range(50):
        try:
            listener.bind((host, port))
            return
        except OSError as e:
            if e.errno != errno.EADDRINUSE or not port or attempt == 49:
                raise
            if attempt == 0:
                log.info("the reader port is still in use; waiting for it", address=f"{host}:{port}")
            await asyncio.sleep(0.1)

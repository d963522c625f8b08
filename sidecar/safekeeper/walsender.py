"""One START_REPLICATION on the reader port: XLogData up to what `ReadCursor` allows, as walsender.c does.

The cursor (consensus/reading.py) decides what may be sent; this loop reads it from storage,
sends it at most MAX_SEND_SIZE at a time and waits for the socket to drain before reading more,
so memory per reader is bounded and a slow reader only slows itself; the replies it asks for wait
for the same drain before more of its messages are read. When there is nothing to
send it waits on the safekeeper's published positions, not a timer. Keepalives ask for a reply
after half the timeout (--pg-wal-sender-timeout, WAL_SENDER_TIMEOUT unless given) of silence from the reader,
which is dropped after the whole timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from sidecar import pgrepl, pgwire
from sidecar.timelines import TimelineEntry
from sidecar.consensus.reading import ReadCursor, ReadRefused, Send, ServerState, TimelineDone, Wait, readable_end
from sidecar.lsn import format_lsn
from sidecar.safekeeper.positions import PositionWatch
from sidecar.safekeeper.slots import Slot
from sidecar.safekeeper.storage import StorageError

WAL_SENDER_TIMEOUT = 60.0  # PostgreSQL's wal_sender_timeout default


class StreamEnded(Exception):
    """The reader broke the protocol or went silent: the connection ends (FATAL, then close)."""


class Pin(Protocol):
    """A lease on stored WAL held for a stream (storage.WalPin, or the reader process's RemotePin)."""

    def move(self, lsn: int, seg_size: int) -> None: ...

    def release(self) -> None: ...


class ReaderSlots(Protocol):
    """The slots as reader connections use them (slots.Slots, or the reader process's RemoteSlots)."""

    async def create(self, name: str, temporary: bool, restart_lsn: int, timeline: int, reader: str = "",
                     owner: object | None = None) -> Slot: ...

    async def drop(self, name: str, owner: object | None = None) -> None: ...

    async def acquire(self, name: str, owner: object | None = None) -> Slot: ...

    async def lookup(self, name: str) -> Slot | None: ...

    def release(self, slot: Slot) -> None: ...

    def stream_ended(self, slot: Slot) -> None: ...

    def advance(self, slot: Slot, flush_lsn: int, timeline: int) -> None: ...


class Served(Protocol):
    """What a walsender needs of the safekeeper."""

    positions: PositionWatch

    @property
    def wal_seg_size(self) -> int: ...

    def reader_state(self) -> ServerState: ...

    def read_wal(self, lsn: int, size: int) -> bytes: ...

    def cut_generation(self) -> int:
        """The cut generation now: ahead of the published one from before a cut is made until it is published."""
        ...

    async def reader_pin(self, lsn: int, holder: str) -> Pin:
        """A pin held from `lsn` on; `reader_state()` afterwards is no older than it."""
        ...


def now() -> int:
    return pgrepl.pg_time(time.time_ns())


class WalSender:
    """Streams one reader; `run()` returns when the stream ended normally (the command completes)."""

    def __init__(self, sk: Served, writer: asyncio.StreamWriter,
                 receive: Callable[[], Awaitable[pgwire.FrontendMessage]], cmd: pgrepl.StartReplication,
                 slot: Slot | None, slots: ReaderSlots, log: Any, timeout: float = WAL_SENDER_TIMEOUT) -> None:
        self.sk, self.writer, self.receive = sk, writer, receive
        self.cmd, self.slot, self.slots = cmd, slot, slots
        self.log = log
        self.timeout = timeout
        self.client_done = False  # the reader sent CopyDone
        self.sent_bytes = 0
        self.last_heard = time.monotonic()
        self.pinged = False  # a keepalive asked for a reply since the reader was last heard

    async def run(self) -> None:
        """ReadRefused before streaming starts (an ERROR for the command); StreamEnded for a broken reader."""
        # Pinned before the cursor checks what is stored: nothing it may send is removed under it.
        pin = await self.sk.reader_pin(self.cmd.lsn, f'reader slot "{self.cmd.slot}"' if self.cmd.slot
                                       else "a reader")
        try:
            cursor = ReadCursor(self.cmd.lsn, self.cmd.timeline, self.sk.reader_state(), self.cmd.term)
        except BaseException:
            pin.release()
            raise
        self.pin = pin
        historic = cursor.timeline != self.sk.reader_state().timeline
        self.writer.write(pgwire.copy_both_response())
        self.log.info("streaming", start_lsn=format_lsn(self.cmd.lsn), timeline=cursor.timeline,
                      slot=self.cmd.slot, term=self.cmd.term or None)
        receiver = asyncio.create_task(self._receive())
        try:
            ended = await self._send(cursor, receiver)
        finally:
            pin.release()
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, StreamEnded):
                await receiver
        if ended is None and historic:  # the reader stopped first: it is still told what follows
            s = self.sk.reader_state()
            ended = pgrepl.timeline_end(s.history, s.timeline, cursor.timeline)
        if ended is not None:
            self.writer.write(pgwire.result([("next_tli", pgwire.INT8_OID), ("next_tli_startpos", pgwire.TEXT_OID)],
                                            [(str(ended.timeline), format_lsn(ended.switch_lsn))], "START_STREAMING"))
        else:
            self.writer.write(pgwire.command_complete("START_STREAMING"))
        # walsender.c completes the command twice: pg_receivewal reads the next timeline's row, then
        # insists on a CommandComplete of its own before it follows that timeline.
        self.writer.write(pgwire.command_complete("START_REPLICATION"))

    async def _send(self, cursor: ReadCursor, receiver: asyncio.Task[None]) -> TimelineEntry | None:
        """Send until the reader or the timeline ends; the timeline that follows, if it ended."""
        changed: asyncio.Task[Any] | None = None
        done_sent: TimelineEntry | None = None
        try:
            while True:
                if receiver.done():
                    receiver.result()  # StreamEnded, or the reader's CopyDone
                    if self.client_done:
                        if done_sent is None:
                            self.writer.write(pgwire.copy_done())
                        return done_sent
                state = self.sk.reader_state()
                step = cursor.next(state) if done_sent is None else Wait(cursor.sent)
                if type(step) is Send:
                    await self._send_wal(cursor, step, state)
                    continue
                if type(step) is TimelineDone:
                    # walsender.c: CopyDone, then wait for the reader's CopyDone, then the next timeline.
                    self.writer.write(pgwire.copy_done())
                    done_sent = pgrepl.timeline_end(state.history, state.timeline, cursor.timeline)
                    self.log.info("end of timeline", timeline=cursor.timeline, next_timeline=step.next_timeline,
                                  switch_lsn=format_lsn(step.switch_lsn))
                    continue
                # Wait: for the positions, the reader, or the keepalive deadline.
                wait = self._keepalive(step.wal_end if done_sent is None else cursor.sent)
                if changed is None or changed.done():
                    changed = asyncio.ensure_future(self.sk.positions.changed())
                await asyncio.wait((changed, receiver), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if changed is not None:
                changed.cancel()

    def _keepalive(self, wal_end: int) -> float:
        """Ping the reader or give up on it as walsender.c does; seconds until the next deadline."""
        silent = time.monotonic() - self.last_heard
        if silent >= self.timeout:
            raise StreamEnded(f"terminating the stream due to replication timeout: nothing from the reader "
                              f"for {self.timeout:g}s")
        if silent >= self.timeout / 2 and not self.pinged:
            self.writer.write(pgwire.copy_data(pgrepl.encode_keepalive(wal_end, now(), True)))
            self.pinged = True
        return (self.timeout / 2 if not self.pinged else self.timeout) - silent

    async def _send_wal(self, cursor: ReadCursor, step: Send, state: ServerState) -> None:
        try:
            data = await asyncio.to_thread(self.sk.read_wal, step.start, step.end - step.start)
        except StorageError:
            if self.sk.cut_generation() == state.generation:
                raise
            data = b""
        if self.sk.cut_generation() != state.generation:
            # A cut raced the read: what was read may be gone. The cursor decides again once the
            # positions after the cut are published (the generation is written before the cut is made).
            await self.sk.positions.wait(lambda p: p.generation != state.generation)
            return
        if len(data) != step.end - step.start:
            return
        wal_end = readable_end(state, cursor.term)
        self.writer.writelines((pgwire.copy_data_header(pgrepl.XLOGDATA_HEADER + len(data)),
                                pgrepl.xlogdata_header(step.start, max(wal_end, step.end), now()), data))
        cursor.advance(step.end)
        self.pin.move(step.end, self.sk.wal_seg_size)
        self.sent_bytes += len(data)
        await self._drained("WAL")  # at most one message per reader waits in memory

    async def _drained(self, what: str) -> None:
        """Wait while the send buffer is above its high-water mark; StreamEnded if it stays there.

        Also after each reply: a reader that asks for replies and never reads them is not read from
        until it does, so what it makes the safekeeper buffer is bounded (the kernel holds the rest).
        """
        try:
            async with asyncio.timeout(self.timeout):
                await self.writer.drain()
        except TimeoutError:
            raise StreamEnded(f"terminating the stream: the reader took no {what} for {self.timeout:g}s") from None

    async def _receive(self) -> None:
        """The reader's messages while streaming: status moves the slot; CopyDone ends the stream."""
        while True:
            msg = await self.receive()
            self.last_heard = time.monotonic()
            self.pinged = False
            if type(msg) is pgwire.CopyData:
                try:
                    reply = pgrepl.parse_copy_data(msg.data)
                except pgrepl.ReplicationProtocolError as e:
                    raise StreamEnded(f"invalid standby message: {e}") from None
                if type(reply) is pgrepl.StandbyStatus:
                    if self.slot is not None and reply.flush:
                        s = self.sk.reader_state()
                        self.slots.advance(self.slot, reply.flush, pgrepl.timeline_of(s.history, s.timeline,
                                                                                      reply.flush))
                    if reply.reply_requested:
                        end = readable_end(self.sk.reader_state(), self.cmd.term)
                        self.writer.write(pgwire.copy_data(pgrepl.encode_keepalive(end, now(), False)))
                        await self._drained("replies")
                elif type(reply) is not pgrepl.HotStandbyFeedback:
                    raise StreamEnded(f"unexpected standby message {type(reply).__name__}")
            elif type(msg) is pgwire.CopyDone:
                self.client_done = True
                return
            elif type(msg) is pgwire.CopyFail:
                raise StreamEnded(f"the reader ended the stream with CopyFail: {msg.message}")
            elif type(msg) is pgwire.Terminate:
                raise StreamEnded("the reader terminated the connection")
            else:
                raise StreamEnded(f"unexpected message {type(msg).__name__} while streaming")


__all__ = ["ReadRefused", "StreamEnded", "WalSender", "WAL_SENDER_TIMEOUT"]

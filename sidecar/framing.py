"""Reading protocol frames straight from the socket into the buffers that keep them.

asyncio's StreamReader copies every byte several times (into its buffer, out again with
`readexactly`, and shifts the rest down), and a safekeeper receives all WAL through it.
`FrameReader` is a buffered protocol instead: small frames are parsed out of one reusable
buffer, and a large frame (an Append) is received by the kernel directly into a buffer of
its own that becomes the message's `data` without another copy. The safekeeper's server and
the proposer's links to safekeepers both read through it.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from sidecar.consensus import codec, limits
from sidecar.consensus.messages import Append, Message

_LEN = struct.Struct(">I")
_APPEND = struct.Struct(">QQQQ")  # term, begin_lsn, commit_lsn, peer_horizon_lsn
_HEADER = codec.FRAME_HEADER_SIZE
_SCRATCH = 256 * 1024  # receive buffer for small frames; larger ones get their own
_OWN_BUFFER_AT = 16 * 1024  # frames at least this long are received into a buffer of their own
_PAUSE_AT = 8 * 1024 * 1024  # decoded WAL waiting for the reader before reading pauses


class FrameReader(asyncio.BufferedProtocol):
    """A buffered protocol that decodes frames as they arrive; `read_message()` hands them out.

    Errors surface in order: messages decoded before a malformed frame are returned first,
    then ProtocolError; after EOF, asyncio.IncompleteReadError; after a reset, the ConnectionError.
    It also serves as the protocol of a StreamWriter (write flow control for `drain()`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._writing_paused = False
        self._drain_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._lost = False
        self._scratch = bytearray(_SCRATCH)
        self._start = 0  # unparsed bytes are _scratch[_start:_end]
        self._end = 0
        self._frame: bytearray | None = None  # a large frame being received, header included
        self._frame_got = 0
        self._messages: collections.deque[tuple[Message, int]] = collections.deque()
        self._queued = 0
        self._reading_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._eof = False
        self._closed_fut: asyncio.Future[None] = self._loop.create_future()
        # Largest frame accepted next; the owner raises it once it trusts the peer (an
        # unauthenticated header must not make us allocate codec.MAX_FRAME).
        self.max_frame = limits.PREAUTH_MAX_FRAME

    # -- protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._frame is not None:
            return memoryview(self._frame)[self._frame_got:]
        if self._end == len(self._scratch):
            # Move the unparsed tail to the front; it is shorter than _OWN_BUFFER_AT or
            # part of a frame header, so this is cheap.
            tail = self._end - self._start
            self._scratch[:tail] = self._scratch[self._start:self._end]
            self._start, self._end = 0, tail
        return memoryview(self._scratch)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._frame is not None:
                self._frame_got += nbytes
                if self._frame_got == len(self._frame):
                    frame, self._frame = self._frame, None
                    self._push(_decode_owned(frame))
            else:
                self._end += nbytes
                self._parse()
        except codec.ProtocolError as e:
            self._error = e
            if self.transport is not None:
                self.transport.pause_reading()
        self._wake()

    def data_received(self, data: bytes) -> None:
        """For event loops that hand over bytes instead of filling get_buffer()."""
        view = memoryview(data)
        while view:
            buf = self.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("Connection lost") if exc is None else exc)
        self._drain_waiters.clear()
        if exc is not None and self._error is None:
            self._error = exc if isinstance(exc, ConnectionError) else ConnectionResetError(str(exc))
        self._eof = True
        self._wake()
        if not self._closed_fut.done():
            self._closed_fut.set_result(None)

    # -- the writing side, as StreamWriter expects of its protocol

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    async def _drain_helper(self) -> None:
        if self._lost:
            raise ConnectionResetError("Connection lost")
        if not self._writing_paused:
            return
        waiter = self._loop.create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def _get_close_waiter(self, stream: Any) -> asyncio.Future[None]:
        return self._closed_fut

    # -- parsing

    def _parse(self) -> None:
        buf, pos, end = self._scratch, self._start, self._end
        while end - pos >= _HEADER:
            (length,) = _LEN.unpack_from(buf, pos)
            if length == 0 or length > self.max_frame:
                _reject_length(length, self.max_frame)
            stop = pos + _HEADER + length
            if stop > end:
                if length >= _OWN_BUFFER_AT:
                    # Receive the rest of this frame directly into its own buffer.
                    frame = bytearray(_HEADER + length)
                    frame[:end - pos] = buf[pos:end]
                    self._frame, self._frame_got = frame, end - pos
                    pos = end
                break
            with memoryview(buf) as view:
                body = bytes(view[pos + _HEADER + 1:stop])
            self._push(codec.decode(buf[pos + _HEADER], body))
            pos = stop
        if pos == end:
            pos = end = 0
        self._start, self._end = pos, end

    def _push(self, msg: Message) -> None:
        size = len(msg.data) if isinstance(msg, Append) else 64
        self._messages.append((msg, size))
        self._queued += size
        if self._queued > _PAUSE_AT and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- the reading side

    def has_messages(self) -> bool:
        """True if a decoded message waits for read_message()."""
        return bool(self._messages)

    async def read_message(self) -> Message:
        """The next message; ProtocolError, ConnectionError or IncompleteReadError when there is none."""
        while not self._messages:
            if self._error is not None:
                raise self._error
            if self._eof:
                partial = self._end - self._start + (self._frame_got if self._frame is not None else 0)
                raise asyncio.IncompleteReadError(b"", partial or None)
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        msg, size = self._messages.popleft()
        self._queued -= size
        if self._reading_paused and self._queued <= _PAUSE_AT // 2 and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return msg


def write(writer: asyncio.StreamWriter, *parts: bytes | memoryview) -> bool:
    """Queue frame bytes unless the connection is closing; False if they were dropped.

    A peer may vanish between two messages. asyncio's transports ignore writes after that,
    uvloop's raise RuntimeError; either way the reading side reports the lost connection.
    """
    transport = writer.transport
    if transport.is_closing():
        return False
    for part in parts:
        transport.write(part)
    return True


def _reject_length(length: int, limit: int) -> None:
    if length == 0:
        raise codec.ProtocolError("frame length 0: a frame holds at least its tag byte")
    raise codec.ProtocolError(f"frame length {length} exceeds the maximum of {limit} for this connection")


def _decode_owned(frame: bytearray) -> Message:
    """Decode a whole frame held in its own buffer; Append data stays a view of that buffer."""
    tag = frame[_HEADER]
    body = memoryview(frame)[_HEADER + 1:]
    if tag == codec.TAG_APPEND and len(body) >= _APPEND.size:
        term, begin, commit, horizon = _APPEND.unpack_from(body)
        return Append(term, begin, commit, horizon, body[_APPEND.size:])
    return codec.decode(tag, bytes(body))


async def start_server(
    connected: Callable[[FrameReader, asyncio.StreamWriter], Awaitable[None]], host: str, port: int,
    **kwargs: Any,
) -> asyncio.Server:
    """Like asyncio.start_server, with a FrameReader in place of the StreamReader."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    class _ServerFrameReader(FrameReader):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            writer = asyncio.StreamWriter(transport, self, None, loop)  # type: ignore[arg-type]
            task = loop.create_task(connected(self, writer))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    return await loop.create_server(lambda: _ServerFrameReader(loop), host, port, **kwargs)


async def open_connection(host: str, port: int, **kwargs: Any) -> tuple[FrameReader, asyncio.StreamWriter]:
    """Like asyncio.open_connection, with a FrameReader in place of the StreamReader."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(lambda: FrameReader(loop), host, port, **kwargs)
    return protocol, asyncio.StreamWriter(transport, protocol, None, loop)

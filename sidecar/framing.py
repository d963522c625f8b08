"""Protocol frames over asyncio: a buffered protocol around the frame decoder (`codec.FrameDecoder`), and its writer.

asyncio's StreamReader copies every byte several times (into its buffer, out again with
`readexactly`, and shifts the rest down). `FrameReader` is a buffered protocol instead: the kernel receives into the decoder's own
memory (a large Append into a buffer that becomes its `data`), and decoded messages queue
until `read_message()` takes them. `Writer` is the other half: writes, flow control and
closing, on the same protocol. The proposer's links to safekeepers and the tools' probes use
them; the safekeeper's own port is served by blocking threads (safekeeper/proposerport.py).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from sidecar.consensus import codec, limits
from sidecar.consensus.messages import Append, Message

_PAUSE_AT = 8 * 1024 * 1024  # decoded WAL waiting for the reader before reading pauses


class FrameReader(asyncio.BufferedProtocol):
    """A buffered protocol that decodes frames as they arrive; `read_message()` hands them out.

    Errors surface in order: messages decoded before a malformed frame are returned first,
    then ProtocolError; after EOF, asyncio.IncompleteReadError; after a reset, the ConnectionError.
    Frames longer than `max_frame` are refused; it starts at the limit for a peer nobody has
    authenticated yet, and whoever authenticates the peer raises it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, max_frame: int = limits.PREAUTH_MAX_FRAME) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._decoder = codec.FrameDecoder(max_frame)
        self._writing_paused = False
        self._drain_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._lost = False
        self._messages: collections.deque[tuple[Message, int]] = collections.deque()
        self._queued = 0
        self._reading_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._eof = False
        self._closed: asyncio.Future[None] = loop.create_future()

    @property
    def max_frame(self) -> int:
        return self._decoder.max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        self._decoder.max_frame = value

    # -- protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        out: list[Message] = []
        try:
            self._decoder.buffer_updated(nbytes, out)
        except codec.ProtocolError as e:
            self._error = e
            if self.transport is not None:
                self.transport.pause_reading()
        for msg in out:
            self._push(msg)
        self._wake()

    def data_received(self, data: bytes) -> None:
        """For event loops that hand over bytes instead of filling get_buffer()."""
        view = memoryview(data)
        pos = 0
        while pos < len(view) and self._error is None:
            buf = self.get_buffer(len(view) - pos)
            n = min(len(buf), len(view) - pos)
            buf[:n] = view[pos:pos + n]
            self.buffer_updated(n)
            pos += n

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
        if not self._closed.done():
            self._closed.set_result(None)

    # -- write flow control, for Writer.drain()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    async def _writable(self) -> None:
        if self._lost:
            raise ConnectionResetError("Connection lost")
        if not self._writing_paused:
            return
        waiter = self._loop.create_future()
        self._drain_waiters.append(waiter)
        await waiter

    # -- the reading side

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

    def has_messages(self) -> bool:
        """True if a decoded message waits for read_message()."""
        return bool(self._messages)

    async def read_message(self) -> Message:
        """The next message; ProtocolError, ConnectionError or IncompleteReadError when there is none."""
        while not self._messages:
            if self._error is not None:
                raise self._error
            if self._eof:
                raise asyncio.IncompleteReadError(b"", self._decoder.pending or None)
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


class Writer:
    """The sending half of a connection: frame bytes out, flow control and closing."""

    def __init__(self, transport: asyncio.Transport, protocol: FrameReader) -> None:
        self.transport = transport
        self._protocol = protocol

    def write(self, *parts: bytes | bytearray | memoryview) -> bool:
        """Queue frame bytes unless the connection is closing; False if they were dropped.

        A peer may vanish between two messages. asyncio's transports ignore writes after that,
        uvloop's raise RuntimeError; either way the reading side reports the lost connection.
        """
        transport = self.transport
        if transport.is_closing():
            return False
        for part in parts:
            transport.write(part)
        return True

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its high-water mark; ConnectionError if it is gone."""
        await self._protocol._writable()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def write_eof(self) -> None:
        self.transport.write_eof()

    def close(self) -> None:
        self.transport.close()

    async def wait_closed(self) -> None:
        await self._protocol._closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)


def write(writer: Writer, *parts: bytes | bytearray | memoryview) -> bool:
    """`writer.write(*parts)`: queue frame bytes unless the connection is closing."""
    return writer.write(*parts)


async def start_server(
    connected: Callable[[FrameReader, Writer], Awaitable[None]], host: str, port: int,
    tls: ssl.SSLContext | None = None, handshake_timeout: float = 10.0, **kwargs: Any,
) -> asyncio.Server:
    """Like asyncio.start_server, with a FrameReader and a Writer in place of the streams (the
    proposer's tests serve fake safekeepers with it; the safekeeper's own port is proposerport.py)."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    class _ServerFrameReader(FrameReader):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            task = loop.create_task(connected(self, Writer(transport, self)))  # type: ignore[arg-type]
            tasks.add(task)
            task.add_done_callback(_finished)

    def _finished(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # the handler logged it; no "exception was never retrieved" on top

    if tls is not None:
        kwargs.update(ssl=tls, ssl_handshake_timeout=handshake_timeout)
    return await loop.create_server(lambda: _ServerFrameReader(loop), host, port, **kwargs)


async def open_connection(host: str, port: int, max_frame: int = codec.REPLY_MAX_FRAME,
                          **kwargs: Any) -> tuple[FrameReader, Writer]:
    """Like asyncio.open_connection, with a FrameReader and a Writer; replies up to `max_frame`."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(lambda: FrameReader(loop, max_frame), host, port, **kwargs)
    return protocol, Writer(transport, protocol)  # type: ignore[arg-type]


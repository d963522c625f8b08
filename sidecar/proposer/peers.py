"""Connections from the proposer to safekeepers: connect, reconnect with backoff, frame I/O."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from sidecar.consensus import codec
from sidecar.consensus.messages import Message
from sidecar.logs import get_logger


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a safekeeper address: {text!r} (expected HOST:PORT)")
    return host, int(port)


class PeerLink:
    """One safekeeper: keeps a TCP connection up and hands whole messages to callbacks."""

    def __init__(self, name: str, on_up: Callable[[str], None], on_message: Callable[[str, Message], None],
                 on_down: Callable[[str], None]) -> None:
        self.name = name
        self.host, self.port = parse_address(name)
        self._on_up, self._on_message, self._on_down = on_up, on_message, on_down
        self._writer: asyncio.StreamWriter | None = None
        self.reconnects = 0
        self.log = get_logger(peer=name)

    @property
    def connected(self) -> bool:
        return self._writer is not None

    def send(self, msg: Message) -> None:
        if self._writer is not None:
            self._writer.write(codec.encode(msg))

    def buffered(self) -> int:
        return self._writer.transport.get_write_buffer_size() if self._writer else 0

    async def drain(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()

    def drop(self) -> None:
        """Close the current connection; `run` reconnects."""
        if self._writer is not None:
            self._writer.close()

    async def run(self) -> None:
        """Connect forever: backoff between attempts (reset after each success), a callback per message."""
        while True:
            async for attempt in AsyncRetrying(wait=wait_exponential(multiplier=0.05, max=2),
                                               retry=retry_if_exception_type(OSError)):
                with attempt:
                    reader, writer = await asyncio.open_connection(self.host, self.port)
            await self._serve(reader, writer)
            await asyncio.sleep(0.05)  # a refused greeting must not turn into a tight reconnect loop

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._writer = writer
        self.log.info("connected")
        try:
            self._on_up(self.name)
            while True:
                self._on_message(self.name, await codec.read_message(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.log.warning("connection lost")
        except codec.ProtocolError as e:
            self.log.error("malformed message from safekeeper; reconnecting", reason=str(e))
        finally:
            self._writer = None
            self.reconnects += 1
            writer.close()
            self._on_down(self.name)

"""Connections from the proposer to safekeepers: connect, reconnect with backoff, frame I/O."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from sidecar import framing, tls
from sidecar.consensus import codec, limits
from sidecar.consensus.messages import Append, Message, Refusal
from sidecar.logs import get_logger


REFUSED_PAUSE_MIN, REFUSED_PAUSE_MAX = 0.05, 5.0
SPLIT_WRITE_AT = 64 * 1024  # Append data this long is written after its header instead of copied behind it


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a safekeeper address: {text!r} (expected HOST:PORT)")
    return host, int(port)


class PeerLink:
    """One safekeeper: keeps a TCP connection up and hands whole messages to callbacks."""

    def __init__(self, name: str, on_up: Callable[[str], None], on_message: Callable[[str, Message], None],
                 on_down: Callable[[str], None], ssl_context: ssl.SSLContext | None = None) -> None:
        self.name = name
        self._ssl = ssl_context  # None: --insecure
        self._last_tls_error: str | None = None
        self.host, self.port = parse_address(name)
        self._on_up, self._on_message, self._on_down = on_up, on_message, on_down
        self._writer: asyncio.StreamWriter | None = None
        self.reconnects = 0
        self.log = get_logger(peer=name)

    @property
    def connected(self) -> bool:
        return self._writer is not None

    def send(self, msg: Message) -> None:
        if self._writer is None:
            return
        if isinstance(msg, Append) and len(msg.data) >= SPLIT_WRITE_AT:
            # The header goes first and the WAL after it, without copying it into one frame.
            header, data = codec.encode_append_parts(msg.term, msg.begin_lsn, msg.commit_lsn,
                                                     msg.peer_horizon_lsn, msg.data)
            framing.write(self._writer, header, data)
        else:
            framing.write(self._writer, codec.encode(msg))

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
        pause = REFUSED_PAUSE_MIN
        tls_args = {} if self._ssl is None else {"ssl": self._ssl, "server_hostname": tls.server_hostname(self.host),
                                                 "ssl_handshake_timeout": tls.HANDSHAKE_TIMEOUT}
        while True:
            async for attempt in AsyncRetrying(wait=wait_exponential(multiplier=0.05, max=2),
                                               retry=retry_if_exception_type(OSError),
                                               before_sleep=self._tls_failed):
                with attempt:
                    reader, writer = await framing.open_connection(self.host, self.port, **tls_args)
                    reader.max_frame = limits.CONTROL_MAX_FRAME  # replies: votes with bounded histories
            ident = tls.peer_role(writer) if self._ssl is not None else None
            if self._ssl is not None and (ident is None or ident.role != "safekeeper"):
                self.log.error("refusing the peer: its certificate is not a safekeeper's", peer_cert=str(ident))
                writer.close()
                await asyncio.sleep(pause)
                pause = min(pause * 2, REFUSED_PAUSE_MAX)
                continue
            if await self._serve(reader, writer):
                # Refused before any other answer, e.g. a greeting from another cluster's primary:
                # retrying soon rarely helps, so back off instead of reconnecting (and logging the
                # refusal) 20 times a second.
                await asyncio.sleep(pause)
                pause = min(pause * 2, REFUSED_PAUSE_MAX)
            else:
                pause = REFUSED_PAUSE_MIN
                await asyncio.sleep(REFUSED_PAUSE_MIN)

    def _tls_failed(self, state) -> None:
        """Say why a TLS handshake failed (certificates, not the network); retries stay quiet."""
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, ssl.SSLError) and str(exc) != self._last_tls_error:
            self._last_tls_error = str(exc)
            self.log.error("TLS handshake with the safekeeper failed; retrying", reason=str(exc))

    async def _serve(self, reader: framing.FrameReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one connection; True if the safekeeper refused before answering anything else."""
        answered = refused = False
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._writer = writer
        self.log.info("connected")
        try:
            self._on_up(self.name)
            while True:
                msg = await reader.read_message()
                refused = refused or (isinstance(msg, Refusal) and not answered)
                answered = answered or not isinstance(msg, Refusal)
                self._on_message(self.name, msg)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if self._ssl is not None and not answered and isinstance(e, asyncio.IncompleteReadError):
                # TLS 1.3 checks our certificate after the handshake; a refusal reads as a silent close.
                refused = True  # so back off: a certificate it does not accept will not change in 50 ms
                self.log.warning("the safekeeper closed the connection before answering: does it trust this "
                                 "proposer's certificate (the same CA)?")
            else:
                self.log.warning("connection lost")
        except codec.ProtocolError as e:
            self.log.error("malformed message from safekeeper; reconnecting", reason=str(e))
        finally:
            self._writer = None
            self.reconnects += 1
            writer.close()
            self._on_down(self.name)
        return refused

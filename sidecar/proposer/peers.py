"""Connections from the proposer to safekeepers: connect, reconnect with backoff, frame I/O."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
from collections.abc import Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, retry_if_result, wait_exponential

from sidecar import framing, linkauth, tls
from sidecar.address import parse_address
from sidecar.certs import Identity
from sidecar.consensus import codec
from sidecar.consensus.messages import Append, GreetingReply, Message, Refusal
from sidecar.logs import get_logger


REFUSED_PAUSE_MIN, REFUSED_PAUSE_MAX = 0.05, 5.0
CONNECT_PAUSE_MAX = 2.0
# Nothing listening answers at once and costs one packet: retried often, a safekeeper started again is
# streaming within a fraction of a second instead of after up to CONNECT_PAUSE_MAX.
CONNECTION_REFUSED_PAUSE_MAX = 0.25
CONNECT_TIMEOUT = 5.0  # a silently dropped SYN would otherwise hold the link for the kernel's ~2 minutes
SPLIT_WRITE_AT = 64 * 1024  # Append data this long is written after its header instead of copied behind it


class PeerLink:
    """One safekeeper: keeps a TCP connection up and hands whole messages to callbacks."""

    def __init__(self, name: str, on_up: Callable[[str], None], on_message: Callable[[str, Message], None],
                 on_down: Callable[[str], None], ssl_context: linkauth.Security = None) -> None:
        self.name = name
        self.host, self.port = parse_address(name)
        self._ssl = ssl_context  # TLS, or a LinkAuth for --link-security auth-only; None: --insecure
        self._last_tls_error: str | None = None
        self._on_up, self._on_message, self._on_down = on_up, on_message, on_down
        self._writer: framing.Writer | None = None
        self.reconnects = 0
        self._faulted = False  # the current connection ended in a protocol error
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
            self._writer.write(header, data)
        else:
            self._writer.write(codec.encode(msg))

    def buffered(self) -> int:
        return self._writer.transport.get_write_buffer_size() if self._writer else 0

    async def drain(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()

    def drop(self, faulted: bool = False) -> None:
        """Close the current connection; `run` reconnects, after a growing pause if `faulted`."""
        if self._writer is not None:
            self._faulted = self._faulted or faulted
            self._writer.close()

    async def run(self) -> None:
        """Connect forever: backoff between attempts (reset after each success), a callback per message.

        Nothing a safekeeper sends, and nothing a callback raises, ends this loop: the link is
        dropped, the reason logged, and it connects again.
        """
        # Refused before any other answer (e.g. a greeting from another cluster's primary), or a
        # protocol error: retrying soon rarely helps, so back off, growing while faults repeat,
        # instead of reconnecting (and logging it) 20 times a second.
        after_faults = AsyncRetrying(retry=retry_if_result(bool),
                                     wait=wait_exponential(multiplier=REFUSED_PAUSE_MIN, max=REFUSED_PAUSE_MAX))
        while True:
            await after_faults(self._session)  # returns after a connection that ended without a fault
            await asyncio.sleep(REFUSED_PAUSE_MIN)

    async def _session(self) -> bool:
        """Connect (retrying until it works) and serve one connection; True if it ended in a fault."""
        reader, writer, ident = await self._connect()
        self._faulted = False
        if self._ssl is not None and (ident is None or ident.role != "safekeeper"):
            self.log.error("refusing the peer: its certificate is not a safekeeper's", peer_cert=str(ident))
            writer.close()
            return True
        try:
            faulted = await self._serve(reader, writer)
        except Exception as e:  # a callback failed while the connection was torn down
            self.log.error("safekeeper link failed; reconnecting", error=repr(e), exc_info=True)
            faulted = True
        return faulted or self._faulted

    async def _connect(self) -> tuple[framing.FrameReader, framing.Writer, Identity | None]:
        """Connect, retrying with backoff; failures are logged at the 1st, 2nd, 4th, 8th... attempt."""
        async for attempt in AsyncRetrying(wait=connect_pause,
                                           retry=retry_if_exception_type((OSError, asyncio.TimeoutError)),
                                           before_sleep=self._connect_failed):
            with attempt:
                return await asyncio.wait_for(linkauth.dial(self.host, self.port, self._ssl),
                                              CONNECT_TIMEOUT + (tls.HANDSHAKE_TIMEOUT if self._ssl else 0))
        raise AssertionError("tenacity retries forever")  # pragma: no cover

    def _connect_failed(self, state: RetryCallState) -> None:
        """Say why connecting failed: certificates at once, the network at a slowing rate."""
        e = state.outcome.exception() if state.outcome is not None else None
        failures = state.attempt_number
        if isinstance(e, (ssl.SSLError, linkauth.LinkAuthError)) and str(e) != self._last_tls_error:
            self._last_tls_error = str(e)  # said at once, and again only when it changes
            what = "TLS handshake" if isinstance(e, ssl.SSLError) else "authentication"
            self.log.error(f"{what} with the safekeeper failed; retrying", reason=str(e))
        elif failures & (failures - 1) == 0:
            sleep = state.next_action.sleep if state.next_action is not None else 0.0
            self.log.warning("cannot connect to safekeeper; retrying", reason=_reason(e),
                             attempts=failures, retry_in=round(sleep, 2))

    async def _serve(self, reader: framing.FrameReader, writer: framing.Writer) -> bool:
        """Serve one connection; True if it ended in a fault: refused before any other answer,
        a malformed message, or a failure handling one."""
        answered = faulted = past_greeting = False
        stage = "connected"  # what was going on: reading, or the name of the message being handled
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._writer = writer
            self.log.info("connected")
            self._on_up(self.name)
            while True:
                stage = "reading"
                msg = await reader.read_message()
                # A refusal before anything but the greeting's reply (a safekeeper that is not voting
                # yet, amnesic or another cluster's) reconnects after a growing pause.
                faulted = faulted or (isinstance(msg, Refusal) and not past_greeting)
                answered = answered or not isinstance(msg, Refusal)
                past_greeting = past_greeting or not isinstance(msg, (Refusal, GreetingReply))
                stage = type(msg).__name__
                self._on_message(self.name, msg)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if isinstance(self._ssl, ssl.SSLContext) and not answered and isinstance(e, asyncio.IncompleteReadError):
                # TLS 1.3 checks our certificate after the handshake; a refusal reads as a silent close.
                faulted = True  # so back off: a certificate it does not accept will not change in 50 ms
                self.log.warning("the safekeeper closed the connection before answering: does it trust this "
                                 "proposer's certificate (the same CA)?")
            else:
                self.log.warning("connection lost")
        except Exception as e:
            faulted = True
            if stage == "reading" and isinstance(e, codec.ProtocolError):  # the bytes it sent
                self.log.error("malformed message from safekeeper; reconnecting", reason=str(e))
            else:  # our bug, or a reply nothing checked: either way this link goes on after a pause
                self.log.error("handling a message from safekeeper failed; reconnecting",
                               stage=stage, error=repr(e), exc_info=True)
        finally:
            self._writer = None
            self.reconnects += 1
            writer.close()
            self._on_down(self.name)
        return faulted


_connect_backoff = wait_exponential(multiplier=REFUSED_PAUSE_MIN, max=CONNECT_PAUSE_MAX)


def connect_pause(state: RetryCallState) -> float:
    """The pause before the next connection attempt: growing to CONNECT_PAUSE_MAX, to less when refused."""
    pause = _connect_backoff(state)
    e = state.outcome.exception() if state.outcome is not None else None
    if isinstance(e, OSError) and e.errno == errno.ECONNREFUSED:
        return min(pause, CONNECTION_REFUSED_PAUSE_MAX)
    return pause


def _reason(e: BaseException) -> str:
    """What an operator can act on: asyncio's "Connect call failed" hides the errno's text."""
    if isinstance(e, asyncio.TimeoutError):
        return f"timeout: no answer within {CONNECT_TIMEOUT:g}s"
    if isinstance(e, ConnectionAbortedError) and "handshake" in str(e):  # asyncio's ssl_handshake_timeout
        return f"timeout: no answer to the TLS handshake within {tls.HANDSHAKE_TIMEOUT:g}s"
    if isinstance(e, OSError) and e.errno:
        return os.strerror(e.errno)
    return str(e) or type(e).__name__

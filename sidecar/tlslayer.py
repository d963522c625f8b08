"""Server-side TLS over a plain asyncio transport, with `ssl.SSLObject` and memory BIOs.

The event loop's own TLS transport keeps its TLS state to itself, so a connection it serves can never
be read or written by anything else. Here the state is an `SSLObject` this module owns: the protocol
decrypts into the application protocol's buffer and encrypts what it writes, and the safekeeper's
stream thread can take the same object over for the Append stream (`TlsState`) while the loop's
side of the connection is paused, and hand it back. OpenSSL does the cryptography; this is plumbing.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

_RECV = 256 * 1024  # ciphertext read from the socket at a time
# Before the handshake: a connection nobody has authenticated yet holds no more memory than this.
_HANDSHAKE_RECV = 17 * 1024


class TlsState:
    """One connection's TLS: the `SSLObject` and its two memory BIOs; used by one side at a time."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.lent = False  # True while a thread uses it: the loop's side then leaves it alone

    def read_into(self, get_buffer: Callable[[], memoryview], updated: Callable[[int], None]) -> bool:
        """Decrypt every whole record received so far into `get_buffer()`, calling `updated(n)` for each
        piece; False once the peer closed TLS."""
        while True:
            buf = get_buffer()
            try:
                n = self.obj.read(len(buf), buf)
            except ssl.SSLWantReadError:
                return True
            except ssl.SSLZeroReturnError:
                return False
            finally:
                buf.release()
            if n == 0:
                return False
            updated(n)

    def encrypt(self, data: bytes | bytearray | memoryview) -> bytes:
        """The ciphertext for `data`, with anything else TLS has to say first (tickets, alerts)."""
        self.obj.write(data)
        return self.outgoing.read()


class TlsProtocol(asyncio.BufferedProtocol):
    """The transport's protocol: TLS below, `app` (a buffered protocol) above, which sees a `TlsTransport`."""

    def __init__(self, ctx: ssl.SSLContext, app: asyncio.BufferedProtocol, handshake_timeout: float) -> None:
        self.tls = TlsState(ctx)
        self.app = app
        self.raw: asyncio.Transport | None = None
        self.transport: TlsTransport | None = None  # once the handshake is done
        self._buf = bytearray(_HANDSHAKE_RECV)
        self._timeout = handshake_timeout
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.raw = transport  # type: ignore[assignment]
        self._timer = asyncio.get_running_loop().call_later(self._timeout, transport.abort)  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buf)

    def buffer_updated(self, nbytes: int) -> None:
        assert self.raw is not None
        self.tls.incoming.write(memoryview(self._buf)[:nbytes])
        if self.transport is not None:
            self._decrypt()
            return
        try:
            done = self._handshake()
        except ssl.SSLError:
            self._refuse()
            return
        if done:
            # The application's handler runs first, as on a plain connection, where no data comes with
            # the connection itself: it may raise the frame limit before the first frame is decoded.
            self.raw.pause_reading()
            asyncio.get_running_loop().call_soon(self._started)

    def _started(self) -> None:
        assert self.raw is not None
        if not self.raw.is_closing():
            self.raw.resume_reading()
            self._decrypt()

    def _decrypt(self) -> None:
        assert self.raw is not None
        try:
            open_ = self.tls.read_into(lambda: self.app.get_buffer(-1), self.app.buffer_updated)
        except ssl.SSLError:
            self._refuse()
            return
        self._flush()
        if not open_:
            self.eof_received()
            self.raw.close()

    def _refuse(self) -> None:
        """After a TLS failure: the alert that says why (close sends it), then nothing more."""
        assert self.raw is not None
        self._flush()
        self.raw.close()

    def _handshake(self) -> bool:
        """Advance the handshake; True once done (the peer's certificate is then verified)."""
        try:
            self.tls.obj.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return False
        if self._timer is not None:
            self._timer.cancel()
        self._flush()
        assert self.raw is not None
        self._buf = bytearray(_RECV)
        self.transport = TlsTransport(self.raw, self.tls)
        self.app.connection_made(self.transport)
        return True

    def _flush(self) -> None:
        data = self.tls.outgoing.read()
        if data and self.raw is not None and not self.raw.is_closing():
            self.raw.write(data)

    def eof_received(self) -> bool:
        if self.transport is not None:
            self.app.eof_received()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.transport is not None:
            self.app.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.app.pause_writing()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.app.resume_writing()


class TlsTransport(asyncio.Transport):
    """What the application protocol writes to: plaintext in, ciphertext onto the plain transport."""

    def __init__(self, raw: asyncio.Transport, tls: TlsState) -> None:
        super().__init__()
        self.raw = raw
        self.tls = tls

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.raw.is_closing():
            return
        self.raw.write(self.tls.encrypt(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError("TLS has no half-close here: close() instead")

    def close(self) -> None:
        if self.raw.is_closing():
            return
        if not self.tls.lent:  # an SSLObject is not for two threads at once; a lent one closes without it
            try:
                self.tls.obj.unwrap()  # close_notify into the outgoing BIO; the peer's is not waited for
            except ssl.SSLError:
                pass
            data = self.tls.outgoing.read()
            if data:
                self.raw.write(data)
        self.raw.close()

    def abort(self) -> None:
        self.raw.abort()

    def is_closing(self) -> bool:
        return self.raw.is_closing()

    def pause_reading(self) -> None:
        self.raw.pause_reading()

    def resume_reading(self) -> None:
        self.raw.resume_reading()

    def is_reading(self) -> bool:
        return self.raw.is_reading()

    def get_write_buffer_size(self) -> int:
        return self.raw.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.raw.set_write_buffer_limits(high, low)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self.tls.obj
        if name == "peercert":
            return self.tls.obj.getpeercert()
        if name == "cipher":
            return self.tls.obj.cipher()
        return self.raw.get_extra_info(name, default)


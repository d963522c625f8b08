"""The elected proposer's Append stream served by a thread of its own, with blocking socket calls.

Once a connection on a plain TCP link (auth-only, --insecure) holds the term and streams Appends,
receive, write, sync and reply need no event loop: a thread does them with recv_into (into the frame
decoder's buffer), pwrite, fdatasync and sendall, each releasing the GIL, about half the system calls
and a fifth less CPU per commit than on the loop (docs/performance.md). It stores the positions
itself and wakes the loop only for a waiter they satisfy. Anything but an Append, a batch that
persists state, the disk guard or a stop hands the connection back to the loop, which carries on
where the thread left off. Over TLS the thread decrypts and encrypts with the connection's own TLS
state (`sidecar.tlslayer`), which the loop's side uses again once the thread hands the connection back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from sidecar import framing
from sidecar.consensus import codec
from sidecar.consensus.acceptor import Acceptor, AcceptorAction, AdoptTimeline, Persist, Reply, Truncate, Write
from sidecar.consensus.messages import Append, Message
from sidecar.consensus.session import AcceptorSession
from sidecar.processes import name_thread
from sidecar.safekeeper.positions import Positions, PositionWatch
from sidecar.safekeeper.storage import NoWal, WalStorage
from sidecar.tlslayer import TlsState, TlsTransport

_STATEFUL = (Persist, Truncate, AdoptTimeline)
# Unsynced WAL is synced once the socket is drained, or once this much is waiting for it, so that
# a proposer that never lets the socket drain still gets acknowledgements.
SYNC_AT = 1 << 20
RECV = 256 * 1024  # TLS ciphertext received at a time


class Safekeeper(Protocol):
    """What the stream thread uses of the safekeeper (server.py)."""

    node_id: int
    acceptor: Acceptor
    acceptor_lock: threading.Lock
    threaded: set[AcceptorSession]
    storage: WalStorage | NoWal
    stats: Any
    guard: Any
    stopped: str | None
    positions: PositionWatch
    publish_pending: bool

    def write_wal(self, a: Write) -> None: ...
    def flushed_replies(self, flushed: int) -> bytes: ...
    def positions_moved(self) -> bool: ...
    def _positions(self) -> Positions: ...
    def wake_positions(self) -> None: ...


@dataclass
class HandBack:
    """What the thread leaves for the loop: a batch to carry out, messages decoded but not handled, an error after them."""

    actions: list[AcceptorAction] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    error: BaseException | None = None


class Link:
    """The connection as the thread uses it: frames decoded from the socket, replies sent, through TLS if any."""

    def __init__(self, sock: socket.socket, decoder: codec.FrameDecoder, tls: TlsState | None) -> None:
        self.sock, self.decoder, self.tls = sock, decoder, tls
        self._scratch = bytearray(RECV) if tls is not None else None
        self._closed = False

    def receive(self, out: list[Message], flags: int = 0) -> bool:
        """Receive once, decoding into `out`; True if the socket may hold more (it filled what was offered).

        BlockingIOError under MSG_DONTWAIT when nothing is there; IncompleteReadError once the peer closed.
        """
        decoder = self.decoder
        if self._closed:
            raise asyncio.IncompleteReadError(b"", decoder.pending or None)
        if self.tls is None:
            buf = decoder.get_buffer()
            room = len(buf)
            try:
                n = self.sock.recv_into(buf, 0, flags)
            finally:
                buf.release()
            if n == 0:
                raise asyncio.IncompleteReadError(b"", decoder.pending or None)
            decoder.buffer_updated(n, out)
            return n == room
        scratch = self._scratch
        assert scratch is not None
        n = self.sock.recv_into(scratch, 0, flags)
        if n == 0:
            raise asyncio.IncompleteReadError(b"", decoder.pending or None)
        self.tls.incoming.write(memoryview(scratch)[:n])
        try:
            # The messages of the records before a close_notify are served; the next receive ends it.
            self._closed = not self.tls.read_into(decoder.get_buffer, lambda k: decoder.buffer_updated(k, out))
        except ssl.SSLError as e:  # a record that fails its check: this connection's end, not the safekeeper's
            raise ConnectionResetError(f"TLS: {e}") from e
        finally:
            said = self.tls.outgoing.read()  # what TLS answers on its own (a key update, an alert)
            if said:
                self.sock.sendall(said)
        return n == len(scratch)

    def send(self, data: bytes) -> None:
        if self.tls is None:
            self.sock.sendall(data)
            return
        try:
            data = self.tls.encrypt(data)
        except ssl.SSLError as e:
            raise ConnectionResetError(f"TLS: {e}") from e
        self.sock.sendall(data)


class OutOfDescriptors(ConnectionError):
    """The connection's own descriptor could not be had: it ends, the safekeeper goes on."""


async def stream(sk: Safekeeper, session: AcceptorSession, reader: framing.FrameReader,
                 writer: framing.Writer) -> HandBack:
    """Serve `session`'s Appends in a thread until something needs the loop; raises what ends the connection."""
    loop = asyncio.get_running_loop()
    transport = writer.transport
    raw = writer.get_extra_info("socket")
    if transport.is_closing() or raw is None or raw.fileno() < 0:
        # The peer has gone (its EOF or TLS close came with the last messages): the loop reads that end.
        return HandBack()
    transport.pause_reading()
    # A duplicate of the transport's socket: closing it leaves the connection to the transport.
    try:
        fd = os.dup(raw.fileno())
    except OSError as e:
        transport.resume_reading()
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise OutOfDescriptors(f"no descriptor for the stream thread's socket: {e}") from e
        raise
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)  # shared with the transport's descriptor; the thread restores it
    # Over TLS the thread takes the connection's TLS state (tlslayer) with it, and gives it back.
    link = Link(sock, reader.decoder, transport.tls if isinstance(transport, TlsTransport) else None)
    done: concurrent.futures.Future[HandBack] = concurrent.futures.Future()
    thread = threading.Thread(target=_run, args=(sk, session, link, loop, done),
                              name=f"stream-{sk.node_id}", daemon=True)
    sk.threaded.add(session)
    if link.tls is not None:
        link.tls.lent = True
    thread.start()
    try:
        back = await asyncio.wrap_future(done)
    except asyncio.CancelledError:
        # A stop: the thread ends at the shut-down socket, and is waited for, because the storage it
        # writes and syncs closes once every connection has ended. Its failure there is the stop's.
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv and send
        except OSError:
            pass
        with contextlib.suppress(BaseException):
            await asyncio.wrap_future(done)
        raise
    transport.resume_reading()
    return back


def _run(sk: Safekeeper, session: AcceptorSession, link: Link, loop: asyncio.AbstractEventLoop,
         done: concurrent.futures.Future[HandBack]) -> None:
    name_thread(threading.current_thread().name)
    # Running, `done` can no longer be cancelled: a stop waits for the outcome instead (see stream()).
    if not done.set_running_or_notify_cancel():
        _restore(link)
        sk.threaded.discard(session)
        return
    try:
        back = _serve(sk, session, link, loop)
    except BaseException as e:  # noqa: BLE001 - every failure goes to the loop, which reports it
        _restore(link)
        sk.threaded.discard(session)
        done.set_exception(e)
    else:
        _restore(link)
        sk.threaded.discard(session)  # the socket is the transport's again: the loop may acknowledge on it
        done.set_result(back)


def _restore(link: Link) -> None:
    try:
        link.sock.setblocking(False)
    except OSError:
        pass
    link.sock.close()
    if link.tls is not None:
        link.tls.lent = False


def _serve(sk: Safekeeper, session: AcceptorSession, link: Link, loop: asyncio.AbstractEventLoop) -> HandBack:
    acc, lock = sk.acceptor, sk.acceptor_lock
    out: list[Message] = []
    while True:
        if sk.stopped is not None or sk.guard.active or not session.holds_term:
            return HandBack()
        error = None
        try:
            if acc.flush_lsn < acc.write_lsn:  # acknowledged, not just synced (a vote's scan syncs too)
                # Unsynced WAL: read on only if more is already here, else sync and acknowledge first.
                try:
                    more = link.receive(out, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    _sync(sk, session, link, loop)
                    continue
            else:
                more = link.receive(out)
        except codec.ProtocolError as e:  # after the messages decoded before it
            error, more = e, False
        for i, msg in enumerate(out):
            if type(msg) is not Append:
                return HandBack(messages=out[i:], error=error)
            replies = []
            with lock:
                actions = session.receive(msg)
                if any(type(a) in _STATEFUL for a in actions):
                    return HandBack(actions, out[i + 1:], error)
                for a in actions:
                    if type(a) is Write:
                        sk.write_wal(a)
                    elif type(a) is Reply:
                        replies.append(codec.encode(a.message))
            if replies:
                link.send(b"".join(replies))
        out.clear()
        if error is not None:
            raise error
        if acc.flush_lsn >= acc.write_lsn:
            _notify(sk, loop)  # a heartbeat may move commit_lsn
        elif not more or acc.write_lsn - acc.flush_lsn >= SYNC_AT:
            _sync(sk, session, link, loop)  # the socket had no more: sync now, skip the probe


def _sync(sk: Safekeeper, session: AcceptorSession, link: Link, loop: asyncio.AbstractEventLoop) -> None:
    """fdatasync what was written, then acknowledge it, if this connection still holds the term."""
    began = time.perf_counter()
    flushed = sk.storage.flush()
    sk.stats.fsync.observe(time.perf_counter() - began)
    with sk.acceptor_lock:
        # Decided under the lock that a vote or Elected holds through its scan (server._one_step): once
        # another connection took the term nothing is sent, and once a higher term was promised the
        # reply carries it, which the old proposer does not count (the vote may have reported less).
        if not session.holds_term:
            return
        replies = sk.flushed_replies(flushed)
    link.send(replies)
    _notify(sk, loop)


def _notify(sk: Safekeeper, loop: asyncio.AbstractEventLoop) -> None:
    """Store the positions; wake the loop only if a waiter waits for them, once at a time."""
    with sk.acceptor_lock:
        if not sk.positions_moved():
            return
        wanted = sk.positions.store(sk._positions())
    if wanted and not sk.publish_pending:
        sk.publish_pending = True
        loop.call_soon_threadsafe(sk.wake_positions)

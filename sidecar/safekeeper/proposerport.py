"""The safekeeper's proposer port: an accept thread, and one blocking thread per connection from accept to close.

Proposers, fences, `check` and peer probes connect here. As `socketserver.ThreadingMixIn` serves
a connection, its thread does everything on it: the TLS handshake (the stdlib's blocking
`ssl.SSLSocket`) or the auth-only proof, within the handshake deadline, then the conversation the
server's `converse` holds, receive, write, fdatasync and reply, each a system call that releases
the GIL. Nothing else reads or writes the connection, and no other executor borrows it: the
event loop never sees these sockets. The connection budget (budget.py) counts each connection
from accept on; closing the port shuts every connection's socket down, which ends its thread at
its next receive or send, and waits for the threads.
"""

from __future__ import annotations

import collections
import errno
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from sidecar import linkauth, tls
from sidecar.certs import Identity
from sidecar.consensus import codec, limits
from sidecar.consensus.messages import Message
from sidecar.processes import name_thread
from sidecar.safekeeper.budget import ConnectionBudget, Place

_NO_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
# After accept() ran out of descriptors: wait this long before accepting again, rather than spin.
_ACCEPT_BACKOFF = 0.1
# How long closing the port waits for the connection threads (each ends at its next system call).
_JOIN_TIMEOUT = 5.0


class LinkClosed(ConnectionError):
    """The connection ended: the peer closed it, reset it, TLS failed, or the port shut it down."""


class IdleTimeout(ConnectionError):
    """Nothing arrived within the connection's timeout."""


class Link:
    """One connection's frames, over a blocking socket or `ssl.SSLSocket`; used by its own thread only.

    Every socket error becomes LinkClosed (IdleTimeout for a timeout), so that the caller can tell
    the connection's end from a storage failure. A ProtocolError is raised after the messages
    decoded before the bad frame.
    """

    def __init__(self, sock: socket.socket, peer: str, max_frame: int = limits.PREAUTH_MAX_FRAME) -> None:
        self.sock = sock
        self.peer = peer
        self.decoder = codec.FrameDecoder(max_frame)
        self._messages: collections.deque[Message] = collections.deque()
        self._error: codec.ProtocolError | None = None
        self._eof = False
        self._tls = sock if isinstance(sock, ssl.SSLSocket) else None
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self.deadline: float | None = None  # monotonic; while set, every receive is bounded by it
        self.timeout: float | None = None  # each receive's own bound, when no deadline is set
        self._applied: float | None = sock.gettimeout()

    @property
    def max_frame(self) -> int:
        return self.decoder.max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        self.decoder.max_frame = value

    def read(self) -> Message:
        """The next message; blocks. LinkClosed at the end, IdleTimeout, or the ProtocolError."""
        while not self._messages:
            if self._error is not None:
                raise self._error
            if self._eof:
                raise LinkClosed("closed by the peer" + (" mid-frame" if self.decoder.pending else ""))
            self._receive()
        return self._messages.popleft()

    def more_waiting(self) -> bool:
        """True if input is already here: decoded, decrypted and buffered by TLS, or in the socket."""
        if self._messages:
            return True
        try:
            if self._tls is not None and self._tls.pending():
                return True
            return bool(self._poll.poll(0))
        except (OSError, ValueError):
            return True  # the next read reports the connection's end

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (OSError, ValueError) as e:  # ValueError: closed under us by the port's shutdown
            raise LinkClosed(f"sending failed: {e}") from None

    def _receive(self) -> None:
        timeout = self.timeout
        if self.deadline is not None:
            timeout = self.deadline - time.monotonic()
            if timeout <= 0:
                raise IdleTimeout("no answer before the deadline")
        buf = self.decoder.get_buffer()
        try:
            self._apply_timeout(timeout)
            n = self.sock.recv_into(buf, len(buf))
        except Exception as e:
            raise self.receive_failed(e, timeout) from None
        finally:
            buf.release()
        if n == 0:
            self._eof = True
            return
        self._decode(lambda out: self.decoder.buffer_updated(n, out))

    def _decode(self, step: Callable[[list[Message]], None]) -> None:
        """The messages a decoder step completes, queued; a bad frame is reported after them."""
        out: list[Message] = []
        try:
            step(out)
        except codec.ProtocolError as e:
            self._error = e
        self._messages.extend(out)

    def _apply_timeout(self, timeout: float | None) -> None:
        if timeout != self._applied:  # a change costs a system call (the blocking flag)
            self.sock.settimeout(timeout)
            self._applied = timeout

    def receive_failed(self, e: BaseException, timeout: float | None = None) -> BaseException:
        """What a receive's exception means for the connection: its end (LinkClosed), an IdleTimeout, or
        itself when it is no socket's."""
        if isinstance(e, TimeoutError):
            return IdleTimeout(f"nothing received for {timeout:g}s" if timeout is not None else "timed out")
        if isinstance(e, ssl.SSLError):  # a record that fails its check: this connection's end, not the safekeeper's
            return LinkClosed(f"TLS: {e}")
        if isinstance(e, (OSError, ValueError)):
            return LinkClosed(str(e) or type(e).__name__)
        return e

    # ---- the compiled stream loop's hand-over (streamloop.py) -----------------------------------

    @property
    def has_decoded(self) -> bool:
        """Messages decoded and not yet read, or the stream's end or error waiting to be reported."""
        return bool(self._messages) or self._error is not None or self._eof

    def take_undecoded(self) -> bytes:
        """The bytes received and not yet decoded, out of the decoder, which is left empty; and the
        socket made blocking (the term's holder has no receive timeout)."""
        self._apply_timeout(None)
        return self.decoder.take()

    def give_back(self, data: bytes, eof: bool) -> None:
        """Bytes received by the compiled loop and not served: decoded here as if received here."""
        if data:
            self._decode(lambda out: self.decoder.buffer_feed(data, out))
        if eof:
            self._eof = True


Converse = Callable[[Link, "Identity | None", "Place | None", Any], None]


class ProposerPort:
    """The listening socket, its accept thread and the connection threads.

    Thread contract: `start` and `close` are called once each, from the event loop's thread (close
    may block: run it in a worker). The accept thread adds connections and each connection thread
    removes its own, under `_lock`; `close` may run concurrently with both.
    """

    def __init__(self, node_id: int, host: str, port: int, security: linkauth.Security,
                 budget: ConnectionBudget, converse: Converse, log: Any) -> None:
        self.node_id = node_id
        self.host, self.requested_port = host, port
        self.ssl_context = security if isinstance(security, ssl.SSLContext) else None
        self.link_auth = security if isinstance(security, linkauth.LinkAuth) else None
        self.budget = budget
        self.converse = converse  # the conversation after authentication (server.py)
        self.log = log
        self.port: int | None = None  # once listening
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._closing = False
        self._serial = 0

    @property
    def closing(self) -> bool:
        return self._closing

    def start(self) -> None:
        """Listen and start accepting; OSError if the address cannot be had."""
        listener = socket.create_server((self.host, self.requested_port), backlog=128)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = threading.Thread(target=self._accept_loop, name=f"accept-{self.node_id}", daemon=True)
        self._accepting.start()

    def close(self) -> None:
        """Stop accepting, end every connection and wait for their threads (each at its next system call)."""
        with self._lock:
            self._closing = True
            conns = list(self._conns)
        if self._listener is not None:
            _shutdown(self._listener)  # wakes accept() with an error
        if self._accepting is not None:
            self._accepting.join(_JOIN_TIMEOUT)
        if self._listener is not None:
            self._listener.close()
        for conn in conns:
            _shutdown(conn.sock)
        deadline = time.monotonic() + _JOIN_TIMEOUT
        for conn in conns:
            conn.thread.join(max(0.0, deadline - time.monotonic()))
        left = [c.thread.name for c in conns if c.thread.is_alive()]
        if left:
            self.log.error("connection threads still running after the port closed", threads=left)

    def _accept_loop(self) -> None:
        name_thread(threading.current_thread().name)
        assert self._listener is not None
        while not self._closing:
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._closing:
                    return
                if e.errno in _NO_DESCRIPTORS:
                    self.log.warning("out of file descriptors; not accepting for a moment", reason=str(e))
                    time.sleep(_ACCEPT_BACKOFF)
                continue
            peer = peer_name(addr)
            conn = _Conn(sock)
            place, evicted = self.budget.admit(lambda c=conn: _shutdown(c.sock), peer)
            if evicted is not None:
                self.log.warning("too many connections authenticating; dropping the oldest", peer=evicted.peer,
                                 limit=self.budget.max_handshaking)
            if place is None:
                self.log.warning("connection limit reached; closing the new connection", peer=peer,
                                 limit=self.budget.limit)
                sock.close()
                continue
            with self._lock:
                if self._closing:
                    place.release()
                    sock.close()
                    return
                self._serial += 1
                conn.thread = threading.Thread(target=self._serve, args=(conn, peer, place), daemon=True,
                                               name=f"conn-{self.node_id}-{self._serial}")
                self._conns.add(conn)
            conn.thread.start()

    def _serve(self, conn: _Conn, peer: str, place: Place) -> None:
        name_thread(threading.current_thread().name)
        log = self.log.bind(peer=peer)
        raw = sock = conn.sock
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + tls.HANDSHAKE_TIMEOUT
            ident: Identity | None = None
            if self.ssl_context is not None:
                try:
                    raw.settimeout(tls.HANDSHAKE_TIMEOUT)
                    # The SSLSocket takes the raw socket's descriptor over: conn.sock follows it, so that
                    # the port's shutdown reaches a handshake or a receive on it.
                    sock = conn.sock = self.ssl_context.wrap_socket(raw, server_side=True,
                                                                    do_handshake_on_connect=False)
                    if self._closing:
                        return
                    sock.do_handshake()
                    ident = tls.identity_of(sock.getpeercert())
                except (OSError, ValueError) as e:  # a certificate not from the deployment's CA, or none in time
                    log.info("TLS handshake failed; closing the connection", reason=str(e) or type(e).__name__)
                    return
                log = log.bind(**({"peer_cert": str(ident)} if ident else {}))
            link = Link(sock, peer)
            if self.link_auth is not None:
                link.deadline = deadline
                try:
                    # auth-only: nothing else is read or answered before the peer proves its certificate
                    nonce, challenge = self.link_auth.challenge()
                    link.send(challenge)
                    ident, confirm = self.link_auth.confirm(nonce, link.read(), self.port)
                    link.send(confirm)
                except (ConnectionError, codec.ProtocolError) as e:
                    reason = f"no answer within {tls.HANDSHAKE_TIMEOUT:g}s" if isinstance(e, IdleTimeout) \
                        else str(e) or type(e).__name__
                    log.warning("authentication failed; closing the connection", reason=reason)
                    return
                log = log.bind(peer_cert=str(ident))
            link.deadline = None
            self.converse(link, ident, place, log)
        finally:
            place.release()
            with self._lock:
                self._conns.discard(conn)
            _close(sock)


def peer_name(addr: object) -> str:
    """HOST:PORT of the peer as accept() gave it (taken there: a peer that reset at once has no
    getpeername() any more)."""
    return "%s:%s" % addr[:2] if isinstance(addr, tuple) and len(addr) >= 2 else "unknown"


class _Conn:
    """A connection's socket (the SSLSocket once TLS wraps it) and its thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.thread: threading.Thread = threading.current_thread()


def _shutdown(sock: socket.socket) -> None:
    """Wake whatever blocks on `sock` in another thread: its receive returns the end, its send fails."""
    try:
        # socket.socket's own: an SSLSocket's shutdown() would drop its TLS state under a reader
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass

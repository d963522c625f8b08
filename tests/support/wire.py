"""Reading the proposer/safekeeper protocol off a plain blocking socket, as a test peer does."""

from __future__ import annotations

import socket
import struct

from sidecar.consensus import codec
from sidecar.consensus.messages import Message, Refusal


def read_frame(s: socket.socket) -> Message | None:
    """The next message, or None when the connection ends first."""
    def exactly(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    head = exactly(4)
    if head is None:
        return None
    (length,) = struct.unpack(">I", head)
    body = exactly(length)
    return None if body is None else codec.decode(body[0], body[1:])


class Peer:
    """One blocking connection speaking frames."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)

    def send(self, msg: Message | bytes) -> None:
        self.sock.sendall(msg if isinstance(msg, bytes) else codec.encode(msg))

    def _exactly(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                part = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not part:
                return None
            buf += part
        return buf

    def recv(self) -> Message | None:
        """The next message, or None at EOF."""
        head = self._exactly(5)
        if head is None:
            return None
        length, tag = struct.unpack(">IB", head)
        body = self._exactly(length - 1)
        return None if body is None else codec.decode(tag, body)

    def ask(self, msg: Message | bytes) -> Message | None:
        """Send `msg` and read the answer; None if the safekeeper closed the connection instead."""
        try:
            self.send(msg)
        except (BrokenPipeError, ConnectionResetError):
            return None
        return self.recv()

    def refused(self, msg: Message | bytes, words: str) -> str:
        """Send `msg`; the answer must be a Refusal saying `words`, then the connection closes."""
        got = self.ask(msg)
        assert isinstance(got, Refusal) and words in got.reason, got
        assert self.recv() is None
        return got.reason

    def close(self) -> None:
        self.sock.close()

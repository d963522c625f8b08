"""Reading the proposer/safekeeper protocol off a plain blocking socket, as a test peer does."""

from __future__ import annotations

import socket
import struct

from sidecar.consensus import codec
from sidecar.consensus.messages import Message


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

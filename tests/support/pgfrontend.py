"""A PostgreSQL frontend speaking the protocol by hand, for tests of the safekeeper's reader port."""

from __future__ import annotations

import asyncio
import struct

from scramp import ScramClient

from sidecar import pgwire


class Client:
    """A frontend speaking the protocol by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int) -> Client:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def startup(self, **params: str) -> None:
        body = struct.pack(">I", pgwire.PROTOCOL_3_0) + b"".join(
            k.encode() + b"\0" + v.encode() + b"\0" for k, v in params.items()) + b"\0"
        self.writer.write(struct.pack(">I", len(body) + 4) + body)

    def send(self, kind: bytes, body: bytes = b"") -> None:
        self.writer.write(pgwire.HEADER.pack(kind, len(body) + 4) + body)

    def query(self, text: str) -> None:
        self.send(b"Q", text.encode() + b"\0")

    async def message(self) -> tuple[bytes, bytes]:
        kind, length = pgwire.HEADER.unpack(await self.reader.readexactly(5))
        return kind, await self.reader.readexactly(length - 4)

    async def until(self, kind: bytes) -> list[tuple[bytes, bytes]]:
        """Messages up to and including the first of `kind`."""
        out = []
        while True:
            m = await self.message()
            out.append(m)
            if m[0] == kind:
                return out

    async def login(self, password: str, user: str = "reader") -> list[tuple[bytes, bytes]]:
        self.startup(user=user, replication="true")
        kind, body = await self.message()
        assert kind == b"R" and body[:4] == b"\0\0\0\x0a" and b"SCRAM-SHA-256\0" in body
        scram = ScramClient(["SCRAM-SHA-256"], user, password)  # libpq sends no name here; pg8000 does
        first = scram.get_client_first().encode()
        self.send(b"p", b"SCRAM-SHA-256\0" + struct.pack(">I", len(first)) + first)
        kind, body = await self.message()
        if kind == b"E":
            return [(kind, body)]
        assert body[:4] == b"\0\0\0\x0b"
        scram.set_server_first(body[4:].decode())
        self.send(b"p", scram.get_client_final().encode())
        out = []
        while not out or out[-1][0] not in (b"Z", b"E"):
            out.append(await self.message())
        if out[0][0] == b"E":
            return out[-1:]
        if out[0][0] == b"R":
            assert out[0][1][:4] == b"\0\0\0\x0c"
            scram.set_server_final(out[0][1][4:].decode())
        return out

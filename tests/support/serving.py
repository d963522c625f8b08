"""A safekeeper serving in-process, and a function that sends it one message and returns its answer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from sidecar import framing
from sidecar.consensus import codec
from sidecar.consensus.messages import Message
from sidecar.safekeeper.server import Safekeeper
from support.helpers import until


async def serving(sk: Safekeeper) -> tuple[asyncio.Future[None], int]:
    """`sk` serving: the task (cancel it to stop) and the port it listens on."""
    server = asyncio.ensure_future(sk.serve())
    await until(lambda: sk.listening_port is not None, "the safekeeper to listen")
    return server, sk.listening_port


@contextlib.asynccontextmanager
async def talking_to(sk: Safekeeper) -> AsyncIterator[Callable[[Message], Awaitable[Message]]]:
    """`sk` serving, and a function that sends it one message and returns its answer."""
    server, port = await serving(sk)
    reader, writer = await framing.open_connection("127.0.0.1", port)

    async def send(msg: Message) -> Message:
        framing.write(writer, codec.encode(msg))
        return await asyncio.wait_for(reader.read_message(), 10)

    try:
        yield send
    finally:
        writer.close()
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)

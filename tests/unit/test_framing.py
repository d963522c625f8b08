"""sidecar.framing: frames received straight into their buffers, over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import random
import ssl
from collections.abc import Coroutine
from typing import Any

import pytest

from support.helpers import run
from support.pki import TestPKI
from sidecar import framing, tls
from sidecar.consensus import codec, limits
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, Greeting, Message, TermEntry, VoteRequest,
)


class Collector:
    """A framing server whose handler reads every message (optionally after a delay) and replies."""

    def __init__(self, read_after: asyncio.Event | None = None, max_frame: int | None = codec.MAX_FRAME) -> None:
        self.max_frame = max_frame  # None: the limit for peers nobody authenticated
        self.messages: list[Message] = []
        self.error: BaseException | None = None
        self.done = asyncio.Event()
        self.read_after = read_after
        self.server: asyncio.Server | None = None
        self.peer: tls.Identity | None = None

    async def handle(self, reader: framing.FrameReader, writer: framing.Writer) -> None:
        self.peer = tls.peer_role(writer)
        if self.max_frame is not None:
            reader.max_frame = self.max_frame
        try:
            if self.read_after is not None:
                await self.read_after.wait()
            while True:
                msg = await reader.read_message()
                self.messages.append(msg)
                if isinstance(msg, Append):
                    writer.write(codec.encode(AppendReply(msg.term, msg.end_lsn, 0)))
                    await writer.drain()
        except (codec.ProtocolError, asyncio.IncompleteReadError, ConnectionError) as e:
            self.error = e
        finally:
            writer.close()
            self.done.set()

    async def start(self, context: ssl.SSLContext | None = None) -> int:
        self.server = await framing.start_server(self.handle, "127.0.0.1", 0, tls=context)
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def _as_bytes(msg: Message) -> Message:
    return Append(msg.term, msg.begin_lsn, msg.commit_lsn, msg.peer_horizon_lsn, bytes(msg.data)) \
        if isinstance(msg, Append) else msg


async def _send_in_pieces(port: int, data: bytes, rng: random.Random,
                          close: bool = True) -> tuple[framing.FrameReader, framing.Writer]:
    """Send `data` in pieces of random sizes, then (with `close`) half-close; the caller closes."""
    reader, writer = await framing.open_connection("127.0.0.1", port)
    pos = 0
    while pos < len(data):
        n = rng.choice([1, 3, 7, 100, 4096, 70_000, 300_000, 2_000_000])
        writer.write(data[pos:pos + n])
        await writer.drain()
        pos += n
    if close:
        writer.write_eof()
    return reader, writer


def _messages() -> list[Message]:
    rng = random.Random(7)
    out: list[Message] = [Greeting(PROTOCOL_VERSION, "p", 42, 1, 16 << 20, 150000), VoteRequest(3),
                          Elected(3, 1 << 24, (TermEntry(3, 1 << 24),))]
    lsn = 1 << 24
    for size in [0, 1, 100, 16 * 1024 - 1, 16 * 1024, 16 * 1024 + 1, 256 * 1024, 1 << 20, 8000, 3 << 20, 5]:
        data = os.urandom(size) if size < 70_000 else bytes(rng.getrandbits(8) for _ in range(64)) * (size // 64)
        out.append(Append(3, lsn, lsn - 1, lsn - 2, data))
        lsn += len(data)
    return out


def test_frames_split_anywhere_arrive_whole_and_in_order() -> None:
    async def main() -> None:
        c = Collector()
        port = await c.start()
        msgs = _messages()
        reader, writer = await _send_in_pieces(port, b"".join(codec.encode(m) for m in msgs), random.Random(1))
        await asyncio.wait_for(c.done.wait(), 30)
        assert [_as_bytes(m) for m in c.messages] == msgs
        assert isinstance(c.error, asyncio.IncompleteReadError)  # the clean end of the stream
        replies = [await reader.read_message() for m in msgs if isinstance(m, Append)]
        assert [r.flush_lsn for r in replies] == [m.end_lsn for m in msgs if isinstance(m, Append)]
        writer.close()
        await c.close()

    run(main())


def _run_on(loop: str, main: Coroutine[Any, Any, None]) -> None:
    """`main` on a fresh asyncio or uvloop event loop (the services run on uvloop when it is installed)."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(asyncio.wait_for(main, 60))
    else:
        run(main)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_over_tls_frames_arrive_whole_and_only_a_certified_peer_reaches_the_handler(pki: TestPKI, loop: str) -> None:
    async def main() -> None:
        c = Collector()
        port = await c.start(tls.server_context(pki.certs("safekeeper", 1)))
        reader, writer = await framing.open_connection("127.0.0.1", port, ssl=tls.client_context(pki.certs("proposer")),
                                                       server_hostname="127.0.0.1")
        msgs, rng = _messages(), random.Random(3)
        data, pos = b"".join(codec.encode(m) for m in msgs), 0
        while pos < len(data):
            n = rng.choice([1, 7, 4096, 16 * 1024 + 5, 300_000, 2_000_000])
            writer.write(data[pos:pos + n])
            await writer.drain()
            pos += n
        replies = [await reader.read_message() for m in msgs if isinstance(m, Append)]
        assert [r.flush_lsn for r in replies] == [m.end_lsn for m in msgs if isinstance(m, Append)]
        writer.close()  # close_notify: the server's reader ends cleanly
        await asyncio.wait_for(c.done.wait(), 30)
        assert [_as_bytes(m) for m in c.messages] == msgs and c.peer == tls.Identity("proposer")
        assert isinstance(c.error, asyncio.IncompleteReadError)
        # Trusting the server is not enough: without a certificate of its own a client gets no answer.
        bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        bare.load_verify_locations(pki.ca_dir / "ca.crt")
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            r, w = await framing.open_connection("127.0.0.1", port, ssl=bare, server_hostname="127.0.0.1")
            w.write(codec.encode(VoteRequest(1)))
            await asyncio.wait_for(r.read_message(), 30)
        assert len(c.messages) == len(msgs)
        await c.close()

    _run_on(loop, main())


def test_over_tls_a_connection_that_does_not_finish_its_handshake_is_dropped(pki: TestPKI) -> None:
    async def main() -> None:
        c = Collector()
        c.server = await framing.start_server(c.handle, "127.0.0.1", 0, tls=tls.server_context(pki.certs("safekeeper", 1)),
                                              handshake_timeout=0.5)
        port = c.server.sockets[0].getsockname()[1]
        for first in (b"", b"\x16\x03\x01\x02\x00"):  # silent; a ClientHello's header and nothing more
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(first)
            assert await asyncio.wait_for(reader.read(), 30) == b""  # the server closed it
            writer.close()
        assert c.peer is None and not c.done.is_set()  # the handler never ran
        await c.close()

    run(main())


def test_large_append_data_is_a_view_of_its_own_buffer() -> None:
    async def main() -> None:
        c = Collector()
        port = await c.start()
        msg = Append(1, 0, 0, 0, os.urandom(1 << 20))
        _, writer = await _send_in_pieces(port, codec.encode(msg), random.Random(2))
        await asyncio.wait_for(c.done.wait(), 30)
        writer.close()
        got = c.messages[0]
        assert isinstance(got, Append) and isinstance(got.data, memoryview) and bytes(got.data) == msg.data
        await c.close()

    run(main())


def test_a_malformed_frame_fails_after_the_good_ones_before_it() -> None:
    async def main() -> None:
        c = Collector()
        port = await c.start()
        good = [VoteRequest(1), Append(1, 0, 0, 0, b"x" * 50_000)]
        bad = (codec.MAX_FRAME + 1).to_bytes(4, "big") + b"a"
        _, writer = await _send_in_pieces(port, b"".join(codec.encode(m) for m in good) + bad, random.Random(3),
                                          close=False)
        await asyncio.wait_for(c.done.wait(), 30)
        writer.close()
        assert [_as_bytes(m) for m in c.messages] == good
        assert isinstance(c.error, codec.ProtocolError) and "exceeds the maximum" in str(c.error)
        await c.close()

    run(main())


def test_before_authentication_a_long_frame_is_refused_from_its_header() -> None:
    async def main() -> None:
        c = Collector(max_frame=None)
        port = await c.start()
        header = codec.MAX_FRAME.to_bytes(4, "big") + b"a"
        _, writer = await _send_in_pieces(port, codec.encode(VoteRequest(1)) + header, random.Random(5), close=False)
        await asyncio.wait_for(c.done.wait(), 30)
        writer.close()
        assert c.messages == [VoteRequest(1)]
        assert isinstance(c.error, codec.ProtocolError)
        assert f"exceeds the maximum of {limits.PREAUTH_MAX_FRAME}" in str(c.error)
        await c.close()

    run(main())


def test_the_writer_reports_a_lost_connection() -> None:
    async def main() -> None:
        c = Collector()
        port = await c.start()
        reader, writer = await framing.open_connection("127.0.0.1", port)
        assert not writer.is_closing() and writer.get_extra_info("peername")[1] == port
        await writer.drain()
        writer.close()
        assert writer.is_closing()
        await asyncio.wait_for(writer.wait_closed(), 30)
        with pytest.raises(ConnectionError):
            await writer.drain()
        with pytest.raises(asyncio.IncompleteReadError):
            await reader.read_message()
        await asyncio.wait_for(c.done.wait(), 30)
        await c.close()

    run(main())


def test_eof_inside_a_frame_is_an_incomplete_read() -> None:
    async def main() -> None:
        for cut in (2, 200, 100_000):
            c = Collector()
            port = await c.start()
            frame = codec.encode(Append(1, 0, 0, 0, b"y" * 200_000))
            _, writer = await _send_in_pieces(port, codec.encode(VoteRequest(2)) + frame[:cut], random.Random(cut))
            await asyncio.wait_for(c.done.wait(), 30)
            writer.close()
            assert c.messages == [VoteRequest(2)]
            assert isinstance(c.error, asyncio.IncompleteReadError) and c.error.expected == cut
            await c.close()

    run(main())


def test_a_reader_that_falls_behind_pauses_the_socket_and_loses_nothing() -> None:
    async def main() -> None:
        go = asyncio.Event()
        c = Collector(read_after=go)
        port = await c.start()
        msgs = [Append(1, i << 20, 0, 0, bytes([i % 251]) * (1 << 20)) for i in range(40)]  # 40 MiB > the pause mark
        sender = asyncio.ensure_future(_send_in_pieces(port, b"".join(codec.encode(m) for m in msgs),
                                                       random.Random(4)))
        await asyncio.sleep(0.5)
        assert not sender.done()  # the kernel buffers filled up behind the paused reader
        go.set()
        _, writer = await asyncio.wait_for(sender, 30)
        await asyncio.wait_for(c.done.wait(), 30)
        writer.close()
        assert [_as_bytes(m) for m in c.messages] == msgs
        await c.close()

    run(main())


def test_a_client_connection_reads_frames_and_drains_its_writes() -> None:
    async def main() -> None:
        c = Collector()
        port = await c.start()
        reader, writer = await framing.open_connection("127.0.0.1", port)
        msgs = [Append(1, i << 20, 0, 0, os.urandom(1 << 20)) for i in range(8)]
        for m in msgs:
            writer.write(codec.encode(m))
            await writer.drain()
        replies = [await asyncio.wait_for(reader.read_message(), 30) for _ in msgs]
        assert replies == [AppendReply(1, m.end_lsn, 0) for m in msgs]
        writer.close()
        await asyncio.wait_for(c.done.wait(), 30)
        assert [_as_bytes(m) for m in c.messages] == msgs
        await c.close()

    run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_writing_to_a_closed_connection_drops_the_frame(loop: str) -> None:
    """uvloop raises on a write after close; a service must not die of a peer that just left."""
    async def main() -> None:
        c = Collector()
        port = await c.start()
        _reader, writer = await framing.open_connection("127.0.0.1", port)
        assert framing.write(writer, codec.encode(VoteRequest(1)))
        writer.close()
        assert not framing.write(writer, codec.encode(VoteRequest(2)), b"more")
        await asyncio.wait_for(c.done.wait(), 30)
        assert c.messages == [VoteRequest(1)]
        await c.close()

    _run_on(loop, main())


def test_data_received_delivers_the_frames_before_a_bad_one() -> None:
    """Event loops without buffered protocols hand over bytes: same order, same errors."""
    async def main() -> None:
        reader = framing.FrameReader(asyncio.get_running_loop(), max_frame=codec.MAX_FRAME)
        good = [VoteRequest(1), Append(1, 0, 0, 0, b"z" * 40_000), VoteRequest(2)]
        stream = b"".join(codec.encode(m) for m in good) + b"\x00\x00\x00\x01z"
        for pos in range(0, len(stream), 7000):
            reader.data_received(stream[pos:pos + 7000])
        assert [_as_bytes(await reader.read_message()) for _ in good] == good
        with pytest.raises(codec.ProtocolError, match="unknown message tag"):
            await reader.read_message()

    run(main())

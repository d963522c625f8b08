"""A vote or an Elected is one step against the elected proposer's connection thread.

Every proposer-port connection is served by a thread of its own (proposerport.py): the elected
proposer's thread writes, syncs and acknowledges its Appends, while another connection's thread
handles a VoteRequest or Elected: the WAL is flushed and scanned, then the acceptor answers with
the end it found. Quorum
intersection needs a voter never to report less than it acknowledged, so nothing may be
acknowledged in the old term between that scan and the message taking effect. These tests hold the
scan at that seam (an injected pause, released only once the thread has either acknowledged or is
made to wait) and send the old proposer an Append meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from sidecar import framing
from sidecar.consensus import codec
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, ElectedReply, Greeting, Message, TermEntry, VoteReply,
    VoteRequest,
)
from sidecar.safekeeper import server
from sidecar.safekeeper.server import Safekeeper
from support.helpers import created, run, until
from support.walbuilder import WalBuilder

SEG = 1 << 20
SYSID = 7_300_000_000_000_000_012
HISTORY = (TermEntry(1, SEG),)


class HeldScan:
    """The server's end-of-WAL scan, paused once armed, after it scanned, until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.scanned = threading.Event()
        self.release = threading.Event()
        real = server.record_end

        def record_end(*args: Any, **kwargs: Any) -> Any:
            end = real(*args, **kwargs)
            if self.armed:
                self.armed = False
                self.scanned.set()
                # Released by the test once the old proposer's Append was served or is waiting; a
                # loop blocked meanwhile would never release it, so say so instead of hanging.
                if not self.release.wait(30):
                    raise AssertionError("the held scan was never released")
            return end

        monkeypatch.setattr(server, "record_end", record_end)


class WatchedLock:
    """The acceptor lock, recording when a thread has to wait for it (the elected proposer's, here:
    the loop never takes it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.thread_waited = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        self.thread_waited.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Conn:
    """One proposer connection: messages sent, every answer kept."""

    def __init__(self, reader: framing.FrameReader, writer: framing.Writer) -> None:
        self.reader, self.writer = reader, writer
        self.answers: list[Message] = []

    def send(self, msg: Message) -> None:
        framing.write(self.writer, codec.encode(msg))

    async def answer(self) -> Message:
        msg = await asyncio.wait_for(self.reader.read_message(), 10)
        self.answers.append(msg)
        return msg

    async def ask(self, msg: Message) -> Message:
        self.send(msg)
        return await self.answer()

    def acknowledged(self, term: int) -> int:
        """The highest flush acknowledged in `term` on this connection (0: none)."""
        return max((m.flush_lsn for m in self.answers if isinstance(m, AppendReply) and m.term == term), default=0)


def _wal() -> tuple[bytes, list[int]]:
    """WAL from SEG on, with its record ends."""
    b = WalBuilder(SEG, seg_size=SEG, sysid=SYSID)
    b.fill_to(SEG + 300_000, 200)
    return b.bytes(), [r.end_lsn for r in b.records]


def _record_end_past(ends: list[int], lsn: int) -> int:
    return next(e for e in ends if e >= lsn)


async def _old_term_streaming(sk: Safekeeper, wal: bytes, first: int) -> tuple[Conn, Conn, asyncio.Future[None]]:
    """`sk` serving; connection A elected in term 1 and streaming up to `first`; B greeted."""
    serving = asyncio.ensure_future(sk.serve())
    await until(lambda: sk.listening_port is not None, "the safekeeper to listen")
    port = sk.listening_port
    a = Conn(*await framing.open_connection("127.0.0.1", port))
    b = Conn(*await framing.open_connection("127.0.0.1", port))
    await a.ask(Greeting(PROTOCOL_VERSION, "A", SYSID, 1, SEG, 15))
    assert isinstance(await a.ask(VoteRequest(1)), VoteReply)
    assert isinstance(await a.ask(Elected(1, SEG, HISTORY)), ElectedReply)
    ack = await a.ask(Append(1, SEG, 0, 0, wal[:first - SEG]))
    assert isinstance(ack, AppendReply) and (ack.term, ack.flush_lsn) == (1, first)
    await b.ask(Greeting(PROTOCOL_VERSION, "B", SYSID, 1, SEG, 15))
    return a, b, serving


async def _append_while_held(a: Conn, held: HeldScan, lock: WatchedLock, append: Append) -> asyncio.Future[Message]:
    """With B's scan held, A sends `append`: until it is acknowledged, or the thread waits for the lock."""
    await until(held.scanned.is_set, "B's scan to be held")
    a.send(append)
    answer = asyncio.ensure_future(a.answer())
    await until(lambda: answer.done() or lock.thread_waited.is_set(),
                "A's Append to be answered, or its thread to wait for the acceptor")
    held.release.set()
    return answer


async def _stop(a: Conn, b: Conn, serving: asyncio.Future[None]) -> None:
    a.writer.close()
    b.writer.close()
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)


def test_a_vote_reports_every_flush_acknowledged_before_it_took_effect(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    wal, ends = _wal()
    first = _record_end_past(ends, SEG + 100_000)
    held = HeldScan(monkeypatch)

    async def main() -> None:
        sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
        sk.acceptor_lock = lock = WatchedLock()  # type: ignore[assignment]
        a, b, serving = await _old_term_streaming(sk, wal, first)
        try:
            held.armed = True
            b.send(VoteRequest(2))
            answer = await _append_while_held(a, held, lock, Append(1, first, 0, 0, wal[first - SEG:]))
            vote = await b.answer()
            await answer  # acknowledged in term 1 before the vote, or told of term 2 after it
            assert isinstance(vote, VoteReply) and vote.granted
            assert vote.flush_lsn >= a.acknowledged(1), (
                f"the vote for term 2 reports flush {vote.flush_lsn:#x}, below {a.acknowledged(1):#x} "
                "that this safekeeper acknowledged in term 1 before the vote took effect")
        finally:
            await _stop(a, b, serving)

    run(main())


def test_an_elected_keeps_every_flush_acknowledged_before_it_took_effect(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same term elected again on a new connection (a proposer's reconnect) while the old one streams."""
    wal, ends = _wal()
    first = _record_end_past(ends, SEG + 100_000)
    second = _record_end_past(ends, SEG + 200_000)
    held = HeldScan(monkeypatch)

    async def main() -> None:
        sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
        sk.acceptor_lock = lock = WatchedLock()  # type: ignore[assignment]
        a, b, serving = await _old_term_streaming(sk, wal, first)
        try:
            vote = await b.ask(VoteRequest(1))  # the same term: not granted, but B may claim it
            assert isinstance(vote, VoteReply) and not vote.granted
            # WAL written since B's vote: its Elected scans again, and that scan is held.
            ack = await a.ask(Append(1, first, 0, 0, wal[first - SEG:second - SEG]))
            assert isinstance(ack, AppendReply) and (ack.term, ack.flush_lsn) == (1, second)
            held.armed = True
            b.send(Elected(1, SEG, HISTORY))
            answer = await _append_while_held(a, held, lock, Append(1, second, 0, 0, wal[second - SEG:]))
            elected = await b.answer()
            # Acknowledged before the Elected took effect, or refused: the term is B's connection's now.
            await asyncio.gather(answer, return_exceptions=True)
            assert isinstance(elected, ElectedReply) and elected.term == 1
            assert elected.flush_lsn >= a.acknowledged(1), (
                f"the Elected cut the WAL at {elected.flush_lsn:#x}, below {a.acknowledged(1):#x} that this "
                "safekeeper acknowledged in term 1 before the Elected took effect")
        finally:
            await _stop(a, b, serving)

    run(main())

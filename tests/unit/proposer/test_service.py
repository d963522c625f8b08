"""ProposerService against fake safekeeper links and a fake replication stream: no PostgreSQL, no sockets.

What it promises: it campaigns, streams the primary's WAL to the safekeepers, tells the primary
only what a quorum flushed, keeps going when a safekeeper drops, and refuses a primary that lacks
WAL a quorum committed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from support.helpers import run, until
from sidecar.consensus.messages import (
    Append, AppendReply, Elected, ElectedReply, Greeting, GreetingReply, Message, TermEntry, TermHistory,
    Refusal, VoteReply, VoteRequest,
)
from sidecar.timelines import TimelineEntry
from sidecar.consensus.proposer import Campaign, ElectionWon, Phase, ProposerEvent, Streaming
from sidecar.proposer.catchup import DamagedArchiveSegment
from sidecar.proposer.options import StartOptions
from sidecar.proposer.primary import PrimaryInfo
from sidecar.proposer.service import PrimaryMismatch, ProposerService

SEG = 16 * 1024 * 1024
BOOT = 3 * SEG  # the slot's restart_lsn: where the first term starts
SYSTEM_ID = 7301
PEERS = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


class FakeSafekeeper:
    """A link whose far end answers like a safekeeper, one event loop pass later, as a socket would."""

    def __init__(self, name: str, on_up: Callable[[str], None], on_message: Callable[[str, Message], None],
                 on_down: Callable[[str], None], security: object) -> None:
        self.name, self.on_up, self.on_message, self.on_down = name, on_up, on_message, on_down
        self.node_id = PEERS.index(name) + 1
        self.reconnects = 0
        self.up = True
        self.term = 0
        self.flush = 0
        self.history: TermHistory = ()
        self.elected: Elected | None = None
        self.acks = True  # answer Appends at once; else hold them until release()
        self.held: list[Append] = []

    @property
    def connected(self) -> bool:
        return self.up

    def send(self, msg: Message) -> None:
        if not self.up:
            return
        reply = self._answer(msg)
        if reply is not None:
            asyncio.get_running_loop().call_soon(self._deliver, reply)

    def _deliver(self, reply: Message) -> None:
        if self.up:
            self.on_message(self.name, reply)

    def _answer(self, msg: Message) -> Message | None:
        match msg:
            case Greeting():
                return GreetingReply(self.node_id, self.term)
            case VoteRequest(term=0):
                return VoteReply(self.term, False, self.flush, self.history, ())
            case VoteRequest():
                granted = msg.term > self.term
                self.term = max(self.term, msg.term)
                return VoteReply(self.term, granted, self.flush, self.history, ())
            case Elected():
                self.elected = msg
                if not self.flush or not self.history or self.history[-1] not in msg.term_history:
                    # Its log leaves the proposer's at the term start at the latest.
                    self.flush = min(self.flush, msg.start_lsn) if self.flush else msg.start_lsn
                self.history = msg.term_history
                return ElectedReply(msg.term, self.flush)
            case Append():
                if not self.acks:
                    self.held.append(msg)
                    return None
                return self._flushed(msg)
        return None

    def _flushed(self, msg: Append) -> AppendReply:
        self.flush = max(self.flush, msg.begin_lsn + len(msg.data))
        return AppendReply(msg.term, self.flush, msg.commit_lsn)

    def release(self) -> None:
        """Flush and acknowledge everything held back."""
        self.acks = True
        for msg in self.held:
            asyncio.get_running_loop().call_soon(self._deliver, self._flushed(msg))
        self.held.clear()

    def drop(self, faulted: bool = False) -> None:
        if self.up:
            self.up = False
            self.reconnects += 1
            self.held.clear()
            self.on_down(self.name)

    def reconnect(self) -> None:
        self.up = True
        self.on_up(self.name)

    def buffered(self) -> int:
        return 0

    async def drain(self) -> None:
        pass

    async def run(self) -> None:
        await asyncio.Event().wait()


class FakeStream:
    """A replication stream from `primary`: the test hands the slot's stream WAL, and it records the
    statuses sent back; a slot-less reader's stream sends what the primary has from its start."""

    def __init__(self, primary: FakeReplication, *, start_lsn: int, timeline: int, slot: str | None,
                 on_wal: Callable[[int, memoryview], None], on_batch_end: Callable[[], None]) -> None:
        self.primary, self.start_lsn, self.slot, self.timeline = primary, start_lsn, slot, timeline
        self.on_wal, self.on_batch_end = on_wal, on_batch_end
        self.statuses: list[tuple[int, int, int]] = []
        self._closed = asyncio.Event()

    async def start(self) -> None:
        if self.slot is None:
            wal = bytes(self.primary.wal[self.start_lsn - BOOT:])
            asyncio.get_running_loop().call_soon(self.on_wal, self.start_lsn, memoryview(wal))
            asyncio.get_running_loop().call_soon(self.on_batch_end)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def report(self, write: int, flush: int, apply: int) -> None:
        # Every report, as the service hands it: when it would go out is the schedule's (test_statusschedule.py).
        self.statuses.append((write, flush, apply))

    def wal(self, lsn: int, data: bytes) -> int:
        """One batch from the primary; returns its end."""
        assert lsn == BOOT + len(self.primary.wal)
        self.primary.wal += data
        self.on_wal(lsn, memoryview(data))
        self.on_batch_end()
        return lsn + len(data)

    def flushes(self) -> list[int]:
        return [flush for _, flush, _ in self.statuses]

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def close(self) -> None:
        self._closed.set()


class FakeConnection:
    async def close(self) -> None:
        pass


class FakeReplication:
    """The primary's replication side, flushed up to `flush` on `timeline` (1, unless promoted)."""

    def __init__(self, flush: int) -> None:
        self.flush = flush
        self.timeline = 1
        self.history: tuple[TimelineEntry, ...] = ()
        self.wal = bytearray()  # from BOOT on
        self.streams: list[FakeStream] = []  # the slot's streams, one a term
        self.readers: list[FakeStream] = []  # slot-less streams reading pg_wal

    async def connect(self, application_name: str) -> FakeConnection:
        return FakeConnection()

    async def identify_system(self, conn: object) -> tuple[int, int, int]:
        return SYSTEM_ID, self.timeline, self.flush

    async def read_slot(self, conn: object, slot: str) -> tuple[int, int]:
        return BOOT, 1

    async def timeline_history(self, conn: object, tli: int) -> tuple:
        assert tli == self.timeline
        return self.history

    def stream(self, conn: object, **kwargs: Any) -> FakeStream:
        stream = FakeStream(self, **kwargs)
        (self.streams if stream.slot is not None else self.readers).append(stream)
        return stream


class HeldLock:
    async def verify(self) -> bool:
        return True


class Events:
    """An observer that keeps the core's events."""

    def __init__(self) -> None:
        self.seen: list[ProposerEvent] = []

    def event(self, event: ProposerEvent) -> None:
        self.seen.append(event)

    def wal_received(self, end_lsn: int, nbytes: int) -> None:
        pass

    def committed(self, commit_lsn: int) -> None:
        pass

    def peer_contact(self, peer: str) -> None:
        pass

    def term_lost(self) -> None:
        pass

    async def run(self) -> None:
        pass


class Harness:
    def __init__(self, primary_flush: int = BOOT + SEG, wal_buffer: int = 64 * 1024 * 1024) -> None:
        self.links: dict[str, FakeSafekeeper] = {}
        self.replication = FakeReplication(primary_flush)
        self.events = Events()

        def link(name: str, *args: Any) -> FakeSafekeeper:
            self.links[name] = FakeSafekeeper(name, *args)
            return self.links[name]

        options = StartOptions("dbname=none", PEERS, 2, wal_buffer_bytes=wal_buffer)
        self.service = ProposerService(options, link_factory=link,
                                       replication=self.replication)  # type: ignore[arg-type]
        self.service.subscribe(self.events)
        self.terms: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        info = PrimaryInfo(SYSTEM_ID, 1, self.replication.flush, SEG, 15)
        self.terms = asyncio.get_running_loop().create_task(self.service.stream_terms(HeldLock(), info))
        return self.terms

    async def streaming(self) -> FakeStream:
        await until(lambda: self.replication.streams and self.service.phase is Phase.STREAMING,
                    "the service to stream")
        return self.replication.streams[-1]

    async def stop(self) -> None:
        if self.terms is not None:
            self.terms.cancel()
        await self.service.close()

    def link(self, i: int) -> FakeSafekeeper:
        return self.links[PEERS[i]]

    async def behind_the_buffer(self) -> int:
        """Streaming, with safekeeper 3 dropped while more WAL than the buffer holds was committed: its end."""
        stream = await self.streaming()
        self.link(2).drop()
        end = BOOT
        for _ in range(4):
            end = stream.wal(end, b"c" * 3000)
        await until(lambda: end in stream.flushes(), "the quorum flush")
        return end


def test_it_campaigns_then_streams_from_the_elected_start() -> None:
    async def main() -> None:
        h = Harness()
        h.start()
        try:
            stream = await h.streaming()
            assert stream.start_lsn == BOOT and stream.slot == "walsidecar"
            kinds = [type(e) for e in h.events.seen]
            assert kinds[:3] == [Campaign, ElectionWon, Streaming]
            elected = h.events.seen[1]
            assert isinstance(elected, ElectionWon) and elected.term == 1 and elected.start_lsn == BOOT
            assert h.service.term == 1
            assert all(link.term == 1 for link in h.links.values())
        finally:
            await h.stop()

    run(main())


def test_wal_reaches_every_safekeeper_and_the_primary_hears_the_quorum_flush() -> None:
    async def main() -> None:
        h = Harness()
        h.start()
        try:
            stream = await h.streaming()
            end = stream.wal(BOOT, b"w" * 1000)
            end = stream.wal(end, b"x" * 500)
            await until(lambda: end in stream.flushes(), "the primary to hear the flush")
            assert all(link.flush == end for link in h.links.values())
            assert h.service.commit_lsn == end
        finally:
            await h.stop()

    run(main())


def test_flush_is_reported_only_once_a_quorum_has_it() -> None:
    async def main() -> None:
        h = Harness()
        h.start()
        try:
            stream = await h.streaming()
            h.link(1).acks = h.link(2).acks = False
            end = stream.wal(BOOT, b"w" * 4096)
            await until(lambda: h.link(0).flush == end, "one safekeeper to flush")
            await until(lambda: h.link(1).held and h.link(2).held, "the others to be sent the WAL")
            await asyncio.sleep(0)  # the first safekeeper's reply is handled in this pass
            assert h.service.commit_lsn < end
            assert all(flush < end for flush in stream.flushes())

            h.link(1).release()
            await until(lambda: end in stream.flushes(), "the quorum flush to reach the primary")
            assert h.link(2).flush < end  # the third is not needed for the commit
        finally:
            await h.stop()

    run(main())


def test_a_dropped_safekeeper_leaves_the_quorum_and_catches_up_when_it_returns() -> None:
    async def main() -> None:
        h = Harness()
        h.start()
        try:
            stream = await h.streaming()
            first = stream.wal(BOOT, b"a" * 1000)
            await until(lambda: first in stream.flushes(), "the first flush")

            h.link(2).drop()
            second = stream.wal(first, b"b" * 2000)
            await until(lambda: second in stream.flushes(), "a flush without the dropped safekeeper")
            assert h.link(2).flush == first

            h.link(2).reconnect()
            await until(lambda: h.link(2).flush == second, "the returning safekeeper to catch up")
            assert h.service.term == 1 and h.service.phase is Phase.STREAMING
            assert h.replication.readers == []  # from the proposer's buffer
        finally:
            await h.stop()

    run(main())


def test_a_safekeeper_behind_the_buffer_is_caught_up_from_the_primary() -> None:
    async def main() -> None:
        h = Harness(wal_buffer=4096)
        h.start()
        try:
            end = await h.behind_the_buffer()

            h.link(2).reconnect()
            await until(lambda: h.link(2).flush == end, "the returning safekeeper to catch up")
            assert len(h.replication.readers) == 1 and h.replication.readers[0].start_lsn == BOOT
        finally:
            await h.stop()

    run(main())


class RecycledPrimary:
    """The primary's pg_wal no longer holds what a lagging safekeeper needs."""

    async def copy(self, *args: Any, **kwargs: Any) -> None:
        raise OSError("requested WAL segment has already been removed")


class DamagedArchive:
    """An archive whose segment at BOOT fails the WAL checks; counts the reads."""

    url = "file:///archive"

    def __init__(self) -> None:
        self.reads = 0

    async def copy(self, *args: Any, **kwargs: Any) -> int:
        self.reads += 1
        raise DamagedArchiveSegment("000000010000000000000003", BOOT, "invalid magic number 0000")


def test_catch_up_from_a_damaged_archived_segment_stops_until_the_safekeeper_reconnects() -> None:
    async def main() -> None:
        h = Harness(wal_buffer=4096)
        h.start()
        try:
            await h.behind_the_buffer()
            archive = DamagedArchive()
            h.service.reader, h.service.archive = RecycledPrimary(), archive  # type: ignore[assignment]

            h.link(2).reconnect()
            await until(lambda: archive.reads == 1 and not h.service._fetches, "the catch-up to give up")
            # Not dropped: a reconnect would read the same bytes again, and again.
            assert h.link(2).up and h.link(2).reconnects == 1 and h.link(2).flush == BOOT
            assert h.service.phase is Phase.STREAMING  # the others go on
            # A new connection (an operator replaced the object, restarted the safekeeper) tries once more.
            h.link(2).drop()
            h.link(2).reconnect()
            await until(lambda: archive.reads == 2 and not h.service._fetches, "the catch-up to try again")
            assert h.link(2).up and h.link(2).reconnects == 2
        finally:
            await h.stop()

    run(main())


def test_it_refuses_a_primary_that_lacks_quorum_committed_wal() -> None:
    async def main() -> None:
        h = Harness(primary_flush=BOOT)
        for link in h.links.values():  # the safekeepers hold WAL of term 1 beyond the primary's flush
            link.term, link.flush, link.history = 1, BOOT + 8192, (TermEntry(1, BOOT),)
        task = h.start()
        try:
            with pytest.raises(PrimaryMismatch, match="lacks quorum-committed WAL"):
                await asyncio.wait_for(task, 20)
            assert h.replication.streams == []
            assert h.service.term == 0
        finally:
            await h.stop()

    run(main())


def test_once_streaming_it_says_how_many_failures_it_can_tolerate_and_again_when_that_changes() -> None:
    async def main() -> None:
        h = Harness()
        with structlog.testing.capture_logs() as logs:
            h.start()
            try:
                await h.streaming()
                said = lambda: [e["event"] for e in logs if e["event"].startswith("streaming to")]  # noqa: E731
                await until(lambda: said() and said()[-1].startswith("streaming to 3 of 3"), "all three reached")
                assert said()[-1] == "streaming to 3 of 3 safekeepers, quorum 2: can tolerate 1 more failure"
                h.link(2).drop()
                await until(lambda: said()[-1].startswith("streaming to 2 of 3"), "the drop to be said")
                assert said()[-1] == "streaming to 2 of 3 safekeepers, quorum 2: can tolerate no failure: " \
                                     "one more stops commits"
                line = next(e for e in reversed(logs) if e["event"] == said()[-1])
                assert line["log_level"] == "warning" and line["can_tolerate"] == 0
                assert len(said()) == len(set(said()))  # once per change, not per message
            finally:
                await h.stop()

    run(main())


def test_refusals_are_logged_at_a_slowing_rate_with_the_reason() -> None:
    h = Harness()
    with structlog.testing.capture_logs() as logs:
        for _ in range(10):
            h.service._peer_message(PEERS[0], Refusal("another cluster's primary"))
    said = [e for e in logs if e["event"] == "safekeeper refused us and closed the connection"]
    assert [e["refusals"] for e in said] == [1, 2, 4, 8]
    assert all(e["log_level"] == "error" and e["reason"] == "another cluster's primary" for e in said)


@pytest.mark.parametrize("switch,stream_timeline", [(BOOT + 8192, 2), (BOOT + 10000, 1)],
                         ids=["promoted at the term start", "promoted above it"])
def test_a_promoted_standby_holding_every_committed_byte_is_accepted(switch: int, stream_timeline: int) -> None:
    """Its timeline leaves the safekeepers' at or above E: the safekeepers learn its lineage with Elected,
    and it streams from E on the timeline that holds E."""
    async def main() -> None:
        h = Harness()
        h.replication.timeline, h.replication.history = 2, (TimelineEntry(1, switch),)
        for link in h.links.values():
            link.term, link.flush, link.history = 1, BOOT + 8192, (TermEntry(1, BOOT),)
        h.start()
        try:
            stream = await h.streaming()
            assert stream.start_lsn == BOOT + 8192 and stream.timeline == stream_timeline
            for link in h.links.values():
                assert link.elected is not None
                assert (link.elected.timeline, link.elected.timeline_history) == (2, (TimelineEntry(1, switch),))
        finally:
            await h.stop()

    run(main())


def test_a_standby_promoted_below_the_term_start_is_refused_saying_why() -> None:
    async def main() -> None:
        h = Harness()
        h.replication.timeline, h.replication.history = 2, (TimelineEntry(1, BOOT + 4096),)
        for link in h.links.values():
            link.term, link.flush, link.history = 1, BOOT + 8192, (TermEntry(1, BOOT),)
        task = h.start()
        try:
            with pytest.raises(PrimaryMismatch, match=r"leaves the safekeepers' WAL .* at 0/3001000, below the "
                                                      r"quorum-committed position 0/3002000.*promote a standby"):
                await asyncio.wait_for(task, 20)
            assert h.replication.streams == []
        finally:
            await h.stop()

    run(main())


def test_has_quorum_only_while_a_quorum_is_elected_in_a_streaming_term() -> None:
    """What --commit-wait terminate-after asks before ending a wait."""
    async def main() -> None:
        h = Harness()
        assert not h.service.has_quorum  # no term
        h.start()
        try:
            await h.streaming()
            await until(lambda: h.service.has_quorum, "a quorum in the term")
            h.link(2).drop()
            assert h.service.has_quorum  # 2 of 3
            h.link(1).drop()
            assert not h.service.has_quorum
            h.link(1).reconnect()
            await until(lambda: h.service.has_quorum, "the quorum back")
        finally:
            await h.stop()

    run(main())

"""Catch-up: WAL a lagging safekeeper needs, from the primary's pg_wal, a peer's reader port or the archive.

A slot-less replication connection under a reader's name copies [start, end) from the primary and
hands it over in Append-sized pieces (the service checks the donor's tail with the same reader);
what the primary recycled comes from a safekeeper of the term, and what every safekeeper removed
from the archive's checked segments.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from sidecar.address import Address
from sidecar.config import ReaderCredentials
from sidecar.timelines import TimelineHistory
from sidecar.consensus.proposer import MAX_APPEND
from sidecar.lsn import format_lsn, segment_file_name
from sidecar.archivedwal import ArchivedWal, open_archived_wal
from sidecar.pgrepl import segment_timeline, timeline_end, timeline_of
from sidecar.proposer import replication as repl
from sidecar.wal.format import WalFormatError

CATCHUP_BACKLOG = 16 * 1024 * 1024  # bytes queued to one safekeeper before catch-up reading pauses

Sink = Callable[[int, bytes | memoryview], None]


class Backlog(Protocol):
    """The safekeeper link being fed: reading pauses while its socket has a backlog."""

    def buffered(self) -> int: ...

    async def drain(self) -> None: ...


class PrimaryReader:
    """Reads WAL ranges from the primary over replication connections named `<application_name>_reader`."""

    def __init__(self, replication: repl.ReplicationClient, application_name: str) -> None:
        self.replication = replication
        self.name = f"{application_name}_reader"

    async def read(self, start: int, end: int, timeline: int, history: TimelineHistory = ()) -> bytes:
        """WAL [start, end) as one piece (for the tail check: a few kilobytes)."""
        parts: list[bytes | memoryview] = []
        await self.copy(start, end, timeline, lambda lsn, data: parts.append(data), history=history)
        return b"".join(parts)

    async def copy(self, start: int, end: int, timeline: int, sink: Sink, link: Backlog | None = None,
                   history: TimelineHistory = ()) -> None:
        """Stream WAL [start, end) from the primary (on `timeline`, after `history`'s switches) into `sink`.

        Each piece is read on the timeline that holds it, as a standby would. With `link`, reading
        pauses while that safekeeper's socket has a backlog.
        """
        pos = start
        while pos < end:
            tli = timeline_of(history, timeline, pos)
            switch = timeline_end(history, timeline, tli)
            upto = min(end, switch.switch_lsn) if switch is not None else end
            await self._copy_on(pos, upto, tli, sink, link)
            pos = upto

    async def _copy_on(self, start: int, end: int, timeline: int, sink: Sink, link: Backlog | None) -> None:
        """Stream WAL [start, end), all on `timeline`, from the primary without a slot into `sink`."""
        conn = await self.replication.connect(self.name)
        done = asyncio.Event()
        got = start
        pieces: list[memoryview] = []  # received, not yet handed to sink: [got - size, got)
        size = 0
        resuming: set[asyncio.Task[None]] = set()

        def hand_over() -> None:
            nonlocal size
            if pieces:
                sink(got - size, pieces[0] if len(pieces) == 1 else b"".join(pieces))
                pieces.clear()
                size = 0

        def on_wal(lsn: int, data: memoryview) -> None:
            nonlocal got, size
            if lsn >= end:
                done.set()
                return
            piece = data[: end - lsn]
            pieces.append(piece)
            size += len(piece)
            got = lsn + len(piece)
            if size >= MAX_APPEND:
                hand_over()
            if got >= end:
                hand_over()
                done.set()

        def on_batch_end() -> None:
            hand_over()  # the messages of one drained batch make one Append
            if link is not None and link.buffered() > CATCHUP_BACKLOG:
                stream.pause()
                task = asyncio.ensure_future(resume_when_drained(link))
                resuming.add(task)
                task.add_done_callback(resuming.discard)

        async def resume_when_drained(link: Backlog) -> None:
            await link.drain()
            stream.resume()

        stream = self.replication.stream(conn, start_lsn=start, timeline=timeline, slot=None, on_wal=on_wal,
                                         on_batch_end=on_batch_end)
        try:
            await stream.start()
            closed = asyncio.ensure_future(stream.wait_closed())
            waiter = asyncio.ensure_future(done.wait())
            await asyncio.wait({closed, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not done.is_set():
                await closed  # raises the stream's error
                raise repl.ReplicationError(
                    f"the primary ended the stream at {format_lsn(got)} before {format_lsn(end)}")
            closed.cancel()
        finally:
            for task in resuming:
                task.cancel()
            await stream.close()


class DonorReader:
    """Reads WAL ranges from a safekeeper's reader port naming a term, so up to its flush (`walclient`).

    The safekeepers' own recovery path: the fence term of `failover` feeds voters below E with it, and
    the service a lagging safekeeper whose WAL the primary no longer has.
    """

    def __init__(self, creds: ReaderCredentials) -> None:
        self.creds = creds  # the reader's user, password file and certificates

    async def copy(self, address: str, start: int, end: int, term: int, sink: Sink,
                   link: Backlog | None = None) -> None:
        """Hand WAL [start, end) read from `address` in `term` to `sink`, pausing while `link` has a backlog."""
        from sidecar.walclient import WalReader
        loop = asyncio.get_running_loop()
        stopped = False

        async def deliver(lsn: int, data: bytes) -> None:
            if link is not None and link.buffered() > CATCHUP_BACKLOG:
                await link.drain()
            if not stopped:
                sink(lsn, data)

        def read() -> int:
            got = start
            with WalReader(Address.parse(address), self.creds, application_name="walsidecar_recovery") as reader:
                for lsn, data in reader.stream(start, term=term, stop_at=end):
                    if stopped or lsn != got:
                        break
                    piece = data[: end - lsn]
                    asyncio.run_coroutine_threadsafe(deliver(lsn, bytes(piece)), loop).result()
                    got = lsn + len(piece)
                    if got >= end:
                        break
            return got

        try:
            got = await asyncio.to_thread(read)
        finally:
            stopped = True
        if got < end:
            raise repl.ReplicationError(f"safekeeper {address} ended the stream at {format_lsn(got)} before "
                                        f"{format_lsn(end)}")


class DamagedArchiveSegment(WalFormatError):
    """A segment in the archive fails the WAL checks: reading it again gives the same bytes, so catch-up from
    the archive stops there until an operator replaces it."""

    def __init__(self, name: str, lsn: int, why: str) -> None:
        super().__init__(f"the archived segment {name} fails the WAL checks: {why}")
        self.name, self.lsn, self.why = name, lsn, why


class ArchiveReader:
    """Reads WAL ranges from the archive's whole segments, checked as restore-wal checks them (`archivedwal`)."""

    def __init__(self, url: str, s3_endpoint: str | None, cluster: str | None) -> None:
        self.url, self.s3_endpoint, self.cluster = url, s3_endpoint, cluster
        self._wal: dict[int, ArchivedWal] = {}  # system id -> its wal/ in the archive, opened once

    async def copy(self, start: int, end: int, system_id: int, timeline: int, history: TimelineHistory,
                   seg_size: int, sink: Sink, link: Backlog | None = None) -> int:
        """Hand WAL [start, end) to `sink` segment by segment; stop at the first the archive lacks: how far it got.

        A segment is named for the timeline of its last byte, as the safekeepers name what they upload.
        Raises ArchiveError when the archive does not answer, DamagedArchiveSegment when a segment fails the checks.
        """
        wal = self._wal.get(system_id)
        if wal is None:
            wal = self._wal[system_id] = await asyncio.to_thread(open_archived_wal, self.url, self.s3_endpoint,
                                                                 self.cluster, system_id)
        pos = start
        while pos < end:
            segno = pos // seg_size
            seg_start = segno * seg_size
            tli = segment_timeline(history, timeline, segno, seg_size)
            name = segment_file_name(tli, segno, seg_size)
            try:
                data = await asyncio.to_thread(wal.segment, name, tli)
            except WalFormatError as e:
                raise DamagedArchiveSegment(name, seg_start, str(e)) from None
            if data is None:
                break
            upto = min(end, seg_start + seg_size)
            while pos < upto:
                if link is not None and link.buffered() > CATCHUP_BACKLOG:
                    await link.drain()
                piece = min(MAX_APPEND, upto - pos)
                sink(pos, memoryview(data)[pos - seg_start: pos - seg_start + piece])
                pos += piece
        return pos


def reader_address(peer: str, port: int) -> str:
    """The reader port of safekeeper `peer` (its HOST:PORT link address) as HOST:PORT."""
    return f"{peer.rpartition(':')[0]}:{port}"

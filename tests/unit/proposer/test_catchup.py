"""Catch-up from the primary (proposer/catchup.py): each piece of WAL is read on the timeline that holds it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sidecar.timelines import TimelineEntry
from sidecar.proposer.catchup import PrimaryReader
from support.helpers import run

BOOT = 0x1000000
SWITCH = BOOT + 5000
WAL = bytes(i % 251 for i in range(12000))


class Stream:
    """A slot-less stream of a promoted primary: a historic timeline ends at its switch point."""

    def __init__(self, opened: list[tuple[int, int]], *, start_lsn: int, timeline: int, slot: str | None,
                 on_wal: Callable[[int, memoryview], None], on_batch_end: Callable[[], None]) -> None:
        self.start_lsn, self.timeline, self.on_wal, self.on_batch_end = start_lsn, timeline, on_wal, on_batch_end
        opened.append((start_lsn, timeline))
        self.closed = asyncio.Event()

    async def start(self) -> None:
        end = SWITCH if self.timeline == 1 else BOOT + len(WAL)
        assert self.start_lsn < end, "a stream from past the end of its timeline"
        loop = asyncio.get_running_loop()
        loop.call_soon(self.on_wal, self.start_lsn, memoryview(WAL[self.start_lsn - BOOT:end - BOOT]))
        loop.call_soon(self.on_batch_end)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    async def wait_closed(self) -> None:
        await self.closed.wait()

    async def close(self) -> None:
        self.closed.set()


class Replication:
    def __init__(self) -> None:
        self.opened: list[tuple[int, int]] = []

    async def connect(self, application_name: str) -> object:
        return object()

    def stream(self, conn: object, **kwargs: Any) -> Stream:
        return Stream(self.opened, **kwargs)


def test_a_range_across_a_promotion_is_read_on_the_old_timeline_then_the_new_one() -> None:
    async def main() -> None:
        repl = Replication()
        reader = PrimaryReader(repl, "walsidecar")  # type: ignore[arg-type]
        got = bytearray()
        await reader.copy(BOOT + 1000, BOOT + 9000, 2, lambda lsn, data: got.extend(data),
                          history=(TimelineEntry(1, SWITCH),))
        assert repl.opened == [(BOOT + 1000, 1), (SWITCH, 2)]
        assert bytes(got) == WAL[1000:9000]
        assert await reader.read(SWITCH + 10, SWITCH + 20, 2, (TimelineEntry(1, SWITCH),)) == WAL[5010:5020]
        assert repl.opened[-1] == (SWITCH + 10, 2)

    run(main())


def test_the_archive_gives_nothing_it_lacks_and_nothing_unchecked(tmp_path: Path) -> None:
    from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG, segment_file_name
    from sidecar.proposer.catchup import ArchiveReader, DamagedArchiveSegment

    system_id = 7300000000000000001
    wal = tmp_path / str(system_id) / str(system_id) / "wal"
    wal.mkdir(parents=True)
    reader = ArchiveReader(f"file://{tmp_path}", None, None)
    got: list[int] = []

    async def copy(start: int) -> int:
        return await reader.copy(start, start + SEG, system_id, 1, (), SEG, lambda lsn, data: got.append(lsn))

    assert run(copy(2 * SEG + 100)) == 2 * SEG + 100, "a segment the archive lacks gave WAL"
    (wal / segment_file_name(1, 3)).write_bytes(bytes(SEG))  # whole, but no WAL page in it
    with pytest.raises(DamagedArchiveSegment) as damaged:
        run(copy(3 * SEG))
    assert (damaged.value.name, damaged.value.lsn) == (segment_file_name(1, 3), 3 * SEG)
    assert got == []

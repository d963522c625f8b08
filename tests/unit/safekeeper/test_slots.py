"""Reader slots (safekeeper/slots.py): created, moved, saved durably, temporary ones never saved."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from support.helpers import run, until
from sidecar.safekeeper import slots as slots_module
from sidecar.consensus.reading import ServerState
from sidecar.timelines import TimelineEntry
from sidecar.safekeeper.slots import SlotError, SlotLimits, Slots, SlotsFileError, reserve_from


def test_slots_are_saved_and_loaded(tmp_path: Path) -> None:
    async def main() -> None:
        s = Slots(tmp_path)
        await s.create("archive1", False, 0x1000000, 1)
        await s.create("standby1", False, 0, 1)
        await s.create("temp1", True, 0x2000000, 1)
        assert [x.name for x in s] == ["archive1", "standby1", "temp1"]
    run(main())
    again = Slots(tmp_path)
    assert [(x.name, x.restart_lsn, x.timeline) for x in again] == [("archive1", 0x1000000, 1), ("standby1", 0, 0)]
    doc = json.loads((tmp_path / "slots.json").read_text())
    assert doc["slots"][0] == {"name": "archive1", "restart_lsn": "0/1000000", "timeline": 1}


def test_saves_at_the_same_time_both_succeed(tmp_path: Path) -> None:
    """The slot saver, a slot's creation and the remover's invalidation save through one temporary file: two
    saves at once once made one fail with FileNotFoundError, and killed the remover that made it."""
    async def main() -> None:
        s = Slots(tmp_path)
        await s.create("archive1", False, 0x1000000, 1)
        await asyncio.gather(*(s.save() for _ in range(20)))
    run(main())
    assert [x.name for x in Slots(tmp_path)] == ["archive1"]


def test_create_and_drop_refusals(tmp_path: Path) -> None:
    async def main() -> None:
        s = Slots(tmp_path)
        await s.create("a", False, 0, 1)
        with pytest.raises(SlotError, match="already exists") as e:
            await s.create("a", True, 0, 1)
        assert e.value.sqlstate == "42710"
        with pytest.raises(SlotError, match="invalid replication slot name") as e:
            await s.create("Bad-Name", False, 0, 1)
        with pytest.raises(SlotError, match="does not exist") as e:
            await s.drop("b")
        assert e.value.sqlstate == "42704"
        slot = await s.acquire("a")
        with pytest.raises(SlotError, match="active") as e:
            await s.acquire("a")
        assert e.value.sqlstate == "55006"
        with pytest.raises(SlotError, match="active"):
            await s.drop("a")
        s.release(slot)
        await s.drop("a")
        assert s.get("a") is None
    run(main())
    assert len(Slots(tmp_path)) == 0


def test_a_temporary_slot_goes_with_its_stream(tmp_path: Path) -> None:
    async def main() -> None:
        s = Slots(tmp_path)
        slot = await s.create("t", True, 0, 1)
        assert await s.acquire("t") is slot
        s.release(slot)
        assert s.get("t") is None
    run(main())


def test_standby_status_moves_a_slot_forward_and_is_saved_soon(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots_module, "SAVE_INTERVAL", 0.01)

    def saved() -> str | None:
        return json.loads((tmp_path / "slots.json").read_text())["slots"][0]["restart_lsn"]

    async def main() -> None:
        s = Slots(tmp_path)
        slot = await s.create("a", False, 0, 1)
        saver = asyncio.create_task(s.run())
        s.advance(slot, 0x3000000, 1)
        await until(lambda: saved() == "0/3000000", "the moved slot to be saved")
        s.advance(slot, 0x2000000, 1)  # never back
        assert slot.restart_lsn == 0x3000000
        s.advance(slot, 0x4000000, 2)
        saver.cancel()  # a stop saves what moved since
        await asyncio.gather(saver, return_exceptions=True)
        assert saved() == "0/4000000"
    run(main())


@pytest.mark.parametrize("content", ["not json", '{"slots": [{"name": "Bad"}]}', '{"slots": [{"name": "a", '
                                     '"restart_lsn": "zz"}]}', "{}"])
def test_a_damaged_slots_file_refuses_to_open(tmp_path: Path, content: str) -> None:
    (tmp_path / "slots.json").write_text(content)
    with pytest.raises(SlotsFileError, match="cannot read the reader slots"):
        Slots(tmp_path)


def test_reserve_wal_reserves_what_is_readable_or_all_that_is_held() -> None:
    history = ()  # no timeline switch
    switched = (TimelineEntry(1, 0x3000000),)
    known = ServerState(2, flush_lsn=0x5000000, commit_lsn=0x4000000, generation=0, timeline=2, history=switched,
                        first_lsn=0x1000000)
    assert reserve_from(known) == (0x4000000, 2)
    # Just after a start no commit is known: the oldest WAL held, on the timeline that holds it.
    unknown = replace(known, commit_lsn=0)
    assert reserve_from(unknown) == (0x1000000, 1)
    assert reserve_from(replace(unknown, first_lsn=None)) == (0, 0)  # nothing held: nothing reserved
    assert reserve_from(replace(known, history=history, timeline=1)) == (0x4000000, 1)


def test_slots_are_capped_per_reader_and_in_all(tmp_path: Path) -> None:
    async def main() -> None:
        s = Slots(tmp_path, SlotLimits(max_slots=4, per_reader=2))
        await s.create("a1", False, 0, 1, reader="a")
        await s.create("a2", True, 0, 1, reader="a")
        with pytest.raises(SlotError, match='reader "a" has all the replication slots') as e:
            await s.create("a3", False, 0, 1, reader="a")
        assert e.value.sqlstate == "53400"
        await s.create("b1", False, 0, 1, reader="b")  # another reader still may
        await s.create("b2", False, 0, 1, reader="b")
        with pytest.raises(SlotError, match="at most 4"):
            await s.create("c1", False, 0, 1, reader="c")
    run(main())
    assert {x.name: x.reader for x in Slots(tmp_path)} == {"a1": "a", "b1": "b", "b2": "b"}


def test_a_temporary_slot_released_after_its_name_was_taken_again_removes_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        s = Slots(tmp_path)
        owner = object()
        temp = await s.create("x", True, 0, 1, owner=owner)
        await s.drop("x", owner=owner)
        kept = await s.create("x", False, 0, 1)
        s.release(temp)  # the temporary slot's connection ends
        assert s.get("x") is kept
    run(main())

"""WAL removal on a real WalStorage: whole segments only, never at or above the horizon, never under a pin;
the remover task follows the positions and the slots, and the disk guard stops and resumes with it."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from support.helpers import run, until
from sidecar.logs import get_logger
from sidecar.lsn import segment_file_name
from sidecar.metrics import SafekeeperMetrics
from sidecar.safekeeper.diskguard import DiskGuard
from sidecar.safekeeper.positions import Positions, PositionWatch
from sidecar.safekeeper.remove import Remover
from sidecar.safekeeper.slots import SlotError, SlotLimits, Slots
from sidecar.safekeeper.storage import StorageError, WalStorage
from sidecar.sizes import DiskLimit

SEG = 64 * 1024


def names(wal_dir: Path) -> list[str]:
    return sorted(p.name for p in wal_dir.iterdir())


def stored(n_bytes: int, wal_dir: Path) -> WalStorage:
    st = WalStorage(wal_dir, SEG, 1)
    st.open_at(0)
    st.write(0, random.Random(1).randbytes(n_bytes))
    st.flush()
    return st


def test_only_whole_segments_below_the_horizon_go_lowest_first(tmp_path: Path) -> None:
    with stored(5 * SEG + 100, tmp_path / "wal") as st:
        before = st.read(3 * SEG, SEG)
        removal = st.remove_below(3 * SEG + 1000)  # mid-segment: segment 3 stays whole
        assert removal.removed == [segment_file_name(1, n, SEG) for n in range(3)] and removal.stopped_by is None
        assert names(tmp_path / "wal") == [segment_file_name(1, n, SEG) for n in (3, 4)] + \
            [segment_file_name(1, 5, SEG) + ".partial"]
        assert st.first_lsn() == 3 * SEG and st.wal_bytes() == 3 * SEG
        assert st.read(3 * SEG, SEG) == before
        with pytest.raises(StorageError, match="is not stored"):
            st.read(2 * SEG, 10)
        # The segment being written is never removed, whatever the horizon says.
        removal = st.remove_below(10 * SEG)
        assert removal.stopped_by == "the segment is still being written" and st.first_lsn() == 5 * SEG
    with WalStorage(tmp_path / "wal", SEG, 1) as again:  # a restart finds the run that is left
        assert [s[1] for s in again.segments()] == [5]


def test_a_pin_holds_its_segment_and_those_above_until_it_moves_or_is_released(tmp_path: Path) -> None:
    released = []
    with stored(6 * SEG, tmp_path / "wal") as st:
        pin = st.pin(SEG + 10, 'reader slot "standby1"', on_release=lambda: released.append(1))
        removal = st.remove_below(5 * SEG)
        assert len(removal.removed) == 1 and removal.stopped_by == 'reader slot "standby1" reads from 0/1000A'
        pin.move(SEG + 20, SEG)  # within its segment: nothing to tell
        pin.move(3 * SEG, SEG)  # left segments 1 and 2 behind
        pin.move(2 * SEG, SEG)  # never back
        assert pin.lsn == 3 * SEG and released == [1]
        assert len(st.remove_below(5 * SEG).removed) == 2 and st.first_lsn() == 3 * SEG
        pin.release()
        assert released == [1, 1]
        assert len(st.remove_below(5 * SEG).removed) == 2 and st.first_lsn() == 5 * SEG


class Standin:
    """What the remover needs of a safekeeper: real positions, slots, storage and metrics."""

    def __init__(self, tmp: Path, st: WalStorage) -> None:
        self.positions = PositionWatch(Positions(1, st.flush_lsn, st.flush_lsn, 0))
        self.slots = Slots(tmp)
        self.stats = SafekeeperMetrics(1)
        self.storage = st
        self.log = get_logger(node=1)


def test_the_remover_follows_the_retention_a_slot_pins_and_the_guard_stops_and_resumes(tmp_path: Path) -> None:
    st = stored(3 * SEG + 10, tmp_path / "wal")
    sk = Standin(tmp_path, st)
    guard = DiskGuard(DiskLimit.parse(str(4 * SEG)), tmp_path)
    remover = Remover(sk, guard, keep_bytes=SEG)
    sk.slots.on_change = remover.wake

    def write_to(end: int) -> None:
        st.write(st.write_lsn, bytes(end - st.write_lsn))
        st.flush()
        sk.positions.publish(Positions(1, st.flush_lsn, st.flush_lsn, 0))

    async def main() -> None:
        task = asyncio.create_task(remover.run())
        try:
            # keep 1 segment behind flush (3*SEG+10): segments 0 and 1 go, 2 stays.
            await until(lambda: st.first_lsn() == 2 * SEG, "the retention to remove segments 0 and 1")
            assert remover.horizon.held_by == "the retention (--keep-wal)"
            slot = await sk.slots.create("standby1", False, 2 * SEG + 5, 1)
            write_to(8 * SEG + 10)
            await until(lambda: guard.active, "the guard to stop taking WAL")
            assert st.first_lsn() == 2 * SEG and remover.horizon.held_by == 'reader slot "standby1"'
            assert 'held by reader slot "standby1"' in (guard.reason or "")
            sk.slots.advance(slot, 7 * SEG + 1, 1)  # no position moves: the slot's move wakes it
            await until(lambda: not guard.active, "the guard to let WAL in again")
            assert st.first_lsn() == 7 * SEG and sk.stats.registry.get_sample_value(
                "walsidecar_safekeeper_wal_removed_bytes_total", {"safekeeper_id": "1"}) == 7 * SEG
        finally:
            task.cancel()
    run(main())
    st.close()


def test_a_slot_holding_more_than_max_slot_wal_keep_size_is_invalidated_and_holds_nothing(tmp_path: Path) -> None:
    st = stored(3 * SEG + 10, tmp_path / "wal")
    sk = Standin(tmp_path, st)
    sk.slots = Slots(tmp_path, SlotLimits(max_wal_keep=3 * SEG))
    remover = Remover(sk, DiskGuard(None, tmp_path), keep_bytes=SEG)
    sk.slots.on_change = remover.wake

    async def main() -> None:
        slot = await sk.slots.create("pin", False, SEG + 5, 1, reader="reader")
        task = asyncio.create_task(remover.run())
        try:
            await until(lambda: remover.horizon.held_by == 'reader slot "pin"', "the slot to hold the horizon")
            assert st.first_lsn() == SEG and not slot.invalidated  # 2 segments behind: within the bound
            st.write(st.write_lsn, bytes(6 * SEG + 10 - st.write_lsn))
            st.flush()
            sk.positions.publish(Positions(1, st.flush_lsn, st.flush_lsn, 0))
            await until(lambda: st.first_lsn() == 5 * SEG, "what the slot held to be removed")
            assert slot.invalidated and remover.horizon.held_by == "the retention (--keep-wal)"
        finally:
            task.cancel()
        with pytest.raises(SlotError, match="invalidated") as e:
            await sk.slots.acquire("pin")
        assert e.value.sqlstate == "55000"
    run(main())
    st.close()
    # Saved before the removal: after a restart it does not come back holding WAL that is gone.
    again = Slots(tmp_path).get("pin")
    assert again is not None and again.invalidated and again.holds == 0

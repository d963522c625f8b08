"""The safekeeper's position publisher: every waiter wakes, none misses a publish, nothing moves back
unless the WAL was cut (and then the generation says so)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sidecar.safekeeper.positions import Positions, PositionWatch
from support.helpers import run


def test_a_waiter_whose_predicate_holds_returns_at_once() -> None:
    w = PositionWatch(Positions(term=2, flush_lsn=100, commit_lsn=50))
    assert run(w.wait(lambda p: p.commit_lsn >= 50)) == Positions(2, 100, 50)


def test_every_waiter_wakes_on_the_publish_it_waits_for() -> None:
    async def main() -> None:
        w = PositionWatch()
        commits = [asyncio.create_task(w.wait(lambda p, at=at: p.commit_lsn >= at)) for at in (10, 10, 20, 30)]
        changes = [asyncio.create_task(w.changed()) for _ in range(3)]
        await asyncio.sleep(0)  # every task is waiting now
        w.publish(Positions(1, 20, 20))
        done = await asyncio.gather(*commits[:3], *changes)
        assert all(p == Positions(1, 20, 20) for p in done)
        assert not commits[3].done()
        w.publish(Positions(1, 40, 30))
        assert await commits[3] == Positions(1, 40, 30)

    run(main())


def test_a_publish_between_the_check_and_the_wait_is_not_missed() -> None:
    """The publisher runs while the waiter is parked: whatever it publishes, the waiter sees it."""
    async def main() -> None:
        w = PositionWatch()
        seen: list[int] = []

        async def reader() -> None:
            p = Positions()
            while p.commit_lsn < 1000:
                p = await w.wait(lambda q, last=p.commit_lsn: q.commit_lsn > last)
                seen.append(p.commit_lsn)

        task = asyncio.create_task(reader())
        for lsn in range(100, 1001, 100):
            w.publish(Positions(1, lsn, lsn))
            await asyncio.sleep(0)
        await task
        assert seen[-1] == 1000 and seen == sorted(seen)

    run(main())


def test_an_equal_value_wakes_nobody() -> None:
    async def main() -> None:
        w = PositionWatch(Positions(1, 10, 10))
        waiter = asyncio.create_task(w.changed())
        await asyncio.sleep(0)
        w.publish(Positions(1, 10, 10))
        await asyncio.sleep(0)
        assert not waiter.done()
        w.publish(Positions(1, 11, 10))
        assert await waiter == Positions(1, 11, 10)

    run(main())


@pytest.mark.parametrize("back", [Positions(2, 90, 50), Positions(2, 100, 40), Positions(1, 100, 50),
                                  Positions(3, 100, 50, generation=0)])
def test_positions_never_move_back_without_a_cut(back: Positions) -> None:
    w = PositionWatch(Positions(2, 100, 50, generation=1))
    with pytest.raises(ValueError, match="move back"):
        w.publish(back)
    assert w.value == Positions(2, 100, 50, generation=1)


def test_a_cut_moves_flush_back_and_bumps_the_generation() -> None:
    w = PositionWatch(Positions(2, 100, 50))
    w.publish(Positions(3, 70, 50, generation=1))  # an Elected cut the WAL above commit
    assert w.value == Positions(3, 70, 50, generation=1)
    w.publish(Positions(3, 40, 40, generation=2))  # a cut to the last record below commit takes it down
    assert w.value == Positions(3, 40, 40, generation=2)
    with pytest.raises(ValueError):
        w.publish(Positions(3, 40, 30, generation=2))  # commit never moves back without a cut


def test_publishes_from_a_thread_wake_only_a_waiter_they_satisfy_once_per_batch() -> None:
    """A proposer's thread publishes per commit; the loop is asked to wake once, and only for a waiter that wants it."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        w = PositionWatch(Positions(1, 10, 10))
        segment = asyncio.create_task(w.wait(lambda p: p.flush_lsn >= 1000))
        await asyncio.sleep(0)  # parked
        asked: list[object] = []
        real = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            asked.append(callback)
            return real(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        try:
            def publisher() -> None:
                for lsn in range(100, 2001, 100):
                    w.publish(Positions(1, lsn, lsn))

            # Joined while the loop is blocked: every publish happens before any wake can run.
            t = threading.Thread(target=publisher)
            t.start()
            t.join()
            assert w.value == Positions(1, 2000, 2000)
            assert len(asked) == 1  # nine publishes satisfied nobody, eleven shared one wake
            assert await segment == Positions(1, 2000, 2000)
        finally:
            loop.call_soon_threadsafe = real  # type: ignore[method-assign]

    run(main())

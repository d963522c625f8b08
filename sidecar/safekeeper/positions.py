"""The safekeeper's positions, published in one place for any number of asyncio tasks to wait on.

Like Neon's `commit_lsn_watch`/`term_flush_lsn_watch`: the server publishes after it carries out
the acceptor's actions (after the fsync for flush_lsn, when an Append moves commit_lsn); readers
(the monitor today, a WAL sender or an archiver later) read the latest value or wait for one that
satisfies them. Positions only move forward, except that an Elected may cut WAL: flush_lsn (and
commit_lsn, when the cut is below it) then moves back and `generation` is bumped, so a reader knows
to re-read from the new end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple


class Positions(NamedTuple):
    """What a safekeeper has promised and holds: term, fsynced end, commit position.

    A named tuple, not a dataclass: one is built per Append that moves commit_lsn.
    """

    term: int = 0
    flush_lsn: int = 0
    commit_lsn: int = 0  # acknowledged and stored here as acknowledged: what readers may be sent
    generation: int = 0  # bumped by every cut of the stored WAL (an applied Elected)


class PositionWatch:
    """The latest `Positions`; `wait(predicate)` and `changed()` wake every waiter on a publish.

    Published on the event loop (`publish`), or stored from another thread (`store`, under the
    caller's lock), which then asks the loop to `wake` the waiters only if the new value satisfies
    one of them. A waiter registers its predicate before it checks the value, so neither way is a
    publish missed.
    """

    def __init__(self, initial: Positions = Positions()) -> None:
        self._value = initial
        self._wake: asyncio.Event | None = None  # made by the first waiter, replaced on each wake
        self._watching: list[Callable[[Positions], bool]] = []  # what the waiters wait for

    @property
    def value(self) -> Positions:
        return self._value

    def publish(self, new: Positions) -> None:
        """Make `new` the latest value and wake all waiters; ValueError if it moves back without a cut."""
        if new != self._value:
            self.store(new)
            self.wake()

    def store(self, new: Positions) -> bool:
        """Make `new` the latest value (from any thread); True if a waiter waits for it."""
        old = self._value
        if new == old:
            return False
        cut = new.generation > old.generation
        if new.term < old.term or new.generation < old.generation or \
                ((new.flush_lsn < old.flush_lsn or new.commit_lsn < old.commit_lsn) and not cut):
            raise ValueError(f"positions move back from {old} to {new}")
        self._value = new
        return any(predicate(new) for predicate in list(self._watching))

    def wake(self) -> None:
        """Wake every waiter to look at the value again (on the loop)."""
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.set()

    async def wait(self, predicate: Callable[[Positions], bool]) -> Positions:
        """The first published value (the current one included) for which `predicate` holds."""
        while not predicate(self._value):
            await self._next(predicate)
        return self._value

    async def changed(self) -> Positions:
        """The value after the next publish that changes it."""
        seen = self._value
        return await self.wait(lambda p: p != seen)

    async def _next(self, predicate: Callable[[Positions], bool]) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        wake = self._wake
        self._watching.append(predicate)
        try:
            if not predicate(self._value):  # stored by a thread since the caller looked
                await wake.wait()
        finally:
            self._watching.remove(predicate)

"""The safekeeper's positions, published in one place for any number of asyncio tasks to wait on.

Like Neon's `commit_lsn_watch`/`term_flush_lsn_watch`: the server publishes after it carries out
the acceptor's actions (after the fsync for flush_lsn, when an Append moves commit_lsn), from the
proposer connection's thread or the loop; readers
(the monitor today, a WAL sender or an archiver later) read the latest value or wait for one that
satisfies them. Positions only move forward, except that an Elected may cut WAL: flush_lsn (and
commit_lsn, when the cut is below it) then moves back and `generation` is bumped, so a reader knows
to re-read from the new end.
"""

from __future__ import annotations

import asyncio
import threading
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

    Thread contract: `publish` and `value` may be called from any thread, concurrently with the
    loop's waiters; publishers serialize among themselves (the safekeeper publishes under its
    acceptor lock, so values are published in the order the acceptor reached them). `wait` and
    `changed` run on the event loop that the waiters share. A publish that satisfies a waiter
    asks that loop to wake them with `call_soon_threadsafe`, once until the wake has run however
    many publishes come meanwhile, so a proposer's thread costs the loop one wake-up per batch of
    acknowledgements, not one per commit, and none while nobody waits. A waiter registers its
    predicate before it checks the value, so no publish is missed.
    """

    def __init__(self, initial: Positions = Positions()) -> None:
        self._value = initial
        self._wake: asyncio.Event | None = None  # made by the first waiter, replaced on each wake
        self._watching: list[Callable[[Positions], bool]] = []  # what the waiters wait for
        self._loop: asyncio.AbstractEventLoop | None = None  # the waiters' loop, once one waited
        self._lock = threading.Lock()  # guards _wake_pending against two publishers' threads
        self._wake_pending = False
        # Told, on the waiters' loop, each time a waiter is about to wait: the reader process asks its
        # safekeeper for the next positions then, and only then.
        self.on_wait: Callable[[], None] | None = None

    @property
    def value(self) -> Positions:
        return self._value

    @property
    def waiting(self) -> bool:
        """Someone waits for a value the current one is not."""
        return bool(self._watching)

    def publish(self, new: Positions) -> None:
        """Make `new` the latest value (from any thread) and wake the waiters it satisfies; ValueError
        if it moves back without a cut."""
        old = self._value
        if new == old:
            return
        cut = new.generation > old.generation
        if new.term < old.term or new.generation < old.generation or \
                ((new.flush_lsn < old.flush_lsn or new.commit_lsn < old.commit_lsn) and not cut):
            raise ValueError(f"positions move back from {old} to {new}")
        self._value = new
        loop = self._loop
        if loop is None or not any(predicate(new) for predicate in list(self._watching)):
            return
        with self._lock:
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            loop.call_soon_threadsafe(self._wake_all)
        except RuntimeError:  # the loop is closed: nobody is left to wake
            self._wake_pending = False

    def _wake_all(self) -> None:
        with self._lock:
            self._wake_pending = False
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
        self._loop = asyncio.get_running_loop()
        if self._wake is None:
            self._wake = asyncio.Event()
        wake = self._wake
        self._watching.append(predicate)
        try:
            if not predicate(self._value):  # published by a thread since the caller looked
                if self.on_wait is not None:
                    self.on_wait()
                await wake.wait()
        finally:
            self._watching.remove(predicate)

"""The simulated PostgreSQL primaries: writes and flushes, crashes, promoted standbys, restored
copies and stale primaries coming back. What their walsenders do is the services' business."""

from __future__ import annotations

import bisect
from collections.abc import Callable

from sidecar.timelines import TimelineEntry
from sidecar.sim.context import Context
from sidecar.sim.trace import pos
from sidecar.sim.wal import BOOT, Primary


class Primaries:
    """Every primary the run has had, the current one, and what can happen to them."""

    def __init__(self, ctx: Context, flushed: Callable[[Primary], None], gone: Callable[[Primary], None]) -> None:
        self.ctx = ctx
        self.all = [Primary("pg1", 1, ())]
        self.current = self.all[0]
        self._flushed = flushed  # its walsenders wake up
        self._gone = gone  # its replication connections break

    def live(self) -> list[Primary]:
        return [p for p in self.all if p.alive]

    def restore(self, at: int) -> Primary:
        """Replace the current primary by a copy of its WAL up to the record end `at`."""
        old = self.current
        new = self.take_over(old.fork(f"pg{len(self.all) + 1}", at, old.timeline, old.history))
        old.alive = False
        self._gone(old)
        return new

    def take_over(self, new: Primary) -> Primary:
        """`new` (a promoted standby, a restored copy) becomes the current primary."""
        self.all.append(new)
        self.current = new
        return new

    def _pick_live(self) -> Primary | None:
        rng = self.ctx.rng
        if self.current.alive and rng.random() < 0.8:
            return self.current
        live = self.live()
        return rng.choice(live) if live else None

    def _standby_point(self, pg: Primary) -> int:
        """Where a standby of `pg` stops replaying: a record end at or below pg's flush."""
        rng = self.ctx.rng
        k = bisect.bisect_right(pg.ends, pg.flush)
        if k == 0:
            return BOOT
        return pg.ends[k - 1] if rng.random() < 0.5 else pg.ends[rng.randint(0, k - 1)]

    # ---- scheduled events ------------------------------------------------------------------------

    def write(self) -> bool:
        pg = self._pick_live()
        if pg is None:
            return False
        start = pg.end
        rng = self.ctx.rng
        for _ in range(rng.randint(1, 3)):
            pg.write_record(rng)
        self.ctx.event(pg.name, "writes", start, pg.end)
        return True

    def flush(self) -> bool:
        pg = self._pick_live()
        if pg is None or pg.flush >= pg.end:
            return False
        pg.flush_some(self.ctx.rng)
        self.ctx.event(pg.name, "flushes to", pg.flush)
        self._flushed(pg)
        return True

    def crash(self) -> bool:
        pg = self._pick_live()
        if pg is None:
            return False
        sent = pg.sent
        cut, torn = pg.crash(self.ctx.rng)
        self.ctx.count("primary crashes")
        if sent > cut:
            self.ctx.count("sent primary WAL overwritten")
        pg.sent = min(sent, cut)
        self.ctx.event(pg.name, "crashes; recovers to", cut, f"torn_flushed={torn}", f"sent={pos(sent)}")
        self._gone(pg)
        return True

    def promote_standby(self) -> bool:
        pg = self.current
        if not pg.alive:
            return False
        at = self._standby_point(pg)
        tli = max(p.timeline for p in self.all) + 1
        history = pg.history + (TimelineEntry(pg.timeline, at),)
        new = self.take_over(pg.fork(f"pg{len(self.all) + 1}", at, tli, history))
        self.ctx.count("standbys promoted")
        split = self.ctx.rng.random() < 0.3
        self.ctx.event(new.name, "promoted", f"from={pg.name}", f"at={pos(at)}", f"timeline={tli}",
                       "old primary keeps running" if split else "old primary stopped")
        if not split:
            pg.alive = False
            self._gone(pg)
        return True

    def restore_from_copy(self) -> bool:
        pg = self.current
        if not pg.alive:
            return False
        at = self._standby_point(pg)
        new = self.take_over(pg.fork(f"pg{len(self.all) + 1}", at, pg.timeline, pg.history))
        pg.alive = False
        self.ctx.count("primaries restored from a copy")
        self.ctx.event(new.name, "restored from a copy of", pg.name, f"at={pos(at)}")
        self._gone(pg)
        return True

    def resume_stale(self) -> bool:
        stale = [p for p in self.all if not p.alive]
        if not stale:
            return False
        pg = self.ctx.rng.choice(stale)
        pg.alive = True
        self.current = pg
        self.ctx.count("stale primaries resumed")
        self.ctx.event(pg.name, "stale primary comes back")
        return True

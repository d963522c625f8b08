"""The simulated cluster: the actors put together, and the seeded scheduler that drives them.

Each actor lives in its own module and drives the real core the way the production service does:
`safekeepers` (one `AcceptorSession` per connection, as `sidecar/safekeeper/server.py`),
`services` (one `Proposer` per replication stream, as `sidecar/proposer/service.py`),
`network`, `primaries` and `hostile` peers. A seeded random scheduler picks the next step among
everything that could happen next.
"""

from __future__ import annotations

import bisect

from sidecar.sim.broker import SimBroker
from sidecar.sim.checker import Checker
from sidecar.sim.context import Context
from sidecar.sim.failovers import Failovers
from sidecar.sim.hostile import Hostile
from sidecar.sim.network import Network
from sidecar.sim.nodes import Service, SimSafekeeper
from sidecar.sim.primaries import Primaries
from sidecar.sim.profile import SimConfig
from sidecar.sim.readers import Readers
from sidecar.sim.safekeepers import Safekeepers
from sidecar.sim.services import Services
from sidecar.sim.wal import Primary

__all__ = ["SimConfig", "World"]


class World:
    """Everything simulated; `step()` is one random event, `run()` a whole seed.

    With `scripted=True` nothing happens by itself: no proposer is started, links are
    never slow and never linger, and a test drives the world with the methods at the end.
    """

    def __init__(self, seed: int, cfg: SimConfig | None = None, scripted: bool = False) -> None:
        self.seed = seed
        self.cfg = cfg = cfg or SimConfig()
        self.ctx = ctx = Context(seed, cfg, scripted)
        self.profile = ctx.profile
        self.safekeepers = [SimSafekeeper(f"sk{i + 1}", i + 1) for i in range(self.profile.safekeepers)]
        self.by_name = {sk.name: sk for sk in self.safekeepers}
        self.services: list[Service] = []
        self.trace = ctx.trace
        self.stats = ctx.stats
        self.checker = Checker(self.safekeepers, cfg.disabled)
        self.net = Network(ctx, self.safekeepers, self.services, lambda c, notify: self.svcs.link_closed(c, notify))
        self.sks = Safekeepers(ctx, self.checker, self.net, self.safekeepers)
        self.pgs = Primaries(ctx, flushed=lambda pg: self.svcs.primary_flushed(pg),
                             gone=lambda pg: self.svcs.primary_gone(pg))
        self.primaries = self.pgs.all
        self.broker = SimBroker(ctx, self.checker)
        self.svcs = Services(ctx, self.checker, self.net, self.safekeepers, self.pgs, self.services, self.broker)
        self.hostile = Hostile(ctx, self.net, self.sks, self.services)
        self.readers = Readers(ctx, self.checker, self.safekeepers)
        self.failovers = Failovers(ctx, self.checker, self.safekeepers, self.pgs, self.svcs)
        self._handlers, self._weights = self._schedule()
        if not scripted:
            self.svcs.start()

    @property
    def step_no(self) -> int:
        return self.ctx.step

    @property
    def current(self) -> Primary:
        """The primary a new service attaches to."""
        return self.pgs.current

    # ---- the scheduler -------------------------------------------------------------------------

    def _schedule(self) -> tuple[list, list[float]]:
        c, p = self.profile.chaos, self.profile
        sks, svcs, pgs, net, hostile, readers = self.sks, self.svcs, self.pgs, self.net, self.hostile, self.readers
        fails = self.failovers
        table = [
            (30, sks.deliver), (30, svcs.deliver), (4, sks.sync), (4, sks.acknowledge), (8, sks.apply_scan),
            (10, pgs.write), (8, pgs.flush), (14, svcs.stream_piece),
            (6, svcs.catchup_piece), (4, svcs.verify), (3, svcs.heartbeat),
            (1.5, svcs.election_timeout), (5, svcs.reconnect), (4, net.eof),
            (1.0 * c, net.break_connection), (0.5 * c, sks.crash_one),
            (4, sks.restart_one), (0.15 * c, svcs.crash), (3, svcs.restart),
            (p.rivals * c, svcs.start_rival), (3, svcs.new_term), (0.25 * c, pgs.crash),
            (0.02 * c, pgs.promote_standby), (0.03 * c, pgs.restore_from_copy),
            (0.02 * c, pgs.resume_stale), (0.15 * c, net.partition), (1.5, net.heal),
            (p.rogues * c, hostile.rogue), (p.liars * c, hostile.lie),
            (2, readers.connect), (8, readers.read),
            (p.disk_losses * c, sks.lose_disk), (3, sks.learn_terms),
            (p.failovers * c, fails.start), (3, fails.promote),
        ]
        # degrade-after, last and weighing nothing in the other seeds, so that their runs stay as they were. With it,
        # a primary changes only through a failover's gate (and one sidecar runs per primary, as the advisory lock
        # has it): a standby promoted behind the gate's back, a restored copy or a stale primary coming back would
        # lose degraded acknowledgements by design, as would a rival sidecar on another primary.
        d = self.ctx.degrade_after
        unsafe = {pgs.promote_standby, pgs.restore_from_copy, pgs.resume_stale, svcs.start_rival}
        if d:
            table = [(0, h) if h in unsafe else (w, h) for w, h in table]
        table += [(3 if d else 0, svcs.clock), (4 if d else 0, self.broker.answer)]
        weights, total = [], 0.0
        for w, _ in table:
            total += w
            weights.append(total)
        return [h for _, h in table], weights

    def step(self) -> None:
        """One scheduled event (a few tries to find one that can happen), then every check."""
        self.ctx.step += 1
        rng, weights = self.ctx.rng, self._weights
        for _ in range(6):
            h = self._handlers[bisect.bisect_right(weights, rng.random() * weights[-1])]
            if h():
                break
        self.checker.after_step()

    def run(self, steps: int | None = None) -> None:
        for _ in range(self.cfg.steps if steps is None else steps):
            self.step()

    # ---- scripted control (tests) ----------------------------------------------------------------

    def start_service(self) -> Service:
        """A proposer process attached to the current primary, with no link up yet."""
        return self.svcs.start()

    def connect(self, svc: Service, name: str) -> None:
        self.svcs.connect(svc, self.by_name[name])

    def disconnect(self, svc: Service, name: str) -> None:
        c = svc.links[name]
        assert c is not None
        self.net.close_prop_end(c, notify=True)

    def end_term(self, svc: Service) -> None:
        """The replication stream ended: the next `new_term` builds a new Proposer."""
        self.svcs.end_term(svc)

    def new_term(self, svc: Service) -> None:
        self.svcs.new_core(svc)

    def produce(self, records: int) -> None:
        """The current primary writes and flushes `records` records; its walsenders send them."""
        pg = self.current
        for _ in range(records):
            pg.write_record(self.ctx.rng)
        pg.flush = pg.end
        for svc in self.services:
            if svc.primary is pg and svc.stream is not None:
                self.svcs.send_wal(svc, pg.flush)

    def restore_primary(self, at: int) -> Primary:
        """Replace the current primary by a copy of its WAL up to the record end `at`."""
        return self.pgs.restore(at)

    def heartbeat(self, svc: Service) -> None:
        assert svc.core is not None
        self.svcs.run(svc, svc.core.heartbeat())

    def busy(self, steps: int) -> None:
        """Up to `steps` fault-free events, in a random order."""
        for _ in range(steps):
            if not self._calm_step():
                return

    def settle(self, limit: int = 1_000_000) -> None:
        """Fault-free events until there is nothing left to deliver, flush, send or check."""
        for _ in range(limit):
            if not self._calm_step():
                return
        raise AssertionError("the world did not settle")

    def _calm_step(self) -> bool:
        self.ctx.step += 1
        calm = [self.sks.deliver, self.svcs.deliver, self.sks.sync, self.sks.acknowledge, self.sks.apply_scan,
                self.svcs.stream_piece,
                self.svcs.catchup_piece, self.svcs.verify, self.net.eof]
        if self.ctx.degrade_after:
            calm.append(self.broker.answer)
        self.ctx.rng.shuffle(calm)
        done = any(h() for h in calm)
        self.checker.after_step()
        return done

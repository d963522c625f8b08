"""The simulated `walsidecar failover`: a fence term for a standby of the current primary, then its promotion.

The failover drives the real core with `FailoverTerm.END` (as `proposer/fence.py` does): it wins a
term from a quorum, recovers the voters below E from the donor, and once a quorum holds E in its term
(so a quorum persisted the fence its Elected set), promotes a standby holding the safekeepers' WAL up
to E on a new timeline. The old primary often stays alive, with its sidecar still running: the
failover-live case, where only the fence keeps it from having another commit acknowledged.

With degrade-after, the failover reads the broker's open range first and its term's votes must cover it
(the core's gate, `ProposerConfig.gate`, as `ops/failover.py` runs it); its last broker transaction before
promoting checks that range (or its absence) still stands, closes it and raises the failover floor, so that
the old sidecar can neither open a new range nor record a new version of its old one.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

from sidecar.consensus.messages import NO_DEGRADED
from sidecar.timelines import TimelineEntry
from sidecar.consensus.proposer import FailoverTerm, Phase, Proposer
from sidecar.sim.checker import Checker
from sidecar.sim.context import Context
from sidecar.sim.nodes import Service, SimSafekeeper
from sidecar.sim.primaries import Primaries
from sidecar.sim.services import Services
from sidecar.sim.trace import pos
from sidecar.sim.wal import BOOT, Primary


class Failovers:
    """`walsidecar failover` runs: at most one at a time, as an operator (or an HA manager) runs them."""

    def __init__(self, ctx: Context, checker: Checker, safekeepers: list[SimSafekeeper], primaries: Primaries,
                 services: Services) -> None:
        self.ctx = ctx
        self.checker = checker
        self.safekeepers = safekeepers
        self.by_name = {sk.name: sk for sk in safekeepers}
        self.primaries = primaries
        self.svcs = services
        self.runs = 0

    def start(self) -> bool:
        """A failover to a standby of the current primary begins: its fence connects to every safekeeper."""
        if any(svc.fence and svc.alive for svc in self.svcs.all):
            return False
        pg = self.primaries.current
        self.runs += 1
        svc = Service(f"F{self.runs}", pg, fence=True)
        svc.label = svc.name
        svc.links = {sk.name: None for sk in self.safekeepers}
        self.svcs.all.append(svc)
        gate = self.svcs.broker.record if self.ctx.cfg.degraded_gate else NO_DEGRADED
        svc.core = Proposer(replace(self.svcs.config(pg, svc), failover=FailoverTerm.END, gate=gate))
        self.ctx.count("failovers begun")
        self.ctx.event(svc.label, "failover begins", f"standby of {pg.name}", f"timeline={pg.timeline}",
                       "old primary alive" if pg.alive else "old primary dead")
        return True

    def promote(self) -> bool:
        """A failover whose E a quorum holds in its term promotes the standby, caught up to E from the safekeepers."""
        cands = [svc for svc in self.svcs.all if svc.fence and svc.alive and svc.core is not None
                 and svc.core.phase is Phase.STREAMING and svc.core.commit_lsn >= svc.core.term_start > 0]
        if not cands:
            return False
        svc = self.ctx.rng.choice(cands)
        core = svc.core
        assert core is not None
        end = core.term_start
        source = self.svcs.holder(core.term, end)
        if source is None:
            return False  # nobody serves E in the term right now: the standby is still catching up
        if self.ctx.cfg.degraded_gate and self.ctx.degrade_after:
            final = svc.gate_final if svc.gate_final is not None else \
                self.svcs.broker.failover_final(NO_DEGRADED, core.term)
            if not final:
                self.ctx.count("failovers refused: the degraded range changed")
                self.svcs.stop(svc, "failover refused: a degraded range opened or changed while it ran")
                return True
        starts, ends = source.disk.chain()
        k = bisect.bisect_right(ends, end)
        old = svc.primary
        timeline = max(p.timeline for p in self.primaries.all) + 1
        history = old.history + (TimelineEntry(old.timeline, end),)
        standby = Primary(f"pg{len(self.primaries.all) + 1}", timeline, history, source.disk.read(BOOT, end),
                          list(starts[:k]), list(ends[:k]))
        self.primaries.take_over(standby)
        self.checker.failed_over(core.fence, standby)
        self.ctx.count("failovers promoted")
        self.ctx.event(svc.label, "promotes", standby.name, f"timeline={timeline}", f"at={pos(end)}",
                       f"fence term={core.fence.term} ends timeline {core.fence.timeline}",
                       f"{old.name} still alive" if old.alive else f"{old.name} dead")
        self.svcs.stop(svc, "failover done")
        return True

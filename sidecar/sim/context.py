"""What every actor of one simulated run shares: the seed's randomness, its profile, the step, the trace."""

from __future__ import annotations

import random

from sidecar.consensus.messages import Message
from sidecar.sim.profile import Profile, SimConfig
from sidecar.sim.trace import Delivery, Event, Trace


class Context:
    """The seeded random source and profile, the step counter, the trace and the coverage counters."""

    def __init__(self, seed: int, cfg: SimConfig, scripted: bool) -> None:
        self.cfg = cfg
        # Scripted: nothing happens by itself; links are never slow and never linger.
        self.scripted = scripted
        self.rng = random.Random(seed)
        self.profile = Profile.draw(self.rng, cfg)
        # --commit-wait degrade-after=T (T in steps; 0: off), from a random source of its own: the seed's other
        # draws stay what they were.
        side = random.Random(f"degrade-{seed}")
        on = cfg.degrade >= 1.0 if scripted else side.random() < cfg.degrade
        self.degrade_after = side.choice((4, 15, 40)) if on else 0
        self.trace = Trace(cfg.trace)
        self.step = 0
        self.stats: dict[str, int] = {}

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def event(self, actor: str, what: str, *args: object) -> None:
        self.trace.add(Event(self.step, actor, what, args))

    def delivered(self, conn: str, to_safekeeper: bool, msg: Message) -> None:
        self.trace.add(Delivery(self.step, conn, to_safekeeper, msg))

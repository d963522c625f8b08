"""The simulated network: TCP links between proposer services and safekeepers, breaks and partitions.

A connection is FIFO both ways and never loses, reorders or duplicates a message by itself; its
two ends close independently (see `sidecar.sim`'s docstring for the whole model).
"""

from __future__ import annotations

from collections.abc import Callable

from sidecar.consensus.session import AcceptorSession, Role
from sidecar.sim.context import Context
from sidecar.sim.nodes import Connection, Service, SimSafekeeper


class Network:
    """Opens and closes connections, delivers nothing itself, and cuts or heals partitions."""

    def __init__(self, ctx: Context, safekeepers: list[SimSafekeeper], services: list[Service],
                 link_closed: Callable[[Connection, bool], None]) -> None:
        self.ctx = ctx
        self.safekeepers = safekeepers
        self.services = services
        self._link_closed = link_closed  # the service's side of a proposer end closing
        self.cut_off: set[tuple[str, str]] = set()  # (service, safekeeper) pairs partitioned apart
        self._seq = 0

    def reachable(self, svc: Service, sk: SimSafekeeper) -> bool:
        return (svc.name, sk.name) not in self.cut_off

    def pick(self, cands: list[Connection]) -> Connection | None:
        """A connection to deliver on; a slow one usually lets this turn pass."""
        if not cands:
            return None
        rng = self.ctx.rng
        c = rng.choice(cands)
        return None if c.slow and not self.ctx.scripted and rng.random() < 0.7 else c

    def open(self, label: str, sender: str, svc: Service | None, sk: SimSafekeeper,
             role: Role = Role.PROPOSER) -> Connection:
        """A connection accepted by `sk`, with its session, as the server's `_connection` starts one."""
        assert sk.acceptor is not None
        self._seq += 1
        session = AcceptorSession(sk.acceptor, role)
        c = Connection(f"{label}-{sk.name}#{self._seq}", sender, svc, sk,
                       slow=svc is not None and self.ctx.rng.random() < 0.2, session=session)
        session.conn = c
        sk.conns.append(c)
        return c

    def close_prop_end(self, c: Connection, notify: bool, lose: bool = False) -> None:
        """The proposer's end closes: it reads nothing more; what it sent may still arrive."""
        if not c.prop_open:
            return
        c.prop_open = c.lingering = False
        c.to_prop.clear()
        if lose and c.to_sk:
            # A network failure: TCP delivered some prefix of what was in flight.
            for _ in range(self.ctx.rng.randint(0, len(c.to_sk))):
                c.to_sk.pop()
        self._link_closed(c, notify)

    def close_sk_end(self, c: Connection) -> None:
        if not c.sk_open:
            return
        c.sk_open = False
        c.to_sk.clear()
        c.sk.conns.remove(c)
        c.session.closed()

    # ---- scheduled events ------------------------------------------------------------------------

    def break_connection(self) -> bool:
        cands = [c for sk in self.safekeepers for c in sk.conns if c.prop_open]
        if not cands:
            return False
        rng = self.ctx.rng
        c = rng.choice(cands)
        if rng.random() < 0.5:
            self.ctx.event(c.label, "breaks (proposer side)")
            self.close_prop_end(c, notify=True, lose=True)
        else:
            self.ctx.event(c.label, "breaks (safekeeper side)")
            self.close_sk_end(c)
        return True

    def eof(self) -> bool:
        """An end whose peer has closed reads the rest of the stream, then sees EOF."""
        cands = [(c, True) for sk in self.safekeepers for c in sk.conns
                 if (not c.prop_open or c.lingering) and not c.to_sk and not c.busy]
        cands += [(c, False) for svc in self.services for c in svc.links.values()
                  if c is not None and (not c.sk_open or c.lingering) and not c.to_prop]
        if not cands:
            return False
        c, at_sk = self.ctx.rng.choice(cands)
        if at_sk:
            self.close_sk_end(c)
        else:
            self.ctx.event(c.label, "EOF at the proposer")
            self.close_prop_end(c, notify=True)
        return True

    def partition(self) -> bool:
        live = [svc for svc in self.services if svc.alive]
        if not live:
            return False
        rng = self.ctx.rng
        names = [sk.name for sk in self.safekeepers]
        cut = rng.sample(names, rng.randint(1, len(names)))
        svcs = live if rng.random() < 0.5 else [rng.choice(live)]
        for svc in svcs:
            self.cut_off.update((svc.name, n) for n in cut)
        self.ctx.event("network", "partition", "+".join(s.name for s in svcs), "|", "+".join(sorted(cut)))
        return True

    def heal(self) -> bool:
        if not self.cut_off:
            return False
        self.cut_off.clear()
        self.ctx.event("network", "heals")
        return True

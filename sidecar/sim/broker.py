"""The simulated etcd of `--commit-wait degrade-after`: the degraded range's key and the failover floor.

Durable (no lease: a dead sidecar's range stays), linearizable, and answering later than asked: each
request waits in a queue until a scheduled step answers it, as `sidecar/broker.py`'s calls do from their
own thread. The transactions compare what the real ones compare (`broker.py`): a new range only where
none is open and no failover of its term or later happened; a new version only over the previous one;
a close only of the version it names; a failover's final step only over the range it gated on (or none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sidecar.consensus.messages import NO_DEGRADED, DegradedRange
from sidecar.sim.checker import Checker
from sidecar.sim.context import Context


@dataclass(eq=False)
class Request:
    what: str  # "store" or "close"
    record: DegradedRange
    done: Callable[[bool], None]
    previous: DegradedRange = NO_DEGRADED


class SimBroker:
    def __init__(self, ctx: Context, checker: Checker) -> None:
        self.ctx = ctx
        self.checker = checker
        self.record = NO_DEGRADED
        self.floor = 0  # the highest fence term of a failover that promoted
        self.queue: list[Request] = []

    def submit(self, what: str, record: DegradedRange, done: Callable[[bool], None],
               previous: DegradedRange = NO_DEGRADED) -> None:
        self.queue.append(Request(what, record, done, previous))

    def store(self, record: DegradedRange, previous: DegradedRange) -> bool:
        if not previous:
            ok = not self.record and self.floor < record.term
        else:
            ok = self.record == previous
        if ok:
            self.record = record
            self.checker.degraded_recorded(record)
        return ok

    def close(self, record: DegradedRange) -> bool:
        if self.record != record:
            return False
        self.record = NO_DEGRADED
        self.checker.degraded_closed()
        return True

    def failover_final(self, gate: DegradedRange, fence_term: int) -> bool:
        """The failover's last transaction before it promotes: the range it gated on (or none) is still the key."""
        if self.record != gate:
            return False
        if gate:
            self.record = NO_DEGRADED
            self.checker.degraded_closed()
        self.floor = max(self.floor, fence_term)
        return True

    def answer(self) -> bool:
        """The oldest request is carried out; its caller hears the answer."""
        if not self.queue:
            return False
        r = self.queue.pop(0)
        ok = self.store(r.record, r.previous) if r.what == "store" else self.close(r.record)
        self.ctx.event("etcd", f"{r.what} {'done' if ok else 'refused'}", f"t{r.record.term}v{r.record.version}",
                       f"members={sorted(r.record.members)}")
        r.done(ok)
        return True

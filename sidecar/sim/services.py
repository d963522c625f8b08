"""The simulated proposer services: one real `Proposer` per replication stream, and the glue of
`sidecar/proposer/service.py` around it (links, the primary check, streaming, catch-up, timers)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from sidecar.consensus import primary_check
from sidecar.consensus.degraded import DegradedCarry
from sidecar.consensus.statusschedule import SendStatus
from sidecar.consensus.proposer import (
    Action,
    Campaign,
    CloseDegraded,
    DegradeBegan,
    DegradeEnded,
    DegradeMembers,
    DropPeer,
    ElectionWon,
    FetchWal,
    GateRefused,
    GreetingsRefused,
    LineageEnded,
    Proposer,
    ProposerConfig,
    ProposerEvent,
    ReportStatus,
    Send,
    StartStreaming,
    StoreDegraded,
    Streaming,
    TermLost,
    TermsExhausted,
    VerifyPrimary,
)
from sidecar.sim.broker import SimBroker
from sidecar.sim.checker import Checker
from sidecar.sim.context import Context
from sidecar.sim.network import Network
from sidecar.sim.nodes import Connection, Fetch, Service, SimSafekeeper, Stream
from sidecar.sim.primaries import Primaries
from sidecar.sim.profile import PG_VERSION, SYSTEM_ID
from sidecar.sim.trace import pos
from sidecar.sim.wal import BOOT, Primary

class Services:
    """Every `walsidecar start` process of the run, and what can happen to them."""

    def __init__(self, ctx: Context, checker: Checker, net: Network, safekeepers: list[SimSafekeeper],
                 primaries: Primaries, services: list[Service], broker: SimBroker) -> None:
        self.ctx = ctx
        self.broker = broker
        self.checker = checker
        self.net = net
        self.safekeepers = safekeepers
        self.by_name = {sk.name: sk for sk in safekeepers}
        self.primaries = primaries
        self.all = services

    def config(self, primary: Primary, svc: Service) -> ProposerConfig:
        p = self.ctx.profile
        return ProposerConfig(
            proposer_id=svc.name, peers=tuple(sk.name for sk in self.safekeepers),
            quorum=self.ctx.cfg.proposer_quorum or len(self.safekeepers) // 2 + 1, system_id=SYSTEM_ID,
            timeline=primary.timeline, timeline_history=primary.history, wal_seg_size=p.seg_size, pg_version=PG_VERSION,
            bootstrap_lsn=BOOT, max_inflight=p.max_inflight, buffer_limit=p.buffer_limit,
            degrade_after=0.0 if svc.fence else float(self.ctx.degrade_after), carried=None if svc.fence else svc.carry)

    def run(self, svc: Service, actions: list[Action]) -> None:
        """The service's `_run`: carry out one batch of proposer actions."""
        core = svc.core
        lost = refused = False
        for a in actions:
            match a:
                case Send():
                    c = svc.links.get(a.peer)
                    if c is not None and c.prop_open and not c.lingering:
                        c.to_sk.append(a.message)
                case ReportStatus():
                    if svc.fence and core is not None:
                        holder = self.holder(core.term, a.flush_lsn)
                        self.checker.failover_committed(svc, core, a, holder.disk if holder else None)
                    elif svc.stream is not None and core is not None:
                        self.ctx.count("reports")
                        if a.flush_lsn > core.commit_lsn:
                            self.ctx.count("degraded acknowledgements")
                            self.checker.degraded_acknowledged(svc, core, a)
                        svc.reports.append(a)
                        try:
                            svc.stream.schedule.report(a.write_lsn, a.flush_lsn, a.apply_lsn, self.ctx.step)
                        except ValueError:
                            # The real service refuses it and ends the term; the core's bug is still a violation.
                            self.checker.reported(svc, core, a)
                        else:
                            self._poll_status(svc, core)
                case StartStreaming():
                    assert core is not None
                    if svc.fence:  # a failover streams no WAL: its Elected went out with this action
                        self.ctx.event(svc.label, "fences", f"E={pos(a.start_lsn)}")
                    else:
                        self._start_stream(svc, core, a.start_lsn)
                case VerifyPrimary():
                    assert core is not None
                    svc.verifies.append((core, a))
                    svc.checks.append(a)
                case FetchWal():
                    svc.fetches[a.peer] = Fetch(a.start, a.end)
                    svc.fetched.append(a)
                    self.ctx.count("catch-ups")
                    self.ctx.event(svc.label, "fetches for", a.peer, a.start, a.end)
                case TermLost():
                    svc.last_term = max(svc.last_term, a.term)
                    self.ctx.event(svc.label, "term lost", a.reason)
                    lost = True
                case ElectionWon() if svc.fence:
                    svc.donor = a.donor
                    self.ctx.event(svc.label, a.name, *(f"{k}={v}" for k, v in a.fields().items()))
                case GreetingsRefused():
                    refused = True
                case LineageEnded():
                    self.ctx.count("primaries fenced out by a failover")
                    self.stop(svc, "exits: a failover ended its primary's timeline")
                case DropPeer():
                    # The service logs the protocol error and closes that link; it reconnects later.
                    self.ctx.count("links dropped by the proposer")
                    self.ctx.event(svc.label, "drops", a.peer, a.reason)
                    c = svc.links.get(a.peer)
                    if c is not None:
                        self.net.close_prop_end(c, notify=False)
                case TermsExhausted():
                    self.stop(svc, "exits: no term left to campaign in")
                case StoreDegraded():
                    self.broker.submit("store", a.record, self._stored(svc, core, a.record.version), a.previous)
                case CloseDegraded() if svc.fence:
                    # The failover's last transaction, just before it promotes (ops/failover.py).
                    svc.gate_final = self.broker.failover_final(a.record, core.term if core else 0)
                case CloseDegraded():
                    svc.closing.add(a.record)
                    self.broker.submit("close", a.record, lambda ok: None)
                case GateRefused():
                    self.ctx.count("failovers refused by the degraded gate")
                    self.stop(svc, f"failover refused: {a.reason}")
                case DegradeBegan() | DegradeMembers() | DegradeEnded():
                    self.ctx.count(a.name.split(":")[0])
                    self.ctx.event(svc.label, a.name.split(":")[0], *(f"{k}={v}" for k, v in a.fields().items()))
                case Campaign() | ElectionWon() | Streaming():  # the events worth a trace line
                    self.ctx.event(svc.label, a.name, *(f"{k}={pos(v) if k.endswith('_lsn') else v}"
                                                        for k, v in a.fields().items()))
                case ProposerEvent():
                    pass
                case _:
                    raise AssertionError(f"the simulator does not know the action {a!r}")
        if refused and svc.alive:
            self.ctx.count("proposers stopped by refused greetings")
            self.stop(svc, "exits: safekeepers refuse its greeting")
        elif lost and svc.fence and svc.alive:
            self.stop(svc, "failover stops: its fence term was lost (run it again)")
        elif lost and svc.core is core:
            self.end_term(svc)

    def _start_stream(self, svc: Service, core: Proposer, start: int) -> None:
        if svc.primary.flush < start:
            self.ctx.event(svc.label, "START_REPLICATION fails", start)
            self.end_term(svc)
            return
        svc.stream = Stream(start, start)
        self.ctx.count("terms streamed")
        self.checker.streaming(svc, core)

    # ---- links ------------------------------------------------------------------------------------

    def connect(self, svc: Service, sk: SimSafekeeper) -> None:
        c = self.net.open(svc.label, svc.label, svc, sk)
        svc.links[sk.name] = c
        self.ctx.event(svc.label, "connects", c.label)
        assert svc.core is not None
        self.run(svc, svc.core.peer_connected(sk.name))

    def link_closed(self, c: Connection, notify: bool) -> None:
        """The proposer end of `c` closed: the service forgets the link (and tells its core if asked)."""
        svc, name = c.svc, c.sk.name
        if svc is not None and svc.links.get(name) is c:
            svc.links[name] = None
            svc.fetches.pop(name, None)  # the service cancels the catch-up of a peer that went down
            if notify and svc.core is not None:
                self.run(svc, svc.core.peer_disconnected(name))

    # ---- terms ------------------------------------------------------------------------------------

    def new_core(self, svc: Service) -> None:
        pgs, rng = self.primaries, self.ctx.rng
        live = pgs.live()
        if pgs.current.alive and (rng.random() < 0.85 or not svc.primary.alive):
            svc.primary = pgs.current
        elif not svc.primary.alive:
            svc.primary = rng.choice(live)
        svc.attempts += 1
        svc.label = f"{svc.name}.{svc.attempts}"
        record = self.broker.record
        if self.ctx.degrade_after and svc.carry is None and record and record not in svc.closing:
            # The service's read at each term's start: a range a dead sidecar's late write left open.
            svc.carry = DegradedCarry(record, svc.primary.flush)
        svc.core = Proposer(self.config(svc.primary, svc), min_term=svc.last_term)
        self.ctx.event(svc.label, "new term attempt", f"primary={svc.primary.name}", f"min_term={svc.last_term}")
        for name, c in svc.links.items():
            if c is not None:  # a link whose close the service has not noticed yet
                self.run(svc, svc.core.peer_connected(name))

    def end_term(self, svc: Service) -> None:
        """The service's `_end_term`: the core goes, every link is dropped."""
        if svc.fence:  # a failover whose term ends stops there: the operator runs it again
            self.stop(svc, "failover stops: its term ended (run it again)")
            return
        core = svc.core
        if core is not None:
            svc.last_term = max(svc.last_term, core.term)
            core.stream_ended()
            svc.carry = core.open_range()
        self.ctx.event(svc.label, "term over")
        svc.core, svc.stream = None, None
        svc.fetches.clear()
        svc.verifies.clear()
        for c in svc.links.values():
            if c is None:
                continue
            if not self.ctx.scripted and self.ctx.rng.random() < 0.15:
                c.lingering = True
            else:
                self.net.close_prop_end(c, notify=False)

    def start(self) -> Service:
        pgs = self.primaries
        svc = Service(f"P{len(self.all) + 1}", pgs.current if pgs.current.alive else self.ctx.rng.choice(pgs.live()))
        svc.links = {sk.name: None for sk in self.safekeepers}
        self.all.append(svc)
        self.ctx.event(svc.name, "starts")
        self.new_core(svc)
        return svc

    def stop(self, svc: Service, why: str) -> None:
        self.ctx.event(svc.label, why)
        svc.alive = False
        svc.core, svc.stream = None, None
        svc.fetches.clear()
        svc.verifies.clear()
        for c in svc.links.values():
            if c is not None:
                self.net.close_prop_end(c, notify=False, lose=True)

    def holder(self, term: int, end: int) -> SimSafekeeper | None:
        """A safekeeper holding WAL up to `end` written in `term`, from BOOT: where a failover reads it."""
        for sk in self.safekeepers:
            acc = sk.acceptor
            if acc is None or sk.disk.start != BOOT or acc.flush_lsn < end:
                continue
            th = acc.state.term_history
            if th and th[-1].term == term:
                return sk
        return None

    def send_wal(self, svc: Service, upto: int) -> None:
        st, pg, core = svc.stream, svc.primary, svc.core
        assert st is not None and core is not None
        lsn = st.pos
        if upto <= lsn:
            return
        st.pos = upto
        pg.sent = max(pg.sent, upto)
        self.ctx.event(svc.label, "receives WAL", lsn, upto)
        self.run(svc, core.wal_received(lsn, pg.read(lsn, upto)))

    # ---- what the primaries do to the services ----------------------------------------------------

    def primary_flushed(self, pg: Primary) -> None:
        """Walsenders wake up on a flush: often the new WAL is on its way at once, which is
        what lets a crash right after it overwrite bytes already sent."""
        for svc in self.all:
            if svc.primary is pg and svc.stream is not None and self.ctx.rng.random() < 0.5:
                self.send_wal(svc, pg.flush)

    def primary_gone(self, pg: Primary) -> None:
        """Its replication connections break: every term streaming from it ends."""
        for svc in self.all:
            if svc.primary is pg and svc.core is not None and not svc.fence:  # a failover needs no primary
                self.end_term(svc)

    # ---- scheduled events ------------------------------------------------------------------------

    def deliver(self) -> bool:
        """A reply reaches a live service."""
        cands = [c for svc in self.all if svc.alive for c in svc.links.values()
                 if c is not None and c.to_prop and self.net.reachable(svc, c.sk)]
        c = self.net.pick(cands)
        if c is None:
            return False
        msg = c.to_prop.popleft()
        self.ctx.delivered(c.label, False, msg)
        svc = c.svc
        assert svc is not None
        if svc.core is not None:
            self.run(svc, svc.core.peer_message(c.sk.name, msg))
        return True

    def reconnect(self) -> bool:
        cands = [(svc, sk) for svc in self.all if svc.alive and svc.core is not None
                 for sk in self.safekeepers if svc.links.get(sk.name) is None and sk.acceptor is not None
                 and self.net.reachable(svc, sk)]
        if not cands:
            return False
        self.connect(*self.ctx.rng.choice(cands))
        return True

    def new_term(self) -> bool:
        cands = [svc for svc in self.all if svc.alive and svc.core is None and not svc.fence]
        if not cands or not self.primaries.live():
            return False
        self.new_core(self.ctx.rng.choice(cands))
        return True

    def restart(self) -> bool:
        if any(svc.alive and not svc.fence for svc in self.all) or not self.primaries.live():
            return False
        self.start()
        return True

    def start_rival(self) -> bool:
        if sum(svc.alive and not svc.fence for svc in self.all) != 1 or not self.primaries.live():
            return False
        self.ctx.count("rival proposers")
        self.start()
        return True

    def crash(self) -> bool:
        live = [svc for svc in self.all if svc.alive]
        if not live:
            return False
        self.ctx.count("proposer crashes")
        self.stop(self.ctx.rng.choice(live), "crashes")
        return True

    def heartbeat(self) -> bool:
        return self._tick(Proposer.heartbeat)

    def clock(self) -> bool:
        """The service's commit-wait timer: the core hears the time (the step number)."""
        step = float(self.ctx.step)
        return self._tick(lambda core: core.tick(step))

    def _stored(self, svc: Service, core: Proposer | None, version: int) -> Callable[[bool], None]:
        def done(ok: bool) -> None:
            if ok and core is not None and svc.core is core:
                self.run(svc, core.degraded_stored(version))
        return done

    def election_timeout(self) -> bool:
        return self._tick(Proposer.election_timeout)

    def _tick(self, timer: Callable[[Proposer], list[Action]]) -> bool:
        """One of the service's periodic timers fires."""
        live = [svc for svc in self.all if svc.core is not None]
        if not live:
            return False
        svc = self.ctx.rng.choice(live)
        assert svc.core is not None
        if timer is Proposer.election_timeout:
            self.ctx.event(svc.label, "election timeout")
        self.run(svc, timer(svc.core))
        if svc.core is not None:
            self._poll_status(svc, svc.core)  # a delayed status whose time came
        return True

    def _poll_status(self, svc: Service, core: Proposer) -> None:
        """The stream's status schedule: a status it says is due now reaches the primary (the checker)."""
        if svc.stream is None:
            return
        now = float(self.ctx.step)
        decision = svc.stream.schedule.poll(now, now)
        if isinstance(decision, SendStatus):
            self.checker.reported(svc, core, ReportStatus(decision.write, decision.flush, decision.apply))
            svc.stream.schedule.sent(decision, now)

    def verify(self) -> bool:
        cands = [svc for svc in self.all if svc.verifies]
        if not cands:
            return False
        svc = self.ctx.rng.choice(cands)
        core, a = svc.verifies.pop(0)
        if core is not svc.core:
            return True
        refused = check_standby(svc.primary, a) if svc.fence else check_primary(svc.primary, a)
        if refused is None:
            self.ctx.event(svc.label, "primary verified", svc.primary.name, f"E={pos(a.start_lsn)}")
            self.run(svc, core.primary_verified())
            return True
        kind, problem = refused
        self.ctx.count("primaries refused")
        donor = self.by_name[a.donor].disk
        if donor.start == BOOT and donor.end >= a.start_lsn and svc.primary.end >= a.start_lsn and \
                donor.read(BOOT, a.start_lsn) == svc.primary.read(BOOT, a.start_lsn):
            # Liveness, not safety: the primary does hold the donor's WAL up to E.
            self.ctx.count(f"primaries refused that hold the donor's WAL ({kind})")
        self.ctx.event(svc.label, "primary refused", svc.primary.name, problem)
        self.run(svc, core.primary_refused(problem))
        self.stop(svc, "exits: refuses to stream")  # PrimaryMismatch is fatal
        return True

    def stream_piece(self) -> bool:
        cands = [svc for svc in self.all
                 if svc.stream is not None and svc.stream.pos < svc.primary.flush]
        if not cands:
            return False
        rng = self.ctx.rng
        svc = rng.choice(cands)
        assert svc.stream is not None
        self.send_wal(svc, min(svc.primary.flush, svc.stream.pos + rng.randint(1, 600)))
        return True

    def catchup_piece(self) -> bool:
        cands = [(svc, name) for svc in self.all for name in svc.fetches]
        if not cands:
            return False
        rng = self.ctx.rng
        svc, name = rng.choice(cands)
        f, core = svc.fetches[name], svc.core
        assert core is not None
        if not self.ctx.scripted and rng.random() < 0.03:
            self.ctx.event(svc.label, "catch-up fails", name)
            c = svc.links.get(name)
            del svc.fetches[name]
            if c is not None:
                self.net.close_prop_end(c, notify=True)
            return True
        lsn = f.pos
        f.pos = min(f.end, lsn + rng.randint(1, 800))
        if svc.fence:  # a failover reads the donor's WAL in its term, from the donor's reader port
            donor = self.by_name[svc.donor]
            th = donor.acceptor.state.term_history if donor.acceptor is not None else ()
            if donor.acceptor is None or not th or th[-1].term != core.term or donor.disk.start is None \
                    or not donor.disk.start <= lsn <= f.pos <= donor.acceptor.flush_lsn:
                self.ctx.event(svc.label, "catch-up from the donor fails", name)
                del svc.fetches[name]
                c = svc.links.get(name)
                if c is not None:
                    self.net.close_prop_end(c, notify=True)
                return True
            data = donor.disk.read(lsn, f.pos)
        else:
            data = svc.primary.read(lsn, f.pos)
        self.run(svc, core.catchup_data(name, lsn, data))
        if f.pos >= f.end and svc.fetches.get(name) is f:
            del svc.fetches[name]
            if svc.core is core:
                self.run(svc, core.catchup_done(name))
        return True


def check_standby(standby: Primary, a: VerifyPrimary) -> tuple[str, str] | None:
    """A failover's check before any vote (ops/failover.py lineage_problem): the standby follows the donor's timelines."""
    if a.start_lsn == 0:
        return "empty", "the safekeepers hold no WAL"
    if primary_check.switches_below(standby.history, a.start_lsn) != \
            primary_check.switches_below(a.timeline_history, a.start_lsn):
        return "history", "the standby follows another primary's WAL"
    return None


def check_primary(primary: Primary, a: VerifyPrimary) -> tuple[str, str] | None:
    """The service's primary check (consensus.primary_check) on the simulated primary: (which check, why) or None."""
    problem = primary_check.lineage_mismatch(a, primary.flush, primary.history)
    if problem is not None:
        return ("flush" if primary.flush < a.start_lsn else "history"), problem
    if a.tail_lsn:
        problem = primary_check.tail_mismatch(a, zlib.crc32(primary.read(a.tail_lsn, a.start_lsn)))
        if problem is not None:
            return "tail", problem
    return None

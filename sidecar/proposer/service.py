"""The proposer service: terms of the core (`consensus.proposer`) against the primary and the safekeepers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Protocol

import google_crc32c
import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from sidecar.consensus import codec, limits, primary_check
from sidecar.consensus.messages import GreetingReply, Message, Refusal
from sidecar.timelines import TimelineHistory
from sidecar.consensus.degraded import DegradedCarry, describe
from sidecar.consensus.messages import NO_DEGRADED, DegradedRange
from sidecar.consensus.proposer import (
    Action, CloseDegraded, DropPeer, ElectionWon, FetchWal, GateRefused, GreetingsRefused, LineageEnded, Phase,
    Proposer, ProposerConfig, ProposerEvent, ReportStatus, Send, StartStreaming, StoreDegraded, TermLost,
    TermsExhausted, VerifyPrimary,
)
from sidecar.linkauth import Security
from sidecar.lsn import format_lsn, segment_start
from sidecar.pgrepl import timeline_of
from sidecar.logs import get_logger
from sidecar.proposer import pgerrors, primary
from sidecar.proposer.actions import exhausted_text, log_event, log_fields, refused_text
from sidecar.proposer import replication as repl
from sidecar.archivedwal import ArchiveError
from sidecar.consensus.commitwait import SyncRepWaiters, TerminateAfter
from sidecar.proposer.catchup import ArchiveReader, DamagedArchiveSegment, DonorReader, PrimaryReader, reader_address
from sidecar.proposer.options import StartOptions
from sidecar.proposer.peers import PeerLink
from sidecar.proposer.view import PeerView, ProposerObserver
from sidecar.wal.format import WalFormatError
from sidecar.walclient import ReaderError

ELECTION_TIMEOUT = 5.0
HEARTBEAT_INTERVAL = 1.0
CATCHUP_SLOT_INTERVAL = 5.0
COMMIT_WAIT_POLL = 1.0  # how often terminate-after looks at the SyncRep waiters: its precision
RECONNECT_MIN, RECONNECT_MAX = 0.5, 5.0
BROKER_RETRY = 1.0  # seconds between tries of a degraded range's broker write that etcd did not answer
# The walsender's "requested WAL segment ... has already been removed": the primary's pg_wal lacks it.
WAL_REMOVED = "58P01"
PERMANENT_TRIES = 3  # a wrong password or a missing database: tries before giving up (in case it was being set up)
# When the primary's timeline ends, the term waits this long for the quorum to commit the old timeline's WAL
# up to the switch point before it ends (see _stream).
TIMELINE_END_COMMIT_WAIT = 10.0


class SafekeeperLink(Protocol):
    """A safekeeper link as the service drives it (`PeerLink`; a fake in tests)."""

    name: str
    reconnects: int

    @property
    def connected(self) -> bool: ...

    def send(self, msg: Message) -> None: ...

    def drop(self, faulted: bool = False) -> None: ...

    def buffered(self) -> int: ...

    async def drain(self) -> None: ...

    async def run(self) -> None: ...


LinkFactory = Callable[[str, Callable[[str], None], Callable[[str, Message], None], Callable[[str], None],
                        Security], SafekeeperLink]


class HeldLock(Protocol):
    async def verify(self) -> bool: ...


class PrimaryMismatch(Exception):
    """The primary lacks WAL that a quorum of safekeepers committed."""


class SafekeepersRefused(PrimaryMismatch):
    """Too many safekeepers refuse this primary's greeting (another cluster, ...) for a quorum."""


class LineageFenced(PrimaryMismatch):
    """A failover ended this primary's timeline: it must never stream again (its commits stay unacknowledged)."""


class ProposerStopped(PrimaryMismatch):
    """Going on cannot help: no term is left to campaign in, or we cannot encode our own message."""


class ProposerService:
    """Runs terms of the core against the primary and the safekeepers; publishes a `ProposerView`."""

    def __init__(self, options: StartOptions, *, link_factory: LinkFactory = PeerLink,
                 replication: repl.ReplicationClient | None = None) -> None:
        self.options = options
        self.log = get_logger(role="proposer")
        self.core: Proposer | None = None
        self.links: dict[str, SafekeeperLink] = {
            name: link_factory(name, self._peer_up, self._peer_message, self._peer_down, options.ssl_context)
            for name in options.safekeepers}
        self.replication = replication if replication is not None else repl.ReplicationClient(options.pg_dsn)
        self.reader = PrimaryReader(self.replication, options.application_name)
        # WAL the primary no longer has comes from a safekeeper of the term, over its reader port.
        self.peer_reader = DonorReader(options.reader_credentials) if options.reader_credentials else None
        self._donor: str | None = None
        # What every safekeeper removed comes from the archive they upload to (start --archive).
        self.archive = ArchiveReader(*options.archive) if options.archive else None
        self.observers: list[ProposerObserver] = []
        self._primary = primary.PrimarySnapshot()
        self.stream: repl.ReplicationStream | None = None
        self._term_over: asyncio.Event = asyncio.Event()
        self._commit_moved: asyncio.Event = asyncio.Event()  # set at each ReportStatus
        self._tasks: set[asyncio.Task[None]] = set()
        self._fetches: dict[str, asyncio.Task[None]] = {}
        self._replication_conn: psycopg.AsyncConnection | None = None
        self._timeline = 0
        self._history: TimelineHistory = ()  # the primary's timeline switches, from TIMELINE_HISTORY
        self._refusal: PrimaryMismatch | None = None
        self._reported_flush = 0  # the flush last handed to a stream for the primary (0: none yet)
        self._seg_size = 0
        self._pending: list[memoryview] = []
        self._pending_lsn = 0
        self._pg_version = 0
        self.last_term = 0
        self._reached = -1  # safekeepers streaming when _say_reach last spoke
        self._refusals: dict[str, int] = {}  # refusals in a row, by safekeeper
        self._waits = SyncRepWaiters()
        cw = options.commit_wait
        self._terminate = TerminateAfter(cw.after) if cw.policy == "terminate" else None
        # degrade-after (consensus/degraded.py): the broker holding the ranges, the range the next term must close,
        # whether the broker was read since start (no degrading before: a dead sidecar's range may be open), and
        # the broker writes in the order the cores asked for them.
        self._degrade_after = cw.after if cw.policy == "degrade" else 0.0
        self._broker = None
        self._cluster = ""
        if self._degrade_after and options.broker is not None:
            from sidecar.broker import Broker
            endpoints, self._cluster, certs = options.broker
            self._broker = Broker(endpoints, certs)
        self._carry: DegradedCarry | None = None
        self._broker_read = False
        self._closing: set[DegradedRange] = set()  # ranges our cores closed: one still in etcd is being deleted
        self._broker_ops: asyncio.Queue[tuple[StoreDegraded | CloseDegraded, Proposer]] = asyncio.Queue()

    def subscribe(self, observer: ProposerObserver) -> None:
        """Call `observer`'s hooks from now on, and run it alongside the service."""
        self.observers.append(observer)

    # ---- the published view (see view.ProposerView) --------------------------------------------

    @property
    def term(self) -> int:
        core = self.core
        return core.term if core is not None and core.term else self.last_term

    @property
    def phase(self) -> Phase | None:
        return self.core.phase if self.core is not None else None

    @property
    def term_start(self) -> int:
        return self.core.term_start if self.core is not None else 0

    @property
    def commit_lsn(self) -> int:
        return self.core.commit_lsn if self.core is not None else 0

    @property
    def primary_poll(self) -> primary.PrimarySnapshot:
        return self._primary

    @property
    def degraded(self) -> DegradedRange:
        """The open degraded range: this term's, or one it must close (NO_DEGRADED: none)."""
        core = self.core
        if core is not None and core.degraded:
            return core.degraded
        carry = core.carried if core is not None else self._carry
        return carry.record if carry is not None else NO_DEGRADED

    @property
    def degraded_acknowledging(self) -> bool:
        """Whether commits are acknowledged above the quorum now (the range is recorded everywhere)."""
        return self.core is not None and self.core.degraded_confirmed

    @property
    def has_quorum(self) -> bool:
        """Whether a quorum of safekeepers is elected in a streaming term: only then can the reported flush move."""
        core = self.core
        return (core is not None and core.phase is Phase.STREAMING
                and sum(p.elected for p in core.peers.values()) >= self.options.quorum)

    def peer(self, name: str) -> PeerView | None:
        link = self.links.get(name)
        if link is None:
            return None
        p = self.core.peers.get(name) if self.core is not None else None
        if p is None:
            return PeerView(name, link.connected, link.reconnects)
        return PeerView(name, link.connected, link.reconnects, p.node_id, p.greeted_term, p.elected,
                        p.flush_lsn, p.fetching)

    def peers(self) -> list[PeerView]:
        return [self.peer(name) for name in self.links]  # type: ignore[misc]

    # ---- lifecycle -----------------------------------------------------------------------

    async def run(self) -> None:
        """Attach to the primary and run terms until cancelled; reattach after losing it."""
        background = [self._spawn(link.run()) for link in self.links.values()]
        background += [self._spawn(o.run()) for o in self.observers]
        try:
            async with primary.sql_pool(self.options.pg_dsn, self.options.application_name) as pool:
                poller = self._spawn(primary.PrimaryPoller(
                    pool, self.options.application_name, (self.options.slot, self.options.catchup_slot),
                    self._primary).run())
                if self._terminate is not None:
                    background.append(self._spawn(self._enforce_commit_wait(pool, self._terminate)))
                if self._broker is not None:
                    self.log.warning("commit-wait degrade-after is on: after the wait without a quorum, commits are "
                                     "acknowledged by the safekeepers that are up, in a range recorded in etcd first; "
                                     "failovers refuse while one is open", after_seconds=self._degrade_after,
                                     cluster=self._cluster, broker=",".join(self._broker.endpoints))
                    background.append(self._spawn(self._broker_writes()))
                try:
                    while True:  # each attachment ends when the advisory lock is lost
                        async for attempt in AsyncRetrying(
                                retry=retry_if_exception_type((psycopg.OperationalError, OSError)),
                                stop=_gives_up, reraise=True,
                                wait=wait_exponential(multiplier=RECONNECT_MIN, max=RECONNECT_MAX),
                                before_sleep=self._unreachable):
                            with attempt:
                                await self._attached(pool)
                except psycopg.Error as e:
                    fix = pgerrors.permanent(e)
                    if fix is None:
                        raise
                    raise primary.PrimaryConfigError(f"the primary refuses walsidecar: {pgerrors.first_line(e)}; "
                                                      f"{fix}") from None
                finally:
                    poller.cancel()  # before the pool closes under it
                    with contextlib.suppress(BaseException):
                        await poller
        finally:
            for t in background:
                t.cancel()
            await self.close()

    async def close(self) -> None:
        """End the current term and stop all background work."""
        await self._end_term()
        await self._cancel_all()

    def _unreachable(self, state: RetryCallState) -> None:
        e = state.outcome.exception() if state.outcome is not None else None
        retry_in = state.next_action.sleep if state.next_action is not None else 0.0
        if e is not None and pgerrors.permanent(e):
            self.log.error("the primary refuses walsidecar; retrying a few times before giving up",
                           attempts=state.attempt_number, of=PERMANENT_TRIES, error=pgerrors.first_line(e))
        else:
            self.log.warning("primary unreachable; retrying", retry_in=retry_in, error=str(e).strip())

    async def _attached(self, pool: AsyncConnectionPool) -> None:
        """One attachment to the primary: checks, the advisory lock, slots, then terms while the lock holds."""
        opts = self.options
        lock = primary.AdvisoryLock(opts.pg_dsn, opts.slot, application_name=opts.application_name)
        try:
            # The lock's own session first: if the primary is away, its error says why.
            await lock.connect()
            async with pool.connection() as sql:
                for warning in await primary.check_settings(sql, opts.application_name):
                    self.log.warning(warning)
            await lock.acquire(wait=True)
            async with pool.connection() as sql:
                info = await primary.read_primary_info(sql)
                await primary.ensure_slot(sql, opts.slot)
                await primary.ensure_slot(sql, opts.catchup_slot)
            keeper = self._spawn(self._advance_catchup_slot(pool))
            try:
                await self.stream_terms(lock, info)
            except LineageFenced:
                # No term will ever acknowledge these commits: their clients would hang until
                # someone stops this primary. Before exiting, end each wait with an error.
                await self._end_waits_for_good(pool)
                raise
            finally:
                keeper.cancel()
        finally:
            await lock.close()

    async def stream_terms(self, lock: HeldLock, info: primary.PrimaryInfo) -> None:
        """Run terms, one replication stream each, while `lock` holds; raise PrimaryMismatch to stop."""
        self._seg_size, self._pg_version = info.wal_seg_size, info.pg_version
        # A primary restart drops the lock's session: stop and take the lock again before the
        # next term, so that a second sidecar cannot slip in between.
        refused = 0  # terms in a row whose replication connection the primary refused for good
        while await lock.verify():
            try:
                await self._one_term()
                refused = 0
            except PrimaryMismatch:
                raise
            except (psycopg.Error, OSError, repl.ReplicationError) as e:
                fix = pgerrors.permanent(e)
                refused = refused + 1 if fix else 0
                if refused >= PERMANENT_TRIES:
                    raise primary.PrimaryConfigError(f"the primary refuses the replication connection: "
                                                      f"{pgerrors.first_line(e)}; {fix}") from None
                self.log.warning("term ended", term=self.last_term, error=str(e).strip())
            await self._end_term()
            await asyncio.sleep(0.5)
        self.log.warning("lost the advisory lock on the primary; reconnecting")

    async def _one_term(self) -> None:
        opts = self.options
        conn = await self.replication.connect(opts.application_name)
        self._replication_conn = conn
        system_id, timeline, primary_flush = await self.replication.identify_system(conn)
        if self._broker is not None and self._carry is None:
            await self._read_open_range(primary_flush)
        slot = await self.replication.read_slot(conn, opts.slot)
        if slot is None:
            raise repl.ReplicationError(f"replication slot {opts.slot} disappeared")
        self._timeline = timeline
        # Every safekeeper learns the primary's lineage with Elected, to lay its WAL out as this pg_wal.
        self._history = await self.replication.timeline_history(conn, timeline) if timeline > 1 else ()
        cfg = ProposerConfig(
            proposer_id=opts.application_name, peers=opts.safekeepers, quorum=opts.quorum,
            system_id=system_id, timeline=timeline, timeline_history=self._history, wal_seg_size=self._seg_size,
            pg_version=self._pg_version, bootstrap_lsn=segment_start(slot[0], self._seg_size),
            buffer_limit=opts.wal_buffer_bytes, max_inflight=max(opts.wal_buffer_bytes // 2, 1 << 20),
            degrade_after=self._degrade_after if self._broker_read else 0.0, carried=self._carry)
        self._term_over = asyncio.Event()
        self.core = Proposer(cfg, min_term=self.last_term)
        self._reached = -1
        for name, link in self.links.items():
            if link.connected:
                self._run(self.core.peer_connected(name))
        self._spawn(self._ticker())
        await self._term_over.wait()
        if self._refusal is not None:
            raise self._refusal

    async def _end_term(self) -> None:
        self._pending.clear()
        if self.core is not None:
            self.last_term = max(self.last_term, self.core.term)
            self._run(self.core.stream_ended())
            self._carry = self.core.open_range()
            self.core = None  # links reconnecting now must wait for the next term's core
        for task in self._fetches.values():
            task.cancel()
        self._fetches.clear()
        if self.stream is not None:
            await self.stream.close()
            self.stream = None
        if self._replication_conn is not None:
            with contextlib.suppress(Exception):
                await self._replication_conn.close()
            self._replication_conn = None
        # Safekeepers still attached to the old term must greet the next one afresh.
        for link in self.links.values():
            link.drop()

    async def _ticker(self) -> None:
        core = self.core
        ticks = 0
        while core is self.core and not self._term_over.is_set():
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            ticks += 1
            self._run(core.heartbeat())
            if self._degrade_after:
                self._run(core.tick(time.monotonic()))
            if ticks % int(ELECTION_TIMEOUT / HEARTBEAT_INTERVAL) == 0:
                self._run(core.election_timeout())

    # ---- degrade-after: the broker's record of the open range ------------------------------------

    async def _read_open_range(self, primary_flush: int) -> None:
        """At each term's start with no range to close: a range a dead sidecar left open (a write of it may land
        after it died) is closed once our quorum holds the primary's WAL up to its flush now, at or above anything
        that sidecar acknowledged. Until the broker first answers, no degrading."""
        from sidecar.broker import BrokerError
        assert self._broker is not None
        try:
            await self._broker.mark_degrade_after(self._cluster)
            record = await self._broker.read_degraded(self._cluster)
        except BrokerError as e:
            self.log.error("cannot read the degraded range from etcd: " + ("" if self._broker_read else
                           "not degrading until it answers ") + "(tried again at the next term)", error=str(e),
                           cluster=self._cluster)
            return
        self._broker_read = True
        if record and self._carry is None and record not in self._closing:
            self._carry = DegradedCarry(record, primary_flush)
            self.log.warning("an earlier sidecar left a degraded range open; it closes once a quorum holds the "
                             "primary's WAL up to its flush now", range=describe(record),
                             close_at_lsn=format_lsn(primary_flush), cluster=self._cluster)

    async def _broker_writes(self) -> None:
        """Carry out the cores' range writes in order; an unanswered one is tried again until etcd answers."""
        from sidecar.broker import BrokerError
        assert self._broker is not None
        while True:
            a, core = await self._broker_ops.get()
            while True:
                try:
                    if isinstance(a, StoreDegraded):
                        done = await self._broker.store_degraded(self._cluster, a.record, a.previous)
                    else:
                        done = await self._broker.close_degraded(self._cluster, a.record)
                    break
                except BrokerError as e:
                    self.log.error("etcd did not take the degraded range; trying again (no acknowledgement above "
                                   "the quorum meanwhile)", error=str(e), range=describe(a.record))
                    await asyncio.sleep(BROKER_RETRY)
            what = "recorded" if isinstance(a, StoreDegraded) else "closed"
            if not done:
                self.log.error(f"degraded range not {what}: etcd holds another (a failover, or another sidecar, "
                               "changed it); acknowledging only with the quorum", range=describe(a.record),
                               cluster=self._cluster)
                continue
            self.log.warning(f"degraded range {what} in etcd", range=describe(a.record), term=a.record.term,
                             start_lsn=format_lsn(a.record.start_lsn), version=a.record.version,
                             members=sorted(a.record.members), cluster=self._cluster)
            if isinstance(a, StoreDegraded) and core is self.core:
                self._run(core.degraded_stored(a.record.version))

    async def _advance_catchup_slot(self, pool: AsyncConnectionPool) -> None:
        """Keep the catch-up slot at the WAL every safekeeper has, but no more than --primary-retention
        below the commit position: a safekeeper further behind catches up from a peer's reader port."""
        while True:
            await asyncio.sleep(CATCHUP_SLOT_INTERVAL)
            core = self.core
            if core is None or core.commit_lsn == 0:
                continue
            commit, retention = core.commit_lsn, self.options.primary_retention
            everywhere = min(core.status()[2], commit)
            if retention is not None:
                everywhere = max(everywhere, commit - retention)
            if everywhere:
                with contextlib.suppress(psycopg.Error):
                    async with pool.connection() as sql:
                        await primary.advance_slot(sql, self.options.catchup_slot, everywhere)

    # ---- commits waiting in SyncRep (--commit-wait, and a fenced-out primary) -------------------

    async def _enforce_commit_wait(self, pool: AsyncConnectionPool, policy: TerminateAfter) -> None:
        """terminate-after=T: every COMMIT_WAIT_POLL, end the waits that lasted T without a quorum."""
        failed = False
        while True:
            await asyncio.sleep(COMMIT_WAIT_POLL)
            try:
                async with pool.connection() as sql:
                    waiting = {w.key: w for w in await primary.read_syncrep_waiters(sql)}
                    now = time.monotonic()
                    quorum = self.has_quorum
                    due = policy.decide(now, self._waits.observe(now, waiting), quorum)
                    for w in due:
                        await self._terminate_waiter(sql, waiting[w.key], "no-quorum", waited=now - w.since,
                                                     without_quorum=now - (policy.no_quorum_since or now))
                failed = False
            except Exception as e:
                # Any failure: ending waits must never stop the proposer, and the next look may work.
                if not failed:
                    self.log.warning("cannot look at the commits waiting in SyncRep; trying again",
                                     error=pgerrors.first_line(e),
                                     commit_wait=str(self.options.commit_wait))
                failed = True

    async def _end_waits_for_good(self, pool: AsyncConnectionPool) -> None:
        """A failover ended this primary's timeline: terminate every commit waiting in SyncRep, once."""
        try:
            async with pool.connection() as sql:
                waiting = await primary.read_syncrep_waiters(sql)
                ended = 0
                for w in waiting:
                    ended += await self._terminate_waiter(sql, w, "lineage-ended")
        except (psycopg.Error, OSError, PoolTimeout) as e:
            self.log.critical("cannot terminate the commits waiting in SyncRep on this fenced-out primary: their "
                              "clients keep waiting until it is stopped", term=self.term,
                              error=pgerrors.first_line(e))
            return
        self.log.critical(f"terminated {ended} of {len(waiting)} commits waiting in SyncRep on this fenced-out "
                          "primary: their clients get an error, never an acknowledgement; commits that start "
                          "now wait until it is stopped and rejoined as a standby", term=self.term,
                          terminated=ended, waiting=len(waiting), reported_flush_lsn=format_lsn(self._reported_flush))

    async def _terminate_waiter(self, sql: psycopg.AsyncConnection, w: primary.SyncRepWaiter, reason: str,
                                **seconds: float) -> bool:
        """pg_terminate_backend one waiter (never a cancel: that tells the client its commit succeeded)."""
        # Which LSN a backend waits for is not visible in SQL: its commit record lies above the flush
        # this sidecar reported (when it streamed) and at or below the primary's flush when it was seen;
        # pg_xact_status(xid) tells the transaction's outcome later.
        fields = dict(pid=w.key.pid, xid=w.xid, user=w.user, application_name=w.application_name,
                      client_addr=w.client_addr, term=self.term, reason=reason,
                      commit_lsn_above=format_lsn(self._reported_flush) if self._reported_flush else None,
                      commit_lsn_at_most=format_lsn(w.flush_lsn),
                      **{f"{k}_seconds": round(v, 1) for k, v in seconds.items()})
        try:
            done = await primary.terminate_waiter(sql, w.key)
        except psycopg.Error as e:
            self.log.error("cannot terminate a commit waiting in SyncRep; give the sidecar's role pg_signal_backend "
                           "(a superuser's backend needs a superuser)", error=pgerrors.first_line(e), **fields)
            return False
        if done:
            counts = self._primary.commits_terminated
            counts[reason] = counts.get(reason, 0) + 1
            self.log.error("terminated a backend waiting in SyncRep: its client gets an error, not an "
                           "acknowledgement; the transaction is in the primary's WAL and its outcome unknown "
                           "to the client", **fields)
        return done

    # ---- safekeeper links ------------------------------------------------------------------

    def _peer_up(self, name: str) -> None:
        if self.core is not None:
            self._run(self.core.peer_connected(name))

    def _peer_message(self, name: str, msg: Message) -> None:
        for o in self.observers:
            o.peer_contact(name)
        if isinstance(msg, Refusal):
            # Said at the 1st, 2nd, 4th, 8th... refusal in a row: the link reconnects after a growing pause.
            n = self._refusals[name] = self._refusals.get(name, 0) + 1
            if n & (n - 1) == 0:
                self.log.error("safekeeper refused us and closed the connection", peer=name, reason=msg.reason,
                               refusals=n)
        elif not isinstance(msg, GreetingReply):  # greeted, then refused (not voting yet): still in a row
            self._refusals.pop(name, None)
        if self.core is not None:
            self._run(self.core.peer_message(name, msg))

    def _peer_down(self, name: str) -> None:
        task = self._fetches.pop(name, None)
        if task is not None:
            task.cancel()
        if self.core is not None:
            self._run(self.core.peer_disconnected(name))

    # ---- actions ---------------------------------------------------------------------------

    def _run(self, actions: list[Action]) -> None:
        self._act(actions)
        self._say_reach()

    def _say_reach(self) -> None:
        """Once streaming, say how many safekeepers take the WAL and how many more may fail; again on change."""
        core = self.core
        if core is None or core.phase is not Phase.STREAMING:
            return
        reached = sum(p.greeted_term is not None for p in core.peers.values())
        if reached == self._reached:
            return
        self._reached = reached
        spare = reached - self.options.quorum
        say = self.log.info if spare > 0 else self.log.warning
        now = (f"can tolerate {spare} more failure{'s' if spare > 1 else ''}" if spare > 0 else
               "can tolerate no failure: one more stops commits" if spare == 0 else "commits wait for a quorum")
        say(f"streaming to {reached} of {len(self.links)} safekeepers, quorum {self.options.quorum}: {now}",
            term=core.term, reached=reached, safekeepers=len(self.links), quorum=self.options.quorum,
            can_tolerate=max(spare, 0))

    def _act(self, actions: list[Action]) -> None:
        for a in actions:
            match a:
                case Send():
                    try:
                        self.links[a.peer].send(a.message)
                    except codec.EncodeError as e:
                        self._cannot_encode(e, a.peer)
                        return
                case ReportStatus():
                    self._report(a)
                case StartStreaming():
                    self._spawn(self._stream(a.start_lsn))
                case VerifyPrimary():
                    self._spawn(self._verify(a))
                case FetchWal():
                    self._fetches[a.peer] = self._spawn(self._fetch(a))
                case TermLost():
                    self.log.warning("term lost", term=self.core.term if self.core else 0,
                                     higher_term=a.term, reason=a.reason)
                    self.last_term = max(self.last_term, a.term)
                    for o in self.observers:
                        o.term_lost()
                    self._term_over.set()
                case LineageEnded():
                    self.log.critical("a failover ended this primary's timeline: it must not take commits again",
                                      term=a.term, fence_term=a.fence.term, fenced_timeline=a.fence.timeline,
                                      fence_lsn=format_lsn(a.fence.lsn), reason=a.reason)
                    self._fatal(LineageFenced(a.reason))
                case GreetingsRefused():
                    self._fatal(SafekeepersRefused(refused_text(
                        a, len(self.links), self.options.quorum,
                        "point the sidecar at the safekeepers of this primary's cluster")))
                    self.log.critical("safekeepers refuse this primary", reason=str(self._refusal))
                case DropPeer():
                    self.log.error("safekeeper broke the protocol; dropping the link", peer=a.peer,
                                   reason=a.reason, **log_fields(a.fields))
                    self.links[a.peer].drop(faulted=True)
                case StoreDegraded() | CloseDegraded():
                    if self._broker is not None and self.core is not None:
                        if isinstance(a, CloseDegraded):
                            self._closing.add(a.record)
                        self._broker_ops.put_nowait((a, self.core))
                case GateRefused():
                    pass  # only a failover's term has a gate
                case TermsExhausted():
                    self._fatal(ProposerStopped(exhausted_text(a, limits.MAX_TERM)))
                    self.log.critical("no term left to campaign in", term=a.term, peer=a.peer,
                                      max_term=limits.MAX_TERM)
                case ProposerEvent():
                    if isinstance(a, ElectionWon):
                        self._donor = a.donor
                    for o in self.observers:
                        o.event(a)
                    log_event(self.log, a)

    def _report(self, a: ReportStatus) -> None:
        self._commit_moved.set()
        for o in self.observers:
            o.committed(a.flush_lsn)
        if self.stream is None:
            return
        # When it goes to the primary is the stream's status schedule (consensus/statusschedule.py).
        self._hand_status(self.stream, a.write_lsn, a.flush_lsn, a.apply_lsn)

    def _hand_status(self, stream: repl.ReplicationStream, write: int, flush: int, apply: int) -> None:
        try:
            stream.report(write, flush, apply)
            self._reported_flush = flush  # a flush move goes out at once: what the waiters' commits lie above
        except ValueError as e:
            # The stream refuses a flush it never sent or one going backwards: never tell the
            # primary that. It means a bug; end the term rather than report it.
            self.log.critical("refusing to report an impossible position", error=str(e), flush_lsn=format_lsn(flush))
            self._term_over.set()

    async def _stream(self, start_lsn: int) -> None:
        core, conn = self.core, self._replication_conn
        assert core is not None and conn is not None
        # The timeline that holds the term start: a promoted standby serves WAL below its switch point
        # on its old timeline, which ends there (TimelineEnded: the next term starts on the new one).
        timeline = timeline_of(self._history, self._timeline, start_lsn)
        stream = self.replication.stream(conn, start_lsn=start_lsn, timeline=timeline,
                                         slot=self.options.slot, on_wal=self._on_wal,
                                         on_batch_end=self._on_batch_end)
        self.stream = stream
        try:
            await stream.start()
            self._hand_status(stream, *core.status())
            await stream.wait_closed()
            self.log.warning("replication stream ended", term=core.term)
        except repl.TimelineEnded as e:
            # The WAL up to the switch point is the old timeline's last. The next term starts at its donor's
            # flush: unless that WAL is on a quorum first, every next term starts below the switch again,
            # streams the old timeline again and ends again, before its Appends are acknowledged.
            self.stream = None
            self._on_batch_end()
            committed = await self._committed(core, e.next_lsn, TIMELINE_END_COMMIT_WAIT)
            self.log.warning("the primary's timeline ended; starting a new term", term=core.term,
                             next_timeline=e.next_tli, switch_lsn=format_lsn(e.next_lsn),
                             commit_lsn=format_lsn(core.commit_lsn), committed_to_the_switch=committed)
        except repl.ReplicationError as e:
            if e.sqlstate == WAL_REMOVED and core is self.core:
                self.log.critical("refusing to stream", term=core.term, reason=str(e))
                self._fatal(PrimaryMismatch(
                    f"the primary no longer holds its WAL from the term start {format_lsn(start_lsn)} on timeline "
                    f"{timeline} ({e}): the safekeepers cannot receive the WAL that follows their committed "
                    "WAL; copy that WAL back into its pg_wal (walsidecar restore-wal fetches it from the "
                    "safekeepers), then start the sidecar again"))
            else:
                self.log.warning("replication stream failed", term=core.term, error=str(e).strip())
        except (psycopg.Error, OSError) as e:
            self.log.warning("replication stream failed", term=core.term, error=str(e).strip())
        except Exception:
            self.log.exception("replication stream failed unexpectedly", term=core.term)
        finally:
            if core is self.core:
                self._term_over.set()

    async def _committed(self, core: Proposer, lsn: int, timeout: float) -> bool:
        """Wait until `core`'s quorum commit reaches `lsn`, at most `timeout`; False if its term ended first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while core is self.core and not self._term_over.is_set() and core.commit_lsn < lsn:
            self._commit_moved.clear()
            try:
                await asyncio.wait_for(self._commit_moved.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        return core.commit_lsn >= lsn

    def _on_wal(self, lsn: int, data: memoryview) -> None:
        if not self._pending:
            self._pending_lsn = lsn
        self._pending.append(data)

    def _on_batch_end(self) -> None:
        """Fan out everything drained from the socket at once: OLTP messages are small."""
        if self._pending and self.core is not None:
            data = b"".join(self._pending)
            self._pending.clear()
            for o in self.observers:
                o.wal_received(self._pending_lsn + len(data), len(data))
            self._run(self.core.wal_received(self._pending_lsn, data))

    async def _verify(self, a: VerifyPrimary) -> None:
        core = self.core
        try:
            await self._check_primary(a)
        except PrimaryMismatch as e:
            if not self.options.allow_primary_mismatch:
                self.log.critical("refusing to stream", term=a.term, reason=str(e))
                if core is self.core and core is not None:
                    self._run(core.primary_refused(str(e)))
                self._fatal(e)
                return
            self.log.critical("primary lacks quorum-committed WAL; streaming anyway as ordered "
                              "by --allow-primary-mismatch", term=a.term, reason=str(e))
        if core is self.core and core is not None:
            self._run(core.primary_verified())

    async def _check_primary(self, a: VerifyPrimary) -> None:
        """The primary must hold the donor's WAL up to the term start, byte for byte."""
        conn = self._replication_conn
        assert conn is not None
        _, timeline, flush = await self.replication.identify_system(conn)
        history = await self.replication.timeline_history(conn, timeline)
        problem = primary_check.lineage_mismatch(a, flush, history)
        if problem is None and a.tail_lsn:
            try:
                tail = await self.reader.read(a.tail_lsn, a.start_lsn, timeline, history)
            except repl.ReplicationError as e:
                if e.sqlstate != WAL_REMOVED:
                    raise
                raise PrimaryMismatch(primary_check.tail_removed(a, str(e))) from None
            problem = primary_check.tail_mismatch(a, google_crc32c.value(tail))
        if problem is not None:
            raise PrimaryMismatch(problem)

    async def _fetch(self, a: FetchWal) -> None:
        """Catch a lagging safekeeper up: from the primary's pg_wal, else a peer's reader port or the archive."""
        core, link = self.core, self.links[a.peer]
        assert core is not None
        self.log.info("catching up safekeeper", peer=a.peer, term=core.term,
                      start_lsn=format_lsn(a.start), end_lsn=format_lsn(a.end))

        def sink(lsn: int, data: bytes | memoryview) -> None:
            self._run(core.catchup_data(a.peer, lsn, data))

        try:
            try:
                await self.reader.copy(a.start, a.end, self._timeline, sink, link, self._history)
            except (repl.ReplicationError, psycopg.Error, OSError) as e:
                # The primary recycled it (or lost it): a safekeeper of the term has it up to its flush,
                # the archive what they all removed.
                await self._copy_elsewhere(a, sink, e)
        except DamagedArchiveSegment as e:
            # Reading it again gives the same bytes: dropping the link would reconnect and fail here again, for
            # ever. The link stays up and the safekeeper waits, not caught up, until it reconnects (a restart of
            # it or of the proposer, or a new term), by when an operator may have replaced the object.
            self.log.error("catch-up stopped: a segment in the archive fails the WAL checks; not retried until "
                           "the safekeeper reconnects", peer=a.peer, segment=e.name, lsn=format_lsn(e.lsn),
                           archive=self.archive.url if self.archive else None, term=core.term, reason=e.why)
            return
        except (repl.ReplicationError, psycopg.Error, OSError, ReaderError, ArchiveError, WalFormatError) as e:
            self.log.error("catch-up failed; will retry after reconnect", peer=a.peer, error=str(e).strip())
            link.drop()
            return
        finally:
            self._fetches.pop(a.peer, None)
        if core is self.core:
            self._run(core.catchup_done(a.peer))

    async def _copy_elsewhere(self, a: FetchWal, sink: Callable[[int, bytes], None], why: Exception) -> None:
        """What `a.peer` still needs, from a peer's reader port; what no peer holds any more, from the archive."""
        core = self.core
        assert core is not None
        while (pos := core.peers[a.peer].sent_lsn) < a.end:  # what was delivered before a source failed stays sent
            source = self._catchup_source(a)
            if source is not None:
                self.log.warning("the primary cannot serve the WAL; catching up from a safekeeper's reader port",
                                 peer=a.peer, source=source, term=core.term, start_lsn=format_lsn(pos),
                                 end_lsn=format_lsn(a.end), error=pgerrors.first_line(why))
                try:
                    await self._copy_from_peer(source, a, sink)
                    return
                except (ReaderError, repl.ReplicationError, OSError) as e:
                    why = e
            if self.archive is None:
                raise why
            self.log.warning("catching up from the archive", peer=a.peer, archive=self.archive.url,
                             term=core.term, start_lsn=format_lsn(pos), end_lsn=format_lsn(a.end),
                             error=pgerrors.first_line(why))
            got = await self.archive.copy(pos, a.end, core.config.system_id, self._timeline, self._history,
                                          self._seg_size, sink, self.links[a.peer])
            if got == pos:
                raise ArchiveError(f"the archive {self.archive.url} lacks the segment at {format_lsn(pos)} "
                                   f"too; {pgerrors.first_line(why)}")
            self.log.info("caught up from the archive", peer=a.peer, term=core.term, start_lsn=format_lsn(pos),
                          end_lsn=format_lsn(got))

    def _catchup_source(self, a: FetchWal) -> str | None:
        """A safekeeper of this term holding [a.start, a.end) with a reader port: the donor first."""
        core = self.core
        if self.peer_reader is None or core is None:
            return None
        held = [n for n, p in core.peers.items()
                if n != a.peer and p.elected and p.flush_lsn >= a.end and p.reader_port]
        return self._donor if self._donor in held else (held[0] if held else None)

    async def _copy_from_peer(self, source: str, a: FetchWal, sink: Callable[[int, bytes], None]) -> None:
        """Copy what `a.peer` still needs from `source`'s reader port, in our term (up to its flush)."""
        core = self.core
        assert core is not None and self.peer_reader is not None
        await self.peer_reader.copy(reader_address(source, core.peers[source].reader_port),
                                    core.peers[a.peer].sent_lsn, a.end, core.term, sink, self.links[a.peer])

    # ---- plumbing --------------------------------------------------------------------------

    def _fatal(self, e: PrimaryMismatch) -> None:
        self._refusal = e
        self._term_over.set()

    def _cannot_encode(self, e: codec.EncodeError, peer: str | None = None) -> None:
        """Our own message does not fit the wire: a bug that another term would only repeat."""
        self.log.critical("cannot encode a message; stopping", peer=peer, error=str(e))
        self._fatal(ProposerStopped(f"the proposer cannot encode its own message ({e}); this is a bug, "
                                    "please report it with the log"))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        e = task.exception()
        if isinstance(e, codec.EncodeError):
            self._cannot_encode(e)  # stop, rather than start a term that fails the same way
            return
        self.log.error("background task failed", error=repr(e))
        self._term_over.set()

    async def _cancel_all(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t


def _gives_up(state: RetryCallState) -> bool:
    """Stop retrying only what cannot heal, after PERMANENT_TRIES: network and restarts are retried forever."""
    e = state.outcome.exception() if state.outcome is not None else None
    return e is not None and pgerrors.permanent(e) is not None and state.attempt_number >= PERMANENT_TRIES

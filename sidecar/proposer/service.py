"""The proposer service: primary connections and safekeeper links around the consensus core."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import google_crc32c
import psycopg

from sidecar.consensus import codec, limits
from sidecar.consensus.messages import Message, Refusal, TimelineHistory
from sidecar.consensus.proposer import (
    Action, DropPeer, FetchWal, GreetingsRefused, Note, Proposer, ProposerConfig, ReportStatus, Send,
    StartStreaming, TermLost, TermsExhausted, VerifyPrimary, MAX_APPEND,
)
from sidecar.linkauth import Security
from sidecar.lsn import format_lsn, segment_start
from sidecar.logs import get_logger
from sidecar.proposer import primary as pg
from sidecar.proposer import replication as repl
from sidecar.proposer.monitor import ProposerMonitor
from sidecar.proposer.peers import PeerLink

ELECTION_TIMEOUT = 5.0
HEARTBEAT_INTERVAL = 1.0
HORIZON_INTERVAL = 5.0
RECONNECT_MIN, RECONNECT_MAX = 0.5, 5.0
CATCHUP_BACKLOG = 16 * 1024 * 1024  # bytes queued to one safekeeper before catch-up reading pauses
# How long a status that moves only write or apply may wait to be sent (see _report); commits
# with synchronous_commit = remote_write or remote_apply may wait this much longer.
STATUS_DELAY = 0.01


@dataclass(frozen=True)
class StartOptions:
    pg_dsn: str
    safekeepers: tuple[str, ...]
    quorum: int
    application_name: str = "walsidecar"
    slot: str = "walsidecar"
    allow_primary_mismatch: bool = False
    wal_buffer_bytes: int = 64 * 1024 * 1024
    # For the safekeeper links: TLS, or a linkauth.LinkAuth (--link-security auth-only); None: --insecure.
    ssl_context: Security = None

    @property
    def horizon_slot(self) -> str:
        return f"{self.slot}_horizon"


class PrimaryMismatch(Exception):
    """The primary lacks WAL that a quorum of safekeepers committed."""


class SafekeepersRefused(PrimaryMismatch):
    """Too many safekeepers refuse this primary's greeting (another cluster, ...) for a quorum."""


class ProposerStopped(PrimaryMismatch):
    """Going on cannot help: no term is left to campaign in, or we cannot encode our own message."""


class ProposerService:
    def __init__(self, opts: StartOptions, monitor: ProposerMonitor | None = None) -> None:
        self.opts = opts
        self.monitor = monitor if monitor is not None else ProposerMonitor()
        self.log = get_logger(role="proposer")
        self.core: Proposer | None = None
        self.links = {name: PeerLink(name, self._peer_up, self._peer_message, self._peer_down, opts.ssl_context)
                      for name in opts.safekeepers}
        self.stream: repl.ReplicationStream | None = None
        self._term_over: asyncio.Event = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._fetches: dict[str, asyncio.Task[None]] = {}
        self._replication_conn: psycopg.AsyncConnection | None = None
        self._timeline = 0
        self._refusal: PrimaryMismatch | None = None
        self._seg_size = 0
        self._pending: list[memoryview] = []
        self._status: tuple[repl.ReplicationStream, ReportStatus] | None = None  # latest, not yet sent
        self._status_handle: asyncio.Handle | None = None  # when it goes out
        self._status_urgent = False  # it moves flush: out at the end of this event loop pass
        self._sent_flush = 0  # flush of the last status sent to the current stream
        self._pending_lsn = 0
        self._pg_version = 0
        self.last_term = 0
        self.monitor.attach(self)

    # ---- lifecycle -----------------------------------------------------------------------

    async def run(self) -> None:
        """Attach to the primary and run terms until cancelled; reattach after losing it."""
        links = [self._spawn(link.run()) for link in self.links.values()]
        links.append(self._spawn(self.monitor.run()))
        delay = RECONNECT_MIN
        try:
            while True:
                try:
                    await self._attached()
                    delay = RECONNECT_MIN
                except (psycopg.OperationalError, OSError) as e:
                    self.log.warning("primary unreachable; retrying", retry_in=delay, error=str(e).strip())
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_MAX)
        finally:
            for t in links:
                t.cancel()
            await self._end_term()
            await self._cancel_all()

    async def _attached(self) -> None:
        """One session with the primary: checks, the advisory lock, slots, then terms while the lock holds."""
        async with await psycopg.AsyncConnection.connect(self.opts.pg_dsn, autocommit=True) as sql:
            for warning in await pg.check_settings(sql, self.opts.application_name):
                self.log.warning(warning)
            lock = pg.AdvisoryLock(self.opts.pg_dsn, self.opts.slot, application_name=self.opts.application_name)
            try:
                await lock.acquire(wait=True)
                info = await pg.read_primary_info(sql)
                self._seg_size, self._pg_version = info.wal_seg_size, info.pg_version
                await pg.ensure_slot(sql, self.opts.slot)
                await pg.ensure_slot(sql, self.opts.horizon_slot)
                horizon = self._spawn(self._horizon_loop(sql))
                try:
                    await self._terms(lock)
                finally:
                    horizon.cancel()
            finally:
                await lock.close()

    async def _terms(self, lock: pg.AdvisoryLock) -> None:
        # A primary restart drops the lock's session: stop and take the lock again before the
        # next term, so that a second sidecar cannot slip in between.
        while await lock.verify():
            try:
                await self._one_term()
            except PrimaryMismatch:
                raise
            except (psycopg.Error, OSError, repl.ReplicationError) as e:
                self.log.warning("term ended", term=self.last_term, error=str(e).strip())
            await self._end_term()
            await asyncio.sleep(0.5)
        self.log.warning("lost the advisory lock on the primary; reconnecting")

    async def _one_term(self) -> None:
        conn = await repl.connect_replication(self.opts.pg_dsn, self.opts.application_name)
        self._replication_conn = conn
        system_id, timeline, _ = await repl.identify_system(conn)
        slot = await repl.read_slot(conn, self.opts.slot)
        if slot is None:
            raise repl.ReplicationError(f"replication slot {self.opts.slot} disappeared")
        self._timeline = timeline
        cfg = ProposerConfig(
            proposer_id=self.opts.application_name, peers=self.opts.safekeepers, quorum=self.opts.quorum,
            system_id=system_id, timeline=timeline, wal_seg_size=self._seg_size,
            pg_version=self._pg_version, bootstrap_lsn=segment_start(slot[0], self._seg_size),
            buffer_limit=self.opts.wal_buffer_bytes, max_inflight=max(self.opts.wal_buffer_bytes // 2, 1 << 20))
        self._term_over = asyncio.Event()
        self.core = Proposer(cfg, min_term=self.last_term)
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
            if ticks % int(ELECTION_TIMEOUT / HEARTBEAT_INTERVAL) == 0:
                self._run(core.election_timeout())

    async def _horizon_loop(self, sql: psycopg.AsyncConnection) -> None:
        """Keep the horizon slot at the WAL every safekeeper has, so laggards can catch up."""
        while True:
            await asyncio.sleep(HORIZON_INTERVAL)
            core = self.core
            if core is None or core.commit_lsn == 0:
                continue
            horizon = min(core.status()[2], core.commit_lsn)
            if horizon:
                with contextlib.suppress(psycopg.Error):
                    await pg.advance_slot(sql, self.opts.horizon_slot, horizon)

    # ---- safekeeper links ------------------------------------------------------------------

    def _peer_up(self, name: str) -> None:
        if self.core is not None:
            self._run(self.core.peer_connected(name))

    def _peer_message(self, name: str, msg: Message) -> None:
        self.monitor.peer_contact(name)
        if isinstance(msg, Refusal):
            self.log.error("safekeeper refused us and closed the connection", peer=name, reason=msg.reason)
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
                    self.monitor.term_lost()
                    self._term_over.set()
                case GreetingsRefused():
                    reasons = "; ".join(f"safekeeper {peer}: {why}" for peer, why in sorted(a.reasons.items()))
                    self._fatal(SafekeepersRefused(
                        f"{len(a.reasons)} of {len(self.links)} safekeepers refuse this primary, so no quorum "
                        f"of {self.opts.quorum} can form ({reasons}); point the sidecar at the safekeepers of "
                        "this primary's cluster"))
                    self.log.critical("safekeepers refuse this primary", reason=str(self._refusal))
                case DropPeer():
                    self.log.error("safekeeper broke the protocol; dropping the link", peer=a.peer,
                                   reason=a.reason, **{k: _fmt(k, v) for k, v in a.fields.items()})
                    self.links[a.peer].drop(faulted=True)
                case TermsExhausted():
                    held = f"safekeeper {a.peer} holds term {a.term}" if a.peer else f"term {a.term} was reached"
                    self._fatal(ProposerStopped(
                        f"no term is left to campaign in: {held}, the highest term the protocol allows "
                        f"({limits.MAX_TERM}). Something that is not this proposer gave it that term (a bug, "
                        "or a client that can reach the safekeeper port); secure the safekeepers' ports, then "
                        "reset that safekeeper's data directory and let it re-sync"))
                    self.log.critical("no term left to campaign in", term=a.term, peer=a.peer,
                                      max_term=limits.MAX_TERM)
                case Note():
                    self.monitor.note(a.event, a.fields)
                    self.log.info(a.event, **{k: _fmt(k, v) for k, v in a.fields.items()})

    def _report(self, a: ReportStatus) -> None:
        self.monitor.committed(a.flush_lsn)
        if self.stream is None:
            return
        # Commits wait for flush: a status that moves it goes out right after this pass of the event
        # loop (replies from several safekeepers handled in it make one message). One that moves
        # only write or apply waits up to STATUS_DELAY for the next one that moves flush, which
        # spares the walsender a wake-up for every safekeeper's reply.
        self._status = (self.stream, a)
        loop = asyncio.get_running_loop()
        if a.flush_lsn != self._sent_flush:
            if not self._status_urgent:
                if self._status_handle is not None:
                    self._status_handle.cancel()
                self._status_handle = loop.call_soon(self._send_status)
                self._status_urgent = True
        elif self._status_handle is None:
            self._status_handle = loop.call_later(STATUS_DELAY, self._send_status)

    def _send_status(self) -> None:
        pending, self._status = self._status, None
        self._status_handle, self._status_urgent = None, False
        if pending is None or pending[0] is not self.stream:
            return  # the stream it was for has ended
        stream, a = pending
        try:
            stream.send_status(a.write_lsn, a.flush_lsn, a.apply_lsn)
            self._sent_flush = a.flush_lsn
        except ValueError as e:
            # The stream refuses a flush it never sent or one going backwards: never tell the
            # primary that. It means a bug; end the term rather than report it.
            self.log.critical("refusing to report an impossible position", error=str(e),
                              flush_lsn=format_lsn(a.flush_lsn))
            self._term_over.set()

    async def _stream(self, start_lsn: int) -> None:
        core, conn = self.core, self._replication_conn
        assert core is not None and conn is not None
        stream = repl.ReplicationStream(conn, start_lsn=start_lsn, timeline=self._timeline,
                                        slot=self.opts.slot, on_wal=self._on_wal,
                                        on_batch_end=self._on_batch_end)
        self.stream = stream
        try:
            await stream.start()
            status = core.status()
            stream.send_status(*status)
            self._sent_flush = status[1]
            await stream.wait_closed()
            self.log.warning("replication stream ended", term=core.term)
        except repl.TimelineEnded as e:
            self.log.warning("the primary's timeline ended; starting a new term", term=core.term,
                             next_timeline=e.next_tli, switch_lsn=format_lsn(e.next_lsn))
        except (repl.ReplicationError, psycopg.Error, OSError) as e:
            self.log.warning("replication stream failed", term=core.term, error=str(e).strip())
        except Exception:
            self.log.exception("replication stream failed unexpectedly", term=core.term)
        finally:
            if core is self.core:
                self._term_over.set()

    def _on_wal(self, lsn: int, data: memoryview) -> None:
        if not self._pending:
            self._pending_lsn = lsn
        self._pending.append(data)

    def _on_batch_end(self) -> None:
        """Fan out everything drained from the socket at once: OLTP messages are small."""
        if self._pending and self.core is not None:
            data = b"".join(self._pending)
            self._pending.clear()
            self.monitor.wal_received(self._pending_lsn + len(data), len(data))
            self._run(self.core.wal_received(self._pending_lsn, data))

    async def _verify(self, a: VerifyPrimary) -> None:
        core = self.core
        try:
            await self._check_primary(a)
        except PrimaryMismatch as e:
            if not self.opts.allow_primary_mismatch:
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
        _, timeline, flush = await repl.identify_system(conn)
        start = format_lsn(a.start_lsn)
        if flush < a.start_lsn:
            raise PrimaryMismatch(
                f"the primary lacks quorum-committed WAL between {format_lsn(flush)} and {start}: "
                "catch it up from the safekeepers before promoting it, or it is a stale primary")
        ours = _switches_below(await repl.timeline_history(conn, timeline), a.start_lsn)
        theirs = _switches_below(a.timeline_history, a.start_lsn)
        if ours != theirs:
            raise PrimaryMismatch(
                f"the primary's timeline history {ours} leaves the safekeepers' WAL ({theirs}) before {start}")
        if a.tail_lsn:
            data = await self._read_primary(a.tail_lsn, a.start_lsn, timeline)
            if google_crc32c.value(data) != a.tail_crc:
                raise PrimaryMismatch(
                    f"the primary's WAL between {format_lsn(a.tail_lsn)} and {start} differs from "
                    f"safekeeper {a.donor}'s: it is a different or stale primary")

    async def _read_primary(self, start: int, end: int, timeline: int) -> bytes:
        parts: list[bytes | memoryview] = []
        await self._copy_primary(start, end, timeline, lambda lsn, data: parts.append(data))
        return b"".join(parts)

    async def _copy_primary(self, start: int, end: int, timeline: int, sink,
                            link: PeerLink | None = None) -> None:
        """Stream WAL [start, end) from the primary without a slot, under a reader's name.

        With `link`, reading pauses while that safekeeper's socket has a backlog.
        """
        conn = await repl.connect_replication(self.opts.pg_dsn, f"{self.opts.application_name}_reader")
        done = asyncio.Event()
        got = start
        pieces: list[memoryview] = []  # received, not yet handed to sink: [got - size, got)
        size = 0

        def hand_over() -> None:
            nonlocal size
            if pieces:
                sink(got - size, pieces[0] if len(pieces) == 1 else b"".join(pieces))
                pieces.clear()
                size = 0

        def on_wal(lsn: int, data: memoryview) -> None:
            nonlocal got, size
            if lsn >= end:
                done.set()
                return
            piece = data[: end - lsn]
            pieces.append(piece)
            size += len(piece)
            got = lsn + len(piece)
            if size >= MAX_APPEND:
                hand_over()
            if got >= end:
                hand_over()
                done.set()

        def on_batch_end() -> None:
            hand_over()  # the messages of one drained batch make one Append
            if link is not None and link.buffered() > CATCHUP_BACKLOG:
                stream.pause()
                self._spawn(resume_when_drained())

        async def resume_when_drained() -> None:
            await link.drain()  # type: ignore[union-attr]
            stream.resume()

        stream = repl.ReplicationStream(conn, start_lsn=start, timeline=timeline, slot=None, on_wal=on_wal,
                                        on_batch_end=on_batch_end)
        try:
            await stream.start()
            closed = asyncio.ensure_future(stream.wait_closed())
            waiter = asyncio.ensure_future(done.wait())
            await asyncio.wait({closed, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not done.is_set():
                await closed  # raises the stream's error
                raise repl.ReplicationError(f"the primary ended the stream at {format_lsn(got)} before {format_lsn(end)}")
            closed.cancel()
        finally:
            await stream.close()

    async def _fetch(self, a: FetchWal) -> None:
        """Catch a lagging safekeeper up from the primary's pg_wal."""
        core, link = self.core, self.links[a.peer]
        assert core is not None
        self.log.info("catching up safekeeper", peer=a.peer, term=core.term,
                      start_lsn=format_lsn(a.start), end_lsn=format_lsn(a.end))

        def sink(lsn: int, data: bytes | memoryview) -> None:
            self._run(core.catchup_data(a.peer, lsn, data))

        try:
            await self._copy_primary(a.start, a.end, self._timeline, sink, link)
        except (repl.ReplicationError, psycopg.Error, OSError) as e:
            self.log.error("catch-up failed; will retry after reconnect", peer=a.peer, error=str(e).strip())
            link.drop()
            return
        finally:
            self._fetches.pop(a.peer, None)
        if core is self.core:
            self._run(core.catchup_done(a.peer))

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


def _switches_below(history: TimelineHistory, lsn: int) -> tuple[tuple[int, int], ...]:
    return tuple((e.timeline, e.switch_lsn) for e in history if e.switch_lsn <= lsn)


def _fmt(key: str, value: object) -> object:
    return format_lsn(value) if key.endswith("_lsn") and isinstance(value, int) else value

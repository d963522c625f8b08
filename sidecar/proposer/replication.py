"""The physical replication connection to the primary, driven at psycopg's pq level from asyncio.

Replication commands go through `AsyncConnection.execute()` as plain strings (the walsender
only speaks the simple query protocol). Once START_REPLICATION returns COPY_BOTH, all stream
work happens in a `loop.add_reader()` callback; psycopg's own waiting generators are never
cancelled, because a cancelled wait sends a PostgreSQL cancel request that aborts streaming.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

import psycopg
from psycopg import pq

from sidecar import pgrepl
from sidecar.consensus.statusschedule import SendStatus, StatusSchedule
from sidecar.timelines import TimelineEntry
from sidecar.lsn import format_lsn, parse_lsn
from sidecar.pgrepl import check_slot_name, parse_timeline_history

__all__ = ["ReplicationClient", "ReplicationError", "ReplicationStream", "TimelineEnded", "connect_replication",
           "identify_system", "parse_timeline_history", "read_slot", "timeline_history"]

# How long a client-initiated close waits for the server to finish the COPY before dropping it.
CLOSE_TIMEOUT = 5.0


class ReplicationError(Exception):
    """The replication stream or command failed; `sqlstate` is set when the server said why."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class TimelineEnded(Exception):
    """The server finished streaming a timeline that is no longer its current one."""

    def __init__(self, next_tli: int, next_lsn: int) -> None:
        super().__init__(f"timeline ended; next timeline {next_tli} starts at {format_lsn(next_lsn)}")
        self.next_tli = next_tli
        self.next_lsn = next_lsn


def _error_from(exc: psycopg.Error) -> ReplicationError:
    diag = exc.diag
    # libpq's own messages (lost connection) carry indented explanation lines.
    message = diag.message_primary or (str(exc).strip().splitlines() or ["unknown error"])[0]
    if diag.message_detail:
        message = f"{message} ({diag.message_detail})"
    return ReplicationError(message, diag.sqlstate)


async def connect_replication(dsn: str, application_name: str) -> psycopg.AsyncConnection:
    """Open a physical replication connection (`replication=true`) named `application_name`."""
    return await psycopg.AsyncConnection.connect(
        dsn,
        replication="true",
        application_name=application_name,
        autocommit=True,  # otherwise psycopg sends BEGIN, which a physical walsender rejects
        client_encoding="utf8",  # otherwise a SQL_ASCII server's text columns arrive as bytes
    )


async def _command(conn: psycopg.AsyncConnection, command: str) -> list[tuple]:
    try:
        cur = await conn.execute(command)
        return await cur.fetchall() if cur.description else []
    except psycopg.Error as exc:
        raise _error_from(exc) from exc


async def identify_system(conn: psycopg.AsyncConnection) -> tuple[int, int, int]:
    """IDENTIFY_SYSTEM: (system_id, timeline, xlogpos)."""
    rows = await _command(conn, "IDENTIFY_SYSTEM")
    system_id, timeline, xlogpos, _dbname = rows[0]
    return int(system_id), int(timeline), parse_lsn(xlogpos)


async def read_slot(conn: psycopg.AsyncConnection, slot: str) -> tuple[int, int] | None:
    """READ_REPLICATION_SLOT: (restart_lsn, restart_tli), (0, 0) if it has no WAL, None if missing."""
    rows = await _command(conn, f"READ_REPLICATION_SLOT {check_slot_name(slot)}")
    slot_type, restart_lsn, restart_tli = rows[0]
    if slot_type is None:
        return None
    if restart_lsn is None:
        return 0, 0
    return parse_lsn(restart_lsn), int(restart_tli)


async def timeline_history(conn: psycopg.AsyncConnection, tli: int) -> tuple[TimelineEntry, ...]:
    """TIMELINE_HISTORY: the switch points leading to `tli`; () for timeline 1, which has no file."""
    if tli == 1:
        return ()
    try:
        rows = await _command(conn, f"TIMELINE_HISTORY {int(tli)}")
    except ReplicationError as exc:
        raise ReplicationError(f"cannot read the history of timeline {tli}: {exc}", exc.sqlstate) from exc
    content = rows[0][1]
    if isinstance(content, (bytes, bytearray, memoryview)):
        content = bytes(content).decode()
    return parse_timeline_history(content)


class _State(enum.Enum):
    NEW = "new"
    STREAMING = "streaming"
    CLOSING = "closing"  # we sent CopyDone, waiting for the server's
    ENDING = "ending"  # the server ended COPY: collecting the final results
    DONE = "done"


class ReplicationStream:
    """One START_REPLICATION [SLOT s] PHYSICAL X/Y TIMELINE n stream, driven by add_reader.

    `on_wal(wal_start, payload)` runs in the reader callback for every XLogData; the payload
    memoryview owns its buffer and may be kept. `on_batch_end()` runs after each drained batch.
    When a status goes out is `schedule`'s decision (consensus/statusschedule.py): positions handed to
    `report()`, keepalives from the primary, and the time; it repeats the positions every
    `keepalive_interval` s and asks for a reply when the primary has been silent that long. Silence for
    `server_timeout` s ends the stream with ReplicationError.
    """

    def __init__(
        self,
        conn: psycopg.AsyncConnection,
        *,
        start_lsn: int,
        timeline: int,
        slot: str | None,
        on_wal: Callable[[int, memoryview], None],
        on_batch_end: Callable[[], None] | None = None,
        keepalive_interval: float = 1.0,
        server_timeout: float | None = 60.0,
    ) -> None:
        if timeline < 1:
            raise ValueError(f"invalid timeline {timeline}")
        self.conn = conn
        self.start_lsn = start_lsn
        self.timeline = timeline
        self.slot = check_slot_name(slot) if slot is not None else None
        self.on_wal = on_wal
        self.on_batch_end = on_batch_end
        self.keepalive_interval = keepalive_interval
        self.server_timeout = server_timeout

        self.received_lsn = start_lsn
        self.server_wal_end = 0
        self.last_received_at = 0.0  # loop.time() of the last message from the server
        self.messages_received = 0
        self.keepalives_received = 0
        self.statuses_sent = 0

        self._state = _State.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pg: pq.abc.PGconn | None = None
        self._fd = -1
        self._reading = False
        self._writing = False
        self._done: asyncio.Future[None] | None = None

        self.schedule = StatusSchedule(keepalive_interval=keepalive_interval)
        self._status_pending = False  # a status could not be queued: poll again once writable
        self._poll_handle: asyncio.Handle | None = None  # a poll at the end of this pass of the event loop
        self._status_timer: asyncio.Handle | None = None  # a poll when the schedule said
        self._status_timer_at = 0.0  # (uvloop's call_at of a past time gives a Handle without when())
        self._close_timer: asyncio.TimerHandle | None = None
        self._watchdog: asyncio.TimerHandle | None = None

        self._error: ReplicationError | None = None
        self._close_requested = False
        self._copy_end_sent = False  # CopyDone requested (it may still wait in _copy_end_pending)
        self._copy_end_pending = False
        self._next_timeline: tuple[int, int] | None = None
        self._paused = False

    # --- public API ------------------------------------------------------------------------

    @property
    def command(self) -> str:
        """The START_REPLICATION command this stream runs."""
        return pgrepl.format_start_replication(self.start_lsn, self.timeline, self.slot)

    @property
    def streaming(self) -> bool:
        """True between start() and the end of the stream or a close()."""
        return self._state is _State.STREAMING

    async def start(self) -> None:
        """Run START_REPLICATION and begin reading; later server errors surface from wait_closed()."""
        if self._state is not _State.NEW:
            raise RuntimeError("the stream was already started")
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        try:
            cur = await self.conn.execute(self.command)
        except BaseException as exc:
            self._state = _State.DONE
            self._done.set_result(None)
            if isinstance(exc, psycopg.Error):
                raise _error_from(exc) from exc
            raise
        pgres = cur.pgresult
        if pgres is None or pgres.status != pq.ExecStatus.COPY_BOTH:
            self._state = _State.DONE
            self._done.set_result(None)
            status = pgres.status.name if pgres is not None else "no result"
            raise ReplicationError(f"{self.command} did not start streaming (got {status})")
        self._pg = self.conn.pgconn
        self._pg.nonblocking = 1
        self._fd = self._pg.socket
        self._state = _State.STREAMING
        self.last_received_at = self._loop.time()
        self._loop.add_reader(self._fd, self._on_readable)
        self._reading = True
        self._poll_soon()
        self._schedule_watchdog()
        # libpq may already hold messages that arrived with the CopyBothResponse; the socket
        # will not report them as readable.
        self._loop.call_soon(self._process, False)

    def pause(self) -> None:
        """Stop reading WAL (backpressure); keepalive answers and status messages go on."""
        self._paused = True
        if self._loop is not None and self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def resume(self) -> None:
        self._paused = False
        if self._loop is not None and self._state is _State.STREAMING and not self._reading:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True
            self._loop.call_soon(self._process, False)  # messages libpq already buffered

    def report(self, write: int, flush: int, apply: int) -> None:
        """Positions for the primary; the schedule says when they go out (one that moves flush: at the end of
        this pass of the event loop, so that several reports handled in it make one message).

        `write` and `apply` are capped at the WAL received; a `flush` beyond it or below an
        earlier one raises ValueError, because the walsender would believe it unchecked.
        """
        self._take(write, flush, apply)
        self._poll_soon()

    def send_status(self, write: int, flush: int, apply: int, reply_requested: bool = False) -> None:
        """Report these positions and send a Standby Status Update with them now (ValueError as report());
        later periodic and keepalive replies repeat them."""
        self._take(write, flush, apply)
        if self._state is _State.STREAMING:
            self._send(SendStatus(*self.schedule.positions, reply_requested=reply_requested))
            self._poll_soon()

    def _take(self, write: int, flush: int, apply: int) -> None:
        if flush > self.received_lsn:
            raise ValueError(
                f"flush {format_lsn(flush)} is beyond the WAL received ({format_lsn(self.received_lsn)})"
            )
        now = self._loop.time() if self._loop is not None else 0.0
        self.schedule.report(min(write, self.received_lsn), flush, min(apply, self.received_lsn), now)

    async def wait_closed(self) -> None:
        """Wait for the stream to end; raise ReplicationError or TimelineEnded unless close() ended it."""
        if self._done is None:
            raise RuntimeError("the stream was not started")
        await asyncio.shield(self._done)

    async def close(self) -> None:
        """End the stream from our side (CopyDone, drain the rest) and close the connection; idempotent.

        After TimelineEnded or a server error the connection is back in command mode: to reuse
        it, do not call close().
        """
        if self._state in (_State.STREAMING, _State.ENDING) and not self._close_requested:
            self._close_requested = True
            if self._state is _State.STREAMING:
                self._state = _State.CLOSING
                try:
                    self._send_copy_end()
                except psycopg.Error as exc:
                    self._fail(_error_from(exc))
            assert self._loop is not None
            self._close_timer = self._loop.call_later(CLOSE_TIMEOUT, self._close_timed_out)
        if self._done is not None:
            try:
                await asyncio.shield(self._done)
            except Exception:  # the outcome belongs to wait_closed()
                pass
        self._stop_io()
        if not self.conn.closed:
            await self.conn.close()

    # --- status messages -------------------------------------------------------------------

    def _poll_soon(self) -> None:
        if self._loop is not None and self._poll_handle is None and self._state is _State.STREAMING:
            self._poll_handle = self._loop.call_soon(self._poll_now)

    def _poll_now(self) -> None:
        self._poll_handle = None
        self._poll()

    def _status_timer_due(self) -> None:
        self._status_timer = None
        self._poll()

    def _poll(self) -> None:
        """Do what the schedule says: send a status now, or poll again at its time."""
        if self._state is not _State.STREAMING or self._status_pending:
            return  # a status waiting for the socket goes first (_on_writable polls again)
        assert self._loop is not None
        now = self._loop.time()
        decision = self.schedule.poll(now, self.last_received_at)
        if isinstance(decision, SendStatus):
            self._send(decision)
            if self._status_pending or self._state is not _State.STREAMING:
                return
            decision = self.schedule.poll(now, self.last_received_at)
        if isinstance(decision, float):
            # A timer already due sooner stays: it polls early and finds the later time. Moving it on every
            # status would cost more than that.
            if self._status_timer is not None and self._status_timer_at > decision:
                self._status_timer.cancel()
                self._status_timer = None
            if self._status_timer is None:
                self._status_timer = self._loop.call_at(decision, self._status_timer_due)
                self._status_timer_at = decision

    def _send(self, status: SendStatus) -> None:
        assert self._pg is not None and self._loop is not None
        msg = pgrepl.encode_status(status.write, status.flush, status.apply, pgrepl.pg_time(time.time_ns()),
                                   status.reply_requested)
        try:
            if self._pg.put_copy_data(msg) == 0:
                self._status_pending = True
                self._want_write()
                return
            self._status_pending = False
            self._flush_output()
        except psycopg.Error as exc:
            self._fail(_error_from(exc))
            return
        self.statuses_sent += 1
        self.schedule.sent(status, self._loop.time())

    def _schedule_watchdog(self) -> None:
        assert self._loop is not None
        if self.server_timeout is not None:
            self._watchdog = self._loop.call_at(self.last_received_at + self.server_timeout, self._watchdog_due)

    def _watchdog_due(self) -> None:
        self._watchdog = None
        if self._state in (_State.NEW, _State.DONE) or self.server_timeout is None:
            return
        assert self._loop is not None
        if self._loop.time() - self.last_received_at >= self.server_timeout:
            self._fail(ReplicationError(f"no message from the primary for {self.server_timeout:g} s"))
        else:
            self._schedule_watchdog()

    # --- socket I/O ------------------------------------------------------------------------

    def _flush_output(self) -> None:
        assert self._pg is not None
        if self._pg.flush() == 1:
            self._want_write()

    def _want_write(self) -> None:
        assert self._loop is not None
        if not self._writing:
            self._loop.add_writer(self._fd, self._on_writable)
            self._writing = True

    def _on_writable(self) -> None:
        assert self._pg is not None and self._loop is not None
        try:
            if self._pg.flush() == 1:
                return
        except psycopg.Error as exc:
            self._fail(_error_from(exc))
            return
        self._loop.remove_writer(self._fd)
        self._writing = False
        if self._copy_end_pending:
            self._copy_end_pending = False
            self._copy_end_sent = False
            self._process_after(self._send_copy_end)
        elif self._status_pending and self._state is _State.STREAMING:
            self._status_pending = False
            self._poll()

    def _process_after(self, action: Callable[[], None]) -> None:
        try:
            action()
        except psycopg.Error as exc:
            self._fail(_error_from(exc))
            return
        # Results that waited for our CopyDone may already be buffered.
        self._process(False)

    def _send_copy_end(self) -> None:
        assert self._pg is not None
        if self._copy_end_sent:
            return
        self._copy_end_sent = True
        self._cancel_status_polls()
        if self._pg.put_copy_end(None) == 0:
            self._copy_end_pending = True
            self._want_write()
        else:
            self._flush_output()

    def _on_readable(self) -> None:
        self._process(True)

    def _process(self, consume: bool) -> None:
        if self._state in (_State.NEW, _State.DONE):
            return
        assert self._pg is not None and self._loop is not None
        try:
            if consume:
                self._pg.consume_input()
            if self._state in (_State.STREAMING, _State.CLOSING):
                self._drain()
            if self._state is _State.ENDING:
                self._collect_results()
        except psycopg.Error as exc:
            if self._error is None and self._state is _State.ENDING:
                self._error = ReplicationError(
                    "the primary ended the replication stream and closed the connection "
                    f"({_error_from(exc)}); is it shutting down?"
                )
            self._fail(self._error or _error_from(exc))
        except Exception as exc:  # an on_wal/on_batch_end failure ends the stream with it
            self._fail(exc)

    def _drain(self) -> None:
        assert self._pg is not None and self._loop is not None
        pg = self._pg
        delivered = False
        answer = False
        deliver = self._state is _State.STREAMING
        received_before = self.messages_received
        n = 0
        while self._state is not _State.DONE and not self._paused:
            n, buf = pg.get_copy_data(1)
            if n == 0:
                break
            if n == -1:
                self._state = _State.ENDING
                break
            self.messages_received += 1
            try:
                msg = pgrepl.parse_copy_data(buf)
            except pgrepl.ReplicationProtocolError as exc:
                raise ReplicationError(f"the primary sent a malformed message: {exc}") from None
            if type(msg) is pgrepl.XLogData:
                self.server_wal_end = msg.wal_end
                if not deliver:
                    continue  # closing: the caller no longer wants WAL
                if msg.start != self.received_lsn:
                    raise ReplicationError(
                        f"the primary sent WAL at {format_lsn(msg.start)}, expected {format_lsn(self.received_lsn)}"
                    )
                self.received_lsn = msg.start + len(msg.data)
                self.on_wal(msg.start, msg.data)
                delivered = True
            elif type(msg) is pgrepl.Keepalive:
                self.server_wal_end = msg.wal_end
                self.keepalives_received += 1
                answer = answer or msg.reply_requested
            else:
                raise ReplicationError(f"unexpected replication message {type(msg).__name__} from the primary")
        if self._state is _State.DONE:
            return
        if self.messages_received != received_before or n == -1:
            self.last_received_at = self._loop.time()
        if delivered and self.on_batch_end is not None:
            self.on_batch_end()
        if answer and self._state is _State.STREAMING:
            self.schedule.keepalive()
            self._poll()

    def _collect_results(self) -> None:
        assert self._pg is not None
        pg = self._pg
        while not pg.is_busy():
            res = pg.get_result()
            if res is None:
                self._finish()
                return
            status = res.status
            if status == pq.ExecStatus.COPY_IN:
                # The server sent CopyDone (end of timeline); libpq waits for ours before the
                # next results, and returns this COPY_IN result forever until then.
                if self._copy_end_pending:
                    return
                if self._copy_end_sent:
                    raise ReplicationError("the server ended COPY twice")
                self._send_copy_end()
            elif status == pq.ExecStatus.TUPLES_OK:
                if res.ntuples and res.nfields >= 2:
                    tli, lsn = res.get_value(0, 0), res.get_value(0, 1)
                    if tli is not None and lsn is not None:
                        self._next_timeline = (int(tli), parse_lsn(bytes(lsn).decode()))
            elif status == pq.ExecStatus.FATAL_ERROR:
                if self._error is None:
                    self._error = _result_error(res)
            elif status in (pq.ExecStatus.COPY_OUT, pq.ExecStatus.COPY_BOTH):
                raise ReplicationError(f"unexpected {status.name} result after the end of COPY")

    # --- ending ----------------------------------------------------------------------------

    def _finish(self) -> None:
        """The connection is back in command mode: settle the outcome."""
        self._stop_io()
        self._state = _State.DONE
        assert self._done is not None
        if self._done.done():
            return
        if self._error is not None:
            self._done.set_exception(self._error)
        elif self._close_requested:
            self._done.set_result(None)
        elif self._next_timeline is not None:
            self._done.set_exception(TimelineEnded(*self._next_timeline))
        else:
            self._done.set_exception(ReplicationError("the primary ended the replication stream"))

    def _fail(self, exc: BaseException) -> None:
        """The stream is broken: stop all I/O and drop the connection."""
        self._stop_io()
        self._state = _State.DONE
        if self._pg is not None and not self.conn.closed:
            # The connection is mid-COPY and unusable; finish() closes the socket without a cancel.
            self._pg.finish()
        assert self._done is not None
        if not self._done.done():
            self._done.set_exception(exc)

    def _close_timed_out(self) -> None:
        self._close_timer = None
        if self._state is not _State.DONE:
            self._fail(ReplicationError(f"the primary did not end the stream within {CLOSE_TIMEOUT} s"))

    def _cancel_status_polls(self) -> None:
        for handle in (self._poll_handle, self._status_timer):
            if handle is not None:
                handle.cancel()
        self._poll_handle = self._status_timer = None

    def _stop_io(self) -> None:
        self._cancel_status_polls()
        for handle in (self._close_timer, self._watchdog):
            if handle is not None:
                handle.cancel()
        self._close_timer = self._watchdog = None
        if self._loop is not None and self._fd >= 0:
            if self._reading:
                self._loop.remove_reader(self._fd)
                self._reading = False
            if self._writing:
                self._loop.remove_writer(self._fd)
                self._writing = False


def _result_error(res: pq.abc.PGresult) -> ReplicationError:
    def field(code: pq.DiagnosticField) -> str | None:
        value = res.error_field(code)
        return bytes(value).decode(errors="replace") if value is not None else None

    message = field(pq.DiagnosticField.MESSAGE_PRIMARY)
    if message is None:
        text = bytes(res.error_message).decode(errors="replace").strip()
        message = (text.splitlines() or ["unknown error"])[0]
    detail = field(pq.DiagnosticField.MESSAGE_DETAIL)
    if detail:
        message = f"{message} ({detail})"
    return ReplicationError(message, field(pq.DiagnosticField.SQLSTATE))


class ReplicationClient:
    """Replication connections to one primary, as the service uses them; its tests put a fake here."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    async def connect(self, application_name: str) -> psycopg.AsyncConnection:
        return await connect_replication(self.dsn, application_name)

    identify_system = staticmethod(identify_system)
    read_slot = staticmethod(read_slot)
    timeline_history = staticmethod(timeline_history)
    stream = ReplicationStream

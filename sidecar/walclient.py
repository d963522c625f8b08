"""The client of a safekeeper's reader port: commands and one physical stream over libpq, blocking.

restore-wal, failover and peer recovery read WAL back through here. The stream runs at psycopg's
pq level (as proposer/replication.py does with the primary, but with select() instead of an event
loop): replication messages come from sidecar/pgrepl.py, status goes out at least every
STATUS_INTERVAL and the flush it reports is what the caller has consumed.
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterator
from typing import IO, Any

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo

from sidecar import pgrepl
from sidecar.address import Address
from sidecar.config import ReaderCredentials
from sidecar.timelines import TimelineEntry
from sidecar.lsn import format_lsn, parse_lsn

STATUS_INTERVAL = 1.0  # seconds between standby status messages (pg_receivewal's --status-interval)
DEFAULT_TIMEOUT = 10.0
APPLICATION_NAME = "walsidecar"

__all__ = ["ReaderError", "ReaderUnreachable", "WalReader", "copy_wal", "reader_conninfo"]


class ReaderError(Exception):
    """The safekeeper refused a command or broke the stream; `sqlstate` is set when it said why."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate


class ReaderUnreachable(ReaderError):
    """No connection could be made, or it was lost (network, TLS, authentication)."""


def reader_conninfo(address: Address, creds: ReaderCredentials, **params: Any) -> str:
    """libpq conninfo of a reader port: replication, the reader's user and passfile, TLS verify-full or none."""
    info: dict[str, Any] = {"host": address.host, "port": address.port, "user": creds.reader_user,
                            "dbname": "replication", "replication": "true",
                            "connect_timeout": max(1, round(creds.reader_timeout))}
    if creds.reader_passfile is not None:
        info["passfile"] = str(creds.reader_passfile)
    if creds.certs_dir is not None:
        from sidecar.certs import CA_CERT, NODE_CERT, NODE_KEY
        info.update(sslmode="verify-full", sslrootcert=str(creds.certs_dir / CA_CERT))
        # The reader port asks for no client certificate; one is offered when the directory has it.
        cert, key = creds.certs_dir / NODE_CERT, creds.certs_dir / NODE_KEY
        if cert.is_file() and key.is_file():
            info.update(sslcert=str(cert), sslkey=str(key))
    else:
        info["sslmode"] = "prefer" if creds.insecure else "require"
    info.update(params)
    return make_conninfo(**info)


def _error(exc: psycopg.Error, unreachable: bool = False) -> ReaderError:
    diag = exc.diag
    # libpq's own messages (refused, timeout, lost connection) carry indented explanation lines.
    message = diag.message_primary or " ".join(str(exc).split()) or type(exc).__name__
    if diag.message_detail:
        message = f"{message} ({diag.message_detail})"
    if diag.message_hint:
        message = f"{message}; hint: {diag.message_hint}"
    if unreachable or (isinstance(exc, psycopg.OperationalError) and diag.sqlstate is None):
        return ReaderUnreachable(message, diag.sqlstate)
    return ReaderError(message, diag.sqlstate)


def _result_error(res: pq.abc.PGresult) -> ReaderError:
    exc = psycopg.errors.error_from_result(res, encoding="utf-8")
    return _error(exc)


class WalReader:
    """One replication connection to a safekeeper's reader port; use it as a context manager."""

    def __init__(self, address: Address, creds: ReaderCredentials, *, application_name: str = APPLICATION_NAME,
                 timeout: float | None = None) -> None:
        self.address = address
        self.creds = creds
        self.application_name = application_name
        self.timeout = creds.reader_timeout if timeout is None else timeout
        self.conn: psycopg.Connection | None = None
        # Set by stream(): what the server said at its end, and how far its WAL went.
        self.timeline_end: TimelineEntry | None = None
        self.server_wal_end = 0

    def __enter__(self) -> WalReader:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        try:
            self.conn = psycopg.connect(
                reader_conninfo(self.address, self.creds, application_name=self.application_name),
                autocommit=True,  # a physical walsender takes no BEGIN
                prepare_threshold=None,  # and only the simple query protocol
                client_encoding="utf8")
        except psycopg.Error as exc:
            raise _error(exc, unreachable=True) from None

    def close(self) -> None:
        if self.conn is not None and not self.conn.closed:
            self.conn.close()

    def _conn(self) -> psycopg.Connection:
        if self.conn is None or self.conn.closed:
            raise ReaderUnreachable(f"no connection to {self.address}")
        return self.conn

    def command(self, text: str) -> list[tuple]:
        """Run one replication command; its rows (text columns as str)."""
        try:
            cur = self._conn().execute(text)
            return cur.fetchall() if cur.description else []
        except psycopg.Error as exc:
            raise _error(exc) from None

    # ---- commands ---------------------------------------------------------------------------

    def identify(self) -> tuple[int, int, int]:
        """IDENTIFY_SYSTEM: (system_id, timeline, xlogpos); a safekeeper's xlogpos is its commit position."""
        rows = self.command("IDENTIFY_SYSTEM")
        try:
            system_id, timeline, xlogpos, _db = rows[0]
            return int(system_id), int(timeline), parse_lsn(str(xlogpos))
        except (IndexError, ValueError, TypeError):
            raise ReaderError(f"IDENTIFY_SYSTEM from {self.address} answered {rows!r}") from None

    def wal_segment_size(self) -> int:
        """SHOW wal_segment_size, in bytes."""
        rows = self.command("SHOW wal_segment_size")
        text = str(rows[0][0]) if rows else ""
        units = {"MB": 1 << 20, "kB": 1 << 10, "GB": 1 << 30}
        for unit, factor in units.items():
            if text.endswith(unit) and text[:-len(unit)].isdigit():
                size = int(text[:-len(unit)]) * factor
                if size & (size - 1) == 0 and (1 << 20) <= size <= (1 << 30):
                    return size
        raise ReaderError(f"{self.address} gave wal_segment_size {text!r}: not a PostgreSQL segment size")

    def timeline_history(self, tli: int) -> str:
        """TIMELINE_HISTORY: the content of `tli`'s .history file."""
        rows = self.command(f"TIMELINE_HISTORY {int(tli)}")
        try:
            name, content = rows[0]
        except (IndexError, ValueError):
            raise ReaderError(f"TIMELINE_HISTORY {tli} from {self.address} answered {rows!r}") from None
        if name != pgrepl.history_file_name(tli):
            raise ReaderError(f"TIMELINE_HISTORY {tli} from {self.address} named its file {name!r}")
        return bytes(content).decode() if isinstance(content, (bytes, bytearray, memoryview)) else str(content)

    def read_slot(self, slot: str) -> tuple[int, int] | None:
        """READ_REPLICATION_SLOT: (restart_lsn, timeline), (0, 0) when it holds no position, None if missing."""
        rows = self.command(f"READ_REPLICATION_SLOT {pgrepl.check_slot_name(slot)}")
        slot_type, restart_lsn, tli = rows[0]
        if slot_type is None:
            return None
        if restart_lsn is None:
            return 0, 0
        return parse_lsn(str(restart_lsn)), int(tli)

    def create_slot(self, slot: str, reserve_wal: bool = False) -> int:
        """CREATE_REPLICATION_SLOT s PHYSICAL [RESERVE_WAL]: the position reserved (0 for none)."""
        reserve = " RESERVE_WAL" if reserve_wal else ""
        rows = self.command(f"CREATE_REPLICATION_SLOT {pgrepl.check_slot_name(slot)} PHYSICAL{reserve}")
        return parse_lsn(str(rows[0][1])) if rows and rows[0][1] else 0

    def drop_slot(self, slot: str) -> None:
        self.command(f"DROP_REPLICATION_SLOT {pgrepl.check_slot_name(slot)}")

    # ---- streaming --------------------------------------------------------------------------

    def stream(self, start_lsn: int, *, timeline: int = 0, term: int = 0, slot: str | None = None,
               stop_at: int | None = None) -> Iterator[tuple[int, bytes]]:
        """START_REPLICATION from `start_lsn`: (lsn, data) chunks in order, none beyond `stop_at`.

        Ends at `stop_at` (the COPY is then ended from our side) or when the server ends the
        timeline (`timeline_end` then says what follows). Standby status reports as flushed what
        the caller consumed, so a slot moves with it. Server errors raise ReaderError.
        """
        if stop_at is not None and stop_at <= start_lsn:
            return
        conn = self._conn()
        command = pgrepl.format_start_replication(start_lsn, timeline, slot, term)
        self.timeline_end = None
        try:
            cur = conn.execute(command)
        except psycopg.Error as exc:
            raise _error(exc) from None
        res = cur.pgresult
        if res is None or res.status != pq.ExecStatus.COPY_BOTH:
            raise ReaderError(f"{command} did not start streaming on {self.address}")
        run = _Stream(self, conn.pgconn, start_lsn)
        try:
            yield from run.chunks(stop_at)
        except psycopg.Error as exc:
            run.broken = True
            raise _error(exc) from None
        except ReaderError:
            run.broken = not run.done  # mid-COPY in an unknown state: the connection goes
            raise
        finally:
            run.finish()


class _Stream:
    """The COPY BOTH phase of one stream (see WalReader.stream)."""

    def __init__(self, reader: WalReader, pg: pq.abc.PGconn, start: int) -> None:
        self.reader, self.pg = reader, pg
        self.expected = start  # the next byte the server must send
        self.consumed = start  # what the caller has taken: our flush
        self.last_status = 0.0
        self.last_heard = time.monotonic()
        self.copy_ended = False  # the server ended COPY
        self.client_ended = False  # we sent CopyDone: no more status
        self.done = False  # back in command mode
        self.broken = False
        pg.nonblocking = 1

    def chunks(self, stop_at: int | None) -> Iterator[tuple[int, bytes]]:
        pg = self.pg
        while True:
            n, buf = pg.get_copy_data(1)
            if n == 0:
                self._wait()
                continue
            if n == -1:
                self.copy_ended = True
                self._results()
                return
            self.last_heard = time.monotonic()
            try:
                msg = pgrepl.parse_copy_data(buf)
            except pgrepl.ReplicationProtocolError as exc:
                raise ReaderError(f"{self.reader.address} sent a malformed message: {exc}") from None
            if type(msg) is pgrepl.Keepalive:
                self.reader.server_wal_end = msg.wal_end
                if msg.reply_requested:
                    self._status()
                continue
            if type(msg) is not pgrepl.XLogData:
                raise ReaderError(f"{self.reader.address} sent {type(msg).__name__} while streaming")
            self.reader.server_wal_end = max(self.reader.server_wal_end, msg.wal_end)
            if msg.start != self.expected:
                raise ReaderError(f"{self.reader.address} sent WAL at {format_lsn(msg.start)}, expected "
                                  f"{format_lsn(self.expected)}")
            data = bytes(msg.data)
            if stop_at is not None and msg.start + len(data) > stop_at:
                data = data[:stop_at - msg.start]
            self.expected = msg.start + len(data)
            if data:
                yield msg.start, data
            self.consumed = self.expected
            if time.monotonic() - self.last_status >= STATUS_INTERVAL:
                self._status()
            if stop_at is not None and self.expected >= stop_at:
                self._status()  # the slot, if any, moves to the end before the stream does
                return

    def _wait(self) -> None:
        """Wait for input, sending status when due; ReaderError after `timeout` of silence."""
        now = time.monotonic()
        silent = now - self.last_heard
        if silent >= self.reader.timeout:
            raise ReaderUnreachable(f"{self.reader.address} said nothing for {self.reader.timeout:g} s while "
                                    "streaming")
        if now - self.last_status >= STATUS_INTERVAL and not self.client_ended:
            # While we talk the walsender does not ping: ask, so its silence means trouble.
            self._status(reply_requested=silent >= STATUS_INTERVAL)
        wait = min(STATUS_INTERVAL, self.reader.timeout - silent)
        ready, _, _ = select.select([self.pg.socket], [], [], max(wait, 0.01))
        if ready:
            self.pg.consume_input()

    def _status(self, reply_requested: bool = False) -> None:
        msg = pgrepl.encode_status(self.consumed, self.consumed, self.consumed, pgrepl.pg_time(time.time_ns()),
                                   reply_requested)
        self._put(lambda: self.pg.put_copy_data(msg))
        self.last_status = time.monotonic()

    def _put(self, put: Any) -> None:
        deadline = time.monotonic() + self.reader.timeout
        while put() == 0:
            self._writable(deadline)
        while self.pg.flush() == 1:
            self._writable(deadline)

    def _writable(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReaderUnreachable(f"{self.reader.address} took nothing from us for {self.reader.timeout:g} s")
        select.select([self.pg.socket], [self.pg.socket], [], left)
        self.pg.consume_input()  # the server may be waiting for us to read before it reads

    def _results(self) -> None:
        """After the server's CopyDone or error: answer CopyDone, collect the results, back to commands."""
        error: ReaderError | None = None
        deadline = time.monotonic() + self.reader.timeout
        while True:
            while self.pg.is_busy():
                if time.monotonic() > deadline:
                    raise ReaderUnreachable(f"{self.reader.address} did not finish the stream")
                select.select([self.pg.socket], [], [], max(deadline - time.monotonic(), 0.01))
                self.pg.consume_input()
            res = self.pg.get_result()
            if res is None:
                break
            if res.status == pq.ExecStatus.COPY_IN:
                # The server ended the timeline; libpq holds the rest until our CopyDone.
                if self.client_ended:
                    raise ReaderError(f"{self.reader.address} ended COPY twice")
                self._status()
                self.client_ended = True
                self._put(lambda: self.pg.put_copy_end(None))
            elif res.status == pq.ExecStatus.COPY_OUT or res.status == pq.ExecStatus.COPY_BOTH:
                # Our CopyDone went out first: drain what the server still sends.
                while (n := self.pg.get_copy_data(1)[0]) != -1:
                    if n == 0:
                        self._wait()
            elif res.status == pq.ExecStatus.TUPLES_OK and res.ntuples and res.nfields >= 2:
                tli, lsn = res.get_value(0, 0), res.get_value(0, 1)
                if tli is not None and lsn is not None:
                    try:
                        self.reader.timeline_end = TimelineEntry(int(tli), parse_lsn(bytes(lsn).decode()))
                    except ValueError:
                        raise ReaderError(f"{self.reader.address} ended the timeline with "
                                          f"{bytes(tli)!r}, {bytes(lsn)!r}") from None
            elif res.status == pq.ExecStatus.FATAL_ERROR and error is None:
                error = _result_error(res)
        self.done = True
        if error is not None:
            raise error

    def finish(self) -> None:
        """End the COPY from our side if it still runs; drop the connection if that fails."""
        if self.done or self.broken:
            if self.broken:
                self.reader.close()
            return
        try:
            if not self.copy_ended:
                self.client_ended = True
                self._put(lambda: self.pg.put_copy_end(None))
                while (n := self.pg.get_copy_data(1)[0]) != -1:
                    if n == 0:
                        self._wait()
                self.copy_ended = True
            self._results()
        except (ReaderError, psycopg.Error, OSError):
            self.reader.close()  # a connection mid-COPY is of no further use


def copy_wal(reader: WalReader, start: int, end: int, out: IO[bytes] | None = None, *, timeline: int = 0,
             term: int = 0) -> bytes:
    """The WAL [start, end) from `reader`, written to `out` when given (then b'' is returned).

    ReaderError when the server ends the stream (or its timeline) before `end`.
    """
    buf = bytearray()
    pos = start
    for lsn, data in reader.stream(start, timeline=timeline, term=term, stop_at=end):
        if out is not None:
            out.write(data)
        else:
            buf += data
        pos = lsn + len(data)
    if pos < end:
        why = (f"its timeline ended at {format_lsn(reader.timeline_end.switch_lsn)}"
               if reader.timeline_end is not None else "the stream ended")
        raise ReaderError(f"{reader.address} gave WAL only up to {format_lsn(pos)} of "
                          f"{format_lsn(start)}-{format_lsn(end)}: {why}")
    return bytes(buf)

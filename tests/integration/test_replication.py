"""The replication connection against a real PostgreSQL 15 primary."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from support.backends import PgServer
from support.helpers import run, until
from sidecar.timelines import TimelineEntry
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, format_lsn, parse_lsn, segment_file_name, segment_start
from sidecar.proposer.primary import ensure_slot
from sidecar.proposer.replication import (
    ReplicationError,
    ReplicationStream,
    TimelineEnded,
    connect_replication,
    identify_system,
    parse_timeline_history,
    read_slot,
    timeline_history,
)

APP = "walsidecar"
SLOT = "walsidecar_slot"

pytestmark = pytest.mark.timeout(120)


async def admin(pg: PgServer) -> psycopg.AsyncConnection:
    """An ordinary connection whose commits never wait for a synchronous standby."""
    return await psycopg.AsyncConnection.connect(
        pg.dsn(), autocommit=True, options="-c synchronous_commit=local"
    )


async def scalar(conn: psycopg.AsyncConnection, query: str, params: tuple[Any, ...] = ()) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    return None if row is None else row[0]


async def server_flush(conn: psycopg.AsyncConnection) -> int:
    return parse_lsn(await scalar(conn, "SELECT pg_current_wal_flush_lsn()::text"))


class Collector:
    """Keeps every WAL chunk the stream delivers, checking contiguity."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.end = start
        self.data = bytearray()
        self.batches = 0

    def on_wal(self, wal_start: int, payload: memoryview) -> None:
        assert wal_start == self.end
        self.data += payload
        self.end += len(payload)

    def on_batch_end(self) -> None:
        self.batches += 1


def read_pg_wal(pg: PgServer, timeline: int, start: int, end: int) -> bytes:
    """Bytes [start, end) of the primary's WAL, read from its pg_wal segment files."""
    out = bytearray()
    pos = start
    while pos < end:
        seg = segment_start(pos)
        chunk_end = min(end, seg + DEFAULT_SEGMENT_SIZE)
        path = pg.pg_wal_dir / segment_file_name(timeline, pos // DEFAULT_SEGMENT_SIZE)
        with open(path, "rb") as f:
            f.seek(pos - seg)
            out += f.read(chunk_end - pos)
        pos = chunk_end
    return bytes(out)


# --- commands ------------------------------------------------------------------------------


def test_identify_system_and_read_slot(pg: PgServer) -> None:
    async def main() -> None:
        a = await admin(pg)
        sysid = int(await scalar(a, "SELECT system_identifier FROM pg_control_system()"))
        before = await server_flush(a)
        conn = await connect_replication(pg.dsn(), APP)
        try:
            system_id, timeline, xlogpos = await identify_system(conn)
            assert (system_id, timeline) == (sysid, 1)
            assert before <= xlogpos <= await server_flush(a)

            assert await read_slot(conn, SLOT) is None
            restart = await ensure_slot(a, SLOT)
            assert await read_slot(conn, SLOT) == (restart, 1)
            restart_text = await scalar(
                a, "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)
            )
            assert restart == parse_lsn(restart_text)

            # A slot without reserved WAL exists but has no position yet.
            await a.execute("SELECT pg_create_physical_replication_slot('unreserved', false)")
            assert await read_slot(conn, "unreserved") == (0, 0)
            with pytest.raises(ValueError):
                await read_slot(conn, "Bad-Name")
        finally:
            await conn.close()
            await a.close()

    run(main())


def test_parse_timeline_history() -> None:
    text = "1\t0/3000158\tno recovery target specified\n\n# comment\n2\t1/A0\tbefore 2000-01-01\n"
    assert parse_timeline_history(text) == (TimelineEntry(1, 0x3000158), TimelineEntry(2, 0x1000000A0))
    assert parse_timeline_history("") == ()
    with pytest.raises(ValueError):
        parse_timeline_history("1\tnot-an-lsn\treason\n")
    with pytest.raises(ValueError):
        parse_timeline_history("2\t0/2000000\tx\n1\t0/3000000\ty\n")


def test_timeline_switch_ends_stream_with_next_timeline(pg: PgServer) -> None:
    async def make_work() -> None:
        a = await admin(pg)
        await a.execute("CREATE TABLE t AS SELECT generate_series(1, 1000) AS i")
        await a.close()

    run(make_work())
    # Restart the cleanly stopped primary as a standby and promote it: timeline 2.
    pg.stop()
    (pg.data_dir / "standby.signal").write_text("")
    pg.start()
    pg.run_bin("pg_ctl", "-D", str(pg.data_dir), "-w", "promote")

    async def main() -> None:
        conn = await connect_replication(pg.dsn(), APP)
        try:
            _, timeline, _ = await identify_system(conn)
            assert timeline == 2
            assert await timeline_history(conn, 1) == ()
            history = await timeline_history(conn, 2)
            assert len(history) == 1 and history[0].timeline == 1
            switch = history[0].switch_lsn

            # Streaming the old timeline stops exactly at the switch point.
            start = segment_start(switch) if switch % DEFAULT_SEGMENT_SIZE else switch - 8192
            got = Collector(start)
            stream = ReplicationStream(conn, start_lsn=start, timeline=1, slot=None, on_wal=got.on_wal)
            await stream.start()
            with pytest.raises(TimelineEnded) as ended:
                await stream.wait_closed()
            assert (ended.value.next_tli, ended.value.next_lsn) == (2, switch)
            assert stream.received_lsn == got.end == switch

            # The connection is back in command mode and can follow the new timeline.
            assert (await identify_system(conn))[1] == 2
            got2 = Collector(switch)
            stream2 = ReplicationStream(conn, start_lsn=switch, timeline=2, slot=None, on_wal=got2.on_wal)
            await stream2.start()
            a = await admin(pg)
            await a.execute("INSERT INTO t VALUES (0)")
            target = await server_flush(a)
            await a.close()
            await until(lambda: stream2.received_lsn >= target, "WAL on timeline 2")
            await stream2.close()
            await stream2.wait_closed()
            assert conn.closed
            other = await connect_replication(pg.dsn(), APP)
            with pytest.raises(ReplicationError, match="cannot read the history of timeline 7"):
                await timeline_history(other, 7)
            await other.close()
        finally:
            await conn.close()

    run(main())


# --- streaming -----------------------------------------------------------------------------


def test_sync_commit_waits_for_reported_flush(pg_factory: Callable[..., PgServer]) -> None:
    pg = pg_factory(settings={"synchronous_standby_names": APP})

    async def main() -> None:
        a = await admin(pg)
        await a.execute("CREATE TABLE t (i int)")
        await ensure_slot(a, SLOT)
        conn = await connect_replication(pg.dsn(), APP)
        _, timeline, xlogpos = await identify_system(conn)
        stream = ReplicationStream(
            conn, start_lsn=xlogpos, timeline=timeline, slot=SLOT, on_wal=lambda s, p: None,
            keepalive_interval=0.2,
        )
        await stream.start()
        committer = await psycopg.AsyncConnection.connect(pg.dsn())
        try:
            # Acknowledge what exists so far; periodic statuses take the walsender out of catchup.
            await until(lambda: stream.received_lsn >= xlogpos, "stream start")
            stream.send_status(stream.received_lsn, stream.received_lsn, stream.received_lsn)
            row = await until(
                lambda: _replication_row(a), "walsidecar to become the synchronous standby"
            )
            assert row == (APP, "streaming", "sync")

            await committer.execute("INSERT INTO t VALUES (1)")
            before_commit = parse_lsn(await scalar(committer, "SELECT pg_current_wal_insert_lsn()::text"))
            commit = asyncio.create_task(committer.commit())
            wait_event = "SELECT wait_event FROM pg_stat_activity WHERE pid = %s"
            pid = (committer.info.backend_pid,)
            await until(
                lambda: _equals(scalar(a, wait_event, pid), "SyncRep"),
                "the commit to wait for synchronous replication",
            )
            # The commit record is flushed locally before the wait: receive up to there.
            local_flush = await server_flush(a)
            await until(lambda: stream.received_lsn >= local_flush, "the commit record")
            received = stream.received_lsn

            # A flush short of the commit record's end does not release it.
            stream.send_status(received, before_commit, before_commit)
            await until(
                lambda: _reported_flush(a, before_commit), "the walsender to see the partial flush"
            )
            assert not commit.done()
            assert await scalar(a, wait_event, pid) == "SyncRep"

            stream.send_status(received, received, received)
            await asyncio.wait_for(commit, 10)
            # The walsender releases waiters first, then moves the slot.
            slot_lsn = "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s"
            await until(
                lambda: _equals(scalar(a, slot_lsn, (SLOT,)), format_lsn(received)),
                "the slot to follow the reported flush",
            )

            # The stream refuses a flush it cannot vouch for and caps write and apply.
            with pytest.raises(ValueError, match="beyond the WAL received"):
                stream.send_status(received, received + 1, received)
            with pytest.raises(ValueError, match="went backwards"):
                stream.send_status(received, before_commit, before_commit)
            # The walsender records a status before answering its reply request.
            keepalives = stream.keepalives_received
            stream.send_status(received + 100, received, received + 100, reply_requested=True)
            await until(lambda: stream.keepalives_received > keepalives, "the reply to our status")
            assert await _reported_positions(a) == (format_lsn(received),) * 3

            # Periodic statuses keep flowing without calls.
            sent = stream.statuses_sent
            await until(lambda: stream.statuses_sent >= sent + 2, "periodic statuses")
        finally:
            await committer.close()
            await stream.close()
            await a.close()

    run(main())


async def _reported_positions(conn: psycopg.AsyncConnection) -> tuple[str, str, str] | None:
    cur = await conn.execute(
        "SELECT write_lsn::text, flush_lsn::text, replay_lsn::text FROM pg_stat_replication"
        " WHERE application_name = %s",
        (APP,),
    )
    return await cur.fetchone()


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected


async def _replication_row(conn: psycopg.AsyncConnection) -> tuple[str, str, str] | None:
    cur = await conn.execute(
        "SELECT application_name, state, sync_state FROM pg_stat_replication WHERE sync_state = 'sync'"
    )
    return await cur.fetchone()


async def _reported_flush(conn: psycopg.AsyncConnection, lsn: int) -> bool:
    flush = await scalar(conn, "SELECT flush_lsn::text FROM pg_stat_replication WHERE application_name = %s", (APP,))
    return flush == format_lsn(lsn)


def test_received_bytes_equal_primary_pg_wal(pg: PgServer) -> None:
    async def main() -> None:
        a = await admin(pg)
        conn = await connect_replication(pg.dsn(), APP)
        _, timeline, xlogpos = await identify_system(conn)
        got = Collector(xlogpos)
        stream = ReplicationStream(
            conn, start_lsn=xlogpos, timeline=timeline, slot=None, on_wal=got.on_wal,
            on_batch_end=got.on_batch_end,
        )
        await stream.start()
        try:
            await a.execute("CREATE TABLE t AS SELECT i, repeat('x', 200) AS pad FROM generate_series(1, 20000) i")
            target = await server_flush(a)
            await until(lambda: stream.received_lsn >= target, "the generated WAL")
            assert got.end == stream.received_lsn
            assert got.batches >= 1
            assert stream.server_wal_end >= target
            assert len(got.data) == got.end - got.start > 1_000_000
            assert bytes(got.data) == read_pg_wal(pg, timeline, got.start, got.end)

            # Closing in the middle of a backlog drains what is in flight and ends cleanly.
            conn2 = await connect_replication(pg.dsn(), APP)
            backlog = ReplicationStream(conn2, start_lsn=got.start, timeline=timeline, slot=None, on_wal=lambda s, p: None)
            await backlog.start()
            await until(lambda: backlog.received_lsn > got.start, "the first backlog message")
            await backlog.close()
            await backlog.wait_closed()
            assert conn2.closed
        finally:
            await stream.close()
            await a.close()

    run(main())


def test_removed_segment_error_surfaces_from_wait_closed(pg: PgServer) -> None:
    async def main() -> None:
        a = await admin(pg)
        for i in range(3):
            await a.execute(f"CREATE TABLE t{i} (i int)")
            await a.execute("SELECT pg_switch_wal()")
        await a.execute("CHECKPOINT")
        conn = await connect_replication(pg.dsn(), APP)
        _, timeline, xlogpos = await identify_system(conn)
        try:
            stream = ReplicationStream(conn, start_lsn=0x1000000, timeline=timeline, slot=None, on_wal=lambda s, p: None)
            await stream.start()
            with pytest.raises(ReplicationError, match="has already been removed") as removed:
                await stream.wait_closed()
            assert removed.value.sqlstate == "58P01"
            assert "000000010000000000000001" in str(removed.value)

            # So does a start beyond the server's flush position.
            ahead = ReplicationStream(
                conn, start_lsn=xlogpos + 0x10000000, timeline=timeline, slot=None, on_wal=lambda s, p: None
            )
            await ahead.start()
            with pytest.raises(ReplicationError, match="ahead of the WAL flush position"):
                await ahead.wait_closed()
            await ahead.close()
            assert conn.closed
        finally:
            await conn.close()
            await a.close()

    run(main())


def test_active_slot_fails_at_start_and_callback_errors_end_stream(pg: PgServer) -> None:
    async def main() -> None:
        a = await admin(pg)
        await ensure_slot(a, SLOT)
        first = await connect_replication(pg.dsn(), APP)
        _, timeline, xlogpos = await identify_system(first)

        def explode(start: int, payload: memoryview) -> None:
            raise RuntimeError("consumer failed")

        stream = ReplicationStream(first, start_lsn=xlogpos, timeline=timeline, slot=SLOT, on_wal=explode)
        await stream.start()
        second = await connect_replication(pg.dsn(), APP)
        try:
            other = ReplicationStream(second, start_lsn=xlogpos, timeline=timeline, slot=SLOT, on_wal=explode)
            with pytest.raises(ReplicationError, match="is active for PID") as in_use:
                await other.start()
            assert in_use.value.sqlstate == "55006"
            # The failed START_REPLICATION leaves the connection usable.
            assert (await identify_system(second))[1] == timeline

            await a.execute("CREATE TABLE t (i int)")
            with pytest.raises(RuntimeError, match="consumer failed"):
                await stream.wait_closed()
            assert first.closed
            await until(
                lambda: scalar(a, "SELECT NOT active FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)),
                "the slot to be released",
            )
        finally:
            await stream.close()
            await second.close()
            await a.close()

    run(main())


def test_client_close_is_clean_and_idempotent(pg: PgServer) -> None:
    async def main() -> None:
        conn = await connect_replication(pg.dsn(), APP)
        _, timeline, xlogpos = await identify_system(conn)
        stream = ReplicationStream(conn, start_lsn=xlogpos, timeline=timeline, slot=None, on_wal=lambda s, p: None)
        await stream.start()
        waiter = asyncio.create_task(stream.wait_closed())
        await asyncio.gather(stream.close(), stream.close())
        await stream.close()
        assert await waiter is None
        assert conn.closed
        assert not stream.streaming

    run(main())


def test_idle_stream_requests_replies_and_detects_silence(pg: PgServer) -> None:
    async def main() -> None:
        conn = await connect_replication(pg.dsn(), APP)
        _, timeline, xlogpos = await identify_system(conn)
        chatty = ReplicationStream(
            conn, start_lsn=xlogpos, timeline=timeline, slot=None, on_wal=lambda s, p: None,
            keepalive_interval=0.05,
        )
        await chatty.start()
        quiet_conn = await connect_replication(pg.dsn(), APP)
        quiet = ReplicationStream(
            quiet_conn, start_lsn=xlogpos, timeline=timeline, slot=None, on_wal=lambda s, p: None,
            keepalive_interval=30, server_timeout=0.3,
        )
        await quiet.start()
        try:
            # An idle walsender never pings a client that keeps sending statuses, so the
            # periodic status asks for a reply.
            await until(lambda: chatty.keepalives_received >= 3, "keepalives answering our requests")
            # Without those requests nothing arrives, and the silence ends the stream.
            with pytest.raises(ReplicationError, match="no message from the primary for 0.3 s"):
                await asyncio.wait_for(quiet.wait_closed(), 20)
            assert quiet_conn.closed
            assert chatty.streaming
        finally:
            await chatty.close()
            await quiet.close()

    run(main())


def test_primary_shutdown_waits_for_ack_and_ends_stream(pg: PgServer) -> None:
    async def main() -> None:
        conn = await connect_replication(pg.dsn(), APP)
        _, timeline, xlogpos = await identify_system(conn)
        stream = ReplicationStream(
            conn, start_lsn=xlogpos, timeline=timeline, slot=None, on_wal=lambda s, p: None,
            keepalive_interval=1.0,
        )
        await stream.start()
        stream.send_status(xlogpos, xlogpos, xlogpos)
        stop: asyncio.Task[None] | None = None
        try:
            keepalives, statuses = stream.keepalives_received, stream.statuses_sent
            began = time.monotonic()
            stop = asyncio.create_task(asyncio.to_thread(pg.stop, "fast"))
            # The stopping walsender asks for a reply after every reply until the flush
            # position reaches what it sent; the stream answers at a bounded rate.
            await until(lambda: stream.keepalives_received >= keepalives + 10, "shutdown keepalives")
            elapsed = time.monotonic() - began
            rate = (stream.statuses_sent - statuses) / elapsed
            assert rate < 30, f"{stream.statuses_sent - statuses} statuses in {elapsed:.2f} s"
            assert not stop.done()
            assert stream.received_lsn > xlogpos  # the shutdown checkpoint record

            received = stream.received_lsn
            stream.send_status(received, received, received)
            await asyncio.wait_for(asyncio.shield(stop), 30)
            with pytest.raises(ReplicationError, match="ended the replication stream"):
                await asyncio.wait_for(stream.wait_closed(), 10)
            assert not pg.is_running()
        finally:
            if stop is not None and not stop.done():
                stream.send_status(stream.received_lsn, stream.received_lsn, stream.received_lsn)
                await stop
            await stream.close()

    run(main())


def test_paused_stream_delivers_nothing_until_resumed(pg: PgServer) -> None:
    async def main() -> None:
        a = await admin(pg)
        conn = await connect_replication(pg.dsn(), APP)
        _, timeline, xlogpos = await identify_system(conn)
        got = Collector(xlogpos)
        stream = ReplicationStream(conn, start_lsn=xlogpos, timeline=timeline, slot=None, on_wal=got.on_wal,
                                   on_batch_end=got.on_batch_end)
        await stream.start()
        try:
            stream.pause()
            await a.execute("CREATE TABLE p AS SELECT i FROM generate_series(1, 20000) i")
            target = await server_flush(a)
            # Bounded: while paused nothing may arrive, however long we look.
            await asyncio.sleep(1.0)
            assert stream.received_lsn == xlogpos and got.end == xlogpos
            stream.resume()
            await until(lambda: stream.received_lsn >= target, "the WAL written while paused")
            assert bytes(got.data) == read_pg_wal(pg, timeline, got.start, got.end)
        finally:
            await stream.close()
            await a.close()

    run(main())


@pytest.mark.parametrize("message, match", [
    (b"w" + bytes(20), "XLogData message of 21 bytes"),
    (b"k" + bytes(5), "keepalive message of 6 bytes"),
    (b"k" + bytes(18), "keepalive message of 19 bytes"),
    (b"?", "unexpected replication message type"),
])
def test_a_malformed_message_from_the_primary_is_a_replication_error(message: bytes, match: str) -> None:
    """Not a struct.error logged as an unexpected failure: the term ends with a reason."""
    from sidecar.proposer import replication

    class OneMessage:
        def get_copy_data(self, _async: int) -> tuple[int, bytes]:
            return len(message), message

    stream = ReplicationStream(None, start_lsn=0, timeline=1, slot=None, on_wal=lambda lsn, data: None)  # type: ignore[arg-type]
    stream._state, stream._pg = replication._State.STREAMING, OneMessage()  # type: ignore[assignment]
    stream._loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ReplicationError, match=match):
            stream._drain()
    finally:
        stream._loop.close()

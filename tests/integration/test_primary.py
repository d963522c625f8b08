"""The ordinary SQL side of the primary: settings checks, advisory lock, slots."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import structlog

from support.backends import PgServer
from support.helpers import run, until
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, format_lsn, parse_lsn
from sidecar.proposer.primary import (
    AdvisoryLock,
    PrimaryConfigError,
    advance_slot,
    check_settings,
    ensure_slot,
    read_primary_info,
)

APP = "walsidecar"

pytestmark = pytest.mark.timeout(120)


async def connect(pg: PgServer, **kwargs: Any) -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(pg.dsn(), autocommit=True, **kwargs)


async def scalar(conn: psycopg.AsyncConnection, query: str, params: tuple[Any, ...] = ()) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    return None if row is None else row[0]


# --- settings against a real server --------------------------------------------------------


def test_check_settings_warnings(pg: PgServer) -> None:
    async def main() -> None:
        conn = await connect(pg)
        try:
            (names_warning,) = await check_settings(conn, APP)
            assert "synchronous_standby_names = '' (empty) does not name 'walsidecar'" in names_warning
            assert "ALTER SYSTEM SET synchronous_standby_names = 'walsidecar'; SELECT pg_reload_conf();" in names_warning

            # Follow the advice; a synchronous_commit=local default is the next problem.
            await conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'walsidecar'")
            await conn.execute("ALTER SYSTEM SET synchronous_commit = local")
            await conn.execute("SELECT pg_reload_conf()")
            await until(
                lambda: _new_session_setting(pg, "synchronous_commit", "local"), "the reloaded settings"
            )
            fresh = await connect(pg)
            (commit_warning,) = await check_settings(fresh, APP)
            assert "synchronous_commit is local" in commit_warning
            assert "ALTER SYSTEM SET synchronous_commit = on;" in commit_warning

            await fresh.execute("ALTER ROLE postgres IN DATABASE postgres SET synchronous_commit = off")
            await fresh.execute("ALTER DATABASE template1 SET synchronous_commit = 'off'")
            warnings = await check_settings(fresh, APP)
            assert any(
                "ALTER ROLE postgres IN DATABASE postgres sets synchronous_commit = off" in w
                and "RESET synchronous_commit" in w
                for w in warnings
            )
            assert any("ALTER DATABASE template1 sets synchronous_commit = off" in w for w in warnings)
            await fresh.close()
        finally:
            await conn.close()

    run(main())


async def _new_session_setting(pg: PgServer, name: str, value: str) -> bool:
    async with await connect(pg) as conn:
        return await scalar(conn, "SELECT current_setting(%s)", (name,)) == value


def test_check_settings_refuses_minimal_wal(pg_factory: Callable[..., PgServer]) -> None:
    pg = pg_factory(
        settings={"wal_level": "minimal", "max_wal_senders": "0", "max_replication_slots": "0"}
    )

    async def main() -> None:
        async with await connect(pg) as conn:
            with pytest.raises(PrimaryConfigError) as refused:
                await check_settings(conn, APP)
        message = str(refused.value)
        assert "wal_level is minimal" in message and "ALTER SYSTEM SET wal_level = replica" in message
        assert "max_wal_senders is 0" in message and "ALTER SYSTEM SET max_wal_senders" in message
        assert "max_replication_slots is 0" in message
        assert "restart PostgreSQL" in message

    run(main())


def test_read_primary_info(pg: PgServer) -> None:
    async def main() -> None:
        async with await connect(pg) as conn:
            before = parse_lsn(await scalar(conn, "SELECT pg_current_wal_flush_lsn()::text"))
            info = await read_primary_info(conn)
            after = parse_lsn(await scalar(conn, "SELECT pg_current_wal_flush_lsn()::text"))
        control = pg.run_bin("pg_controldata", "-D", str(pg.data_dir)).stdout
        sysid = next(line.split(":")[1].strip() for line in control.splitlines() if "system identifier" in line)
        assert info.system_id == int(sysid)
        assert info.timeline == 1
        assert before <= info.flush_lsn <= after
        assert info.wal_seg_size == DEFAULT_SEGMENT_SIZE
        assert info.pg_version == 15

    run(main())


# --- advisory lock -------------------------------------------------------------------------


def test_advisory_lock_second_sidecar_waits(pg: PgServer) -> None:
    async def main() -> None:
        first = AdvisoryLock(pg.dsn(), "walsidecar_slot", poll_interval=0.05)
        second = AdvisoryLock(pg.dsn(), "walsidecar_slot", poll_interval=0.05)
        other_slot = AdvisoryLock(pg.dsn(), "another_slot", poll_interval=0.05)
        try:
            assert await first.acquire(wait=False)
            assert first.held and await first.verify()
            assert await first.acquire()  # already held: no second lock
            assert not await second.acquire(wait=False)
            assert await other_slot.acquire(wait=False)

            waiting = asyncio.create_task(second.acquire(wait=True))
            await until(
                lambda: any(e["event"] == "another walsidecar holds the lock on this primary; waiting"
                            for e in logs),
                "the second sidecar to report that it waits",
            )
            (said,) = [e for e in logs if e["event"].startswith("another walsidecar")]
            assert "application_name 'walsidecar lock'" in said["holder"]
            tries = second.attempts
            await until(lambda: second.attempts >= tries + 2, "the second sidecar to poll again")
            assert not waiting.done() and not second.held

            await first.close()
            assert not first.held
            assert await asyncio.wait_for(waiting, 10)
            assert second.held and await second.verify()
            assert not await first.acquire(wait=False)
        finally:
            await first.close()
            await second.close()
            await other_slot.close()

    with structlog.testing.capture_logs() as logs:
        run(main())


# --- slots ---------------------------------------------------------------------------------


def test_ensure_slot_creates_then_reuses_and_advance_only_moves_forward(pg: PgServer) -> None:
    async def main() -> None:
        async with await connect(pg, options="-c synchronous_commit=local") as conn:
            restart = await ensure_slot(conn, "horizon")
            row = await (await conn.execute(
                "SELECT slot_type, restart_lsn::text, active FROM pg_replication_slots WHERE slot_name = 'horizon'"
            )).fetchone()
            assert row == ("physical", format_lsn(restart), False)
            assert restart > 0

            await conn.execute("CREATE TABLE t AS SELECT generate_series(1, 10000) AS i")
            assert await ensure_slot(conn, "horizon") == restart  # reused, not recreated
            assert await scalar(conn, "SELECT count(*) FROM pg_replication_slots") == 1

            flush = parse_lsn(await scalar(conn, "SELECT pg_current_wal_flush_lsn()::text"))
            target = restart + (flush - restart) // 2
            assert await advance_slot(conn, "horizon", target) == target
            assert await advance_slot(conn, "horizon", restart) == target  # never backwards
            assert await scalar(
                conn, "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = 'horizon'"
            ) == format_lsn(target)
            # The server does not move a slot past its own flush position.
            assert await advance_slot(conn, "horizon", flush + 0x100000000) <= flush + 0x100000000
            assert parse_lsn(await scalar(
                conn, "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = 'horizon'"
            )) <= parse_lsn(await scalar(conn, "SELECT pg_current_wal_flush_lsn()::text"))

            with pytest.raises(PrimaryConfigError, match="does not exist"):
                await advance_slot(conn, "missing", target)
            with pytest.raises(ValueError):
                await ensure_slot(conn, "Not A Slot")

    run(main())

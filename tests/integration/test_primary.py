"""The ordinary SQL side of the primary: settings checks, advisory lock, slots."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from support.backends import PgServer
from support.helpers import run, until
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, format_lsn, parse_lsn
from sidecar.proposer.primary import (
    AdvisoryLock,
    PrimaryConfigError,
    SyncStandbyConfig,
    SyncStandbyNamesError,
    advance_slot,
    check_settings,
    ensure_slot,
    parse_synchronous_standby_names,
    read_primary_info,
    sidecar_is_required,
    standby_name_matches,
    standby_names_warnings,
)

APP = "walsidecar"

pytestmark = pytest.mark.timeout(120)


async def connect(pg: PgServer, **kwargs: Any) -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(pg.dsn(), autocommit=True, **kwargs)


async def scalar(conn: psycopg.AsyncConnection, query: str, params: tuple[Any, ...] = ()) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    return None if row is None else row[0]


# --- synchronous_standby_names parsing (pure) ----------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("walsidecar", SyncStandbyConfig("priority", 1, ("walsidecar",))),
        ("  a , b,c ", SyncStandbyConfig("priority", 1, ("a", "b", "c"))),
        ("FIRST 2 (a, walsidecar)", SyncStandbyConfig("priority", 2, ("a", "walsidecar"))),
        ("first 1(walsidecar)", SyncStandbyConfig("priority", 1, ("walsidecar",))),
        ("ANY 2 (s1, s2, walsidecar)", SyncStandbyConfig("quorum", 2, ("s1", "s2", "walsidecar"))),
        ("any 1 (\"Wal Sidecar\", \"x\"\"y\")", SyncStandbyConfig("quorum", 1, ("Wal Sidecar", 'x"y'))),
        ("2 (a, b)", SyncStandbyConfig("priority", 2, ("a", "b"))),
        ("*", SyncStandbyConfig("priority", 1, ("*",))),
        ('"any"', SyncStandbyConfig("priority", 1, ("any",))),
        ("1, s$2", SyncStandbyConfig("priority", 1, ("1", "s$2"))),
    ],
)
def test_parse_synchronous_standby_names(value: str, expected: SyncStandbyConfig) -> None:
    assert parse_synchronous_standby_names(value) == expected


@pytest.mark.parametrize("value", ["", "   "])
def test_parse_empty_standby_names(value: str) -> None:
    assert parse_synchronous_standby_names(value) is None


@pytest.mark.parametrize(
    "value",
    ["FIRST (a)", "ANY 1 a", "ANY 1 (a", "a,", "a b", "wal-sidecar", '"open', "FIRST 0 (a)", "(a)", "any"],
)
def test_parse_bad_standby_names(value: str) -> None:
    with pytest.raises(SyncStandbyNamesError):
        parse_synchronous_standby_names(value)


def test_standby_name_matching_and_requirement() -> None:
    def cfg(v: str) -> SyncStandbyConfig | None:
        return parse_synchronous_standby_names(v)

    assert standby_name_matches(cfg("WalSidecar"), APP)  # names match case-insensitively
    assert standby_name_matches(cfg('"WALSIDECAR"'), APP)
    assert standby_name_matches(cfg("other, *"), APP)
    assert not standby_name_matches(cfg("other"), APP)
    assert not standby_name_matches(None, APP)

    assert sidecar_is_required(cfg("walsidecar"), APP)
    assert sidecar_is_required(cfg("FIRST 2 (other, walsidecar)"), APP)
    assert sidecar_is_required(cfg("ANY 2 (other, walsidecar)"), APP)
    assert not sidecar_is_required(cfg("walsidecar, other"), APP)  # other takes over if we drop
    assert not sidecar_is_required(cfg("ANY 1 (other, walsidecar)"), APP)
    assert not sidecar_is_required(cfg("*"), APP)
    assert not sidecar_is_required(cfg("other"), APP)


def test_standby_names_warnings_tell_what_to_run() -> None:
    assert standby_names_warnings("walsidecar", APP) == []
    assert standby_names_warnings("ANY 2 (walsidecar, x)", APP) == []

    (missing,) = standby_names_warnings("", APP)
    assert "does not name 'walsidecar'" in missing
    assert "ALTER SYSTEM SET synchronous_standby_names = 'walsidecar'; SELECT pg_reload_conf();" in missing

    (quoted,) = standby_names_warnings("other", "wal-sidecar")
    assert "ALTER SYSTEM SET synchronous_standby_names = '\"wal-sidecar\"';" in quoted

    (bad,) = standby_names_warnings("ANY 1 (a", APP)
    assert "does not parse" in bad and "ALTER SYSTEM SET" in bad

    (shared,) = standby_names_warnings("ANY 1 (walsidecar, other)", APP)
    assert "lets other standbys release a commit" in shared

    (impossible,) = standby_names_warnings("FIRST 3 (walsidecar, other)", APP)
    assert "wait forever" in impossible


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


def test_advisory_lock_second_sidecar_waits(pg: PgServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.proposer.primary")

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
                lambda: "another walsidecar holds the lock on this primary; waiting" in caplog.text,
                "the second sidecar to report that it waits",
            )
            assert "application_name 'walsidecar lock'" in caplog.text
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

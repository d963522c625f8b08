"""The ordinary SQL side of the primary: its pool, settings checks, the advisory lock, slots and the poller.

The replication protocol (the stream, IDENTIFY_SYSTEM, timeline histories) is in `replication.py`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_fixed

from sidecar.logs import module_logger
from sidecar.lsn import INVALID_LSN, format_lsn, parse_lsn
from sidecar.pgrepl import check_slot_name
from sidecar.consensus.commitwait import WaiterKey
from sidecar.proposer.syncrep import sql_literal, standby_names_warnings

log = module_logger(role="proposer")

# First key of the two-key advisory lock ("WALS"); the second is hashtext(slot name).
ADVISORY_LOCK_CLASS = 0x57414C53

POOL_TIMEOUT = 10.0  # waiting for a pooled connection; also bounds one poll
PRIMARY_POLL = 1.0
PRIMARY_RETRY = 5.0


@dataclass(frozen=True)
class PrimaryInfo:
    """Identity and position of the primary, read over an ordinary connection."""

    system_id: int
    timeline: int
    flush_lsn: int
    wal_seg_size: int
    pg_version: int  # server_version_num // 10000, e.g. 15


class PrimaryConfigError(Exception):
    """The primary cannot serve walsidecar as configured; the message says how to fix it."""


def catchup_slot(slot: str) -> str:
    """The slot that keeps the WAL some safekeeper still lacks, so it can catch up from pg_wal."""
    return f"{slot}_horizon"


def sql_pool(dsn: str, application_name: str) -> AsyncConnectionPool:
    """A small pool for the ordinary SQL (checks, slots, the poller); open it with `async with`.

    Connections are checked when taken out, so one broken by a primary restart is replaced, not
    handed over. The advisory lock is not in here: see `AdvisoryLock`.
    """
    # While the primary is away the pool would print each failed connection attempt; its users
    # get the failure (PoolTimeout) and the service logs why the primary is unreachable.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    return AsyncConnectionPool(
        dsn, min_size=1, max_size=3, open=False, name=f"{application_name} sql", timeout=POOL_TIMEOUT,
        check=AsyncConnectionPool.check_connection,
        kwargs={"autocommit": True, "connect_timeout": 5, "application_name": f"{application_name} sql"})


def quote_ident(name: str) -> str:
    """`name` as an SQL identifier: quoted unless PostgreSQL would read it unchanged."""
    if re.fullmatch(r"[a-z_][a-z_0-9$]*", name):
        return name
    return '"' + name.replace('"', '""') + '"'


async def read_primary_info(conn: psycopg.AsyncConnection) -> PrimaryInfo:
    """Read system id, current timeline, flush LSN, segment size and major version."""
    cur = await conn.execute(
        """
        SELECT pg_is_in_recovery(),
               (SELECT system_identifier FROM pg_control_system()),
               (SELECT setting FROM pg_settings WHERE name = 'wal_segment_size'),
               current_setting('server_version_num')
        """
    )
    row = await cur.fetchone()
    assert row is not None
    in_recovery, system_id, seg_size, version_num = row
    if in_recovery:
        raise PrimaryConfigError(
            "the server is a standby (pg_is_in_recovery() is true): point walsidecar at the primary"
        )
    # pg_walfile_name() names the file with the insert timeline, which is current right after a
    # promotion, while pg_control_checkpoint() lags until the next checkpoint.
    cur = await conn.execute(
        "SELECT pg_walfile_name(l), l::text FROM (SELECT pg_current_wal_flush_lsn() AS l) s"
    )
    row = await cur.fetchone()
    assert row is not None
    walfile, flush_text = row
    return PrimaryInfo(
        system_id=int(system_id),
        timeline=int(walfile[:8], 16),
        flush_lsn=parse_lsn(flush_text),
        wal_seg_size=int(seg_size),
        pg_version=int(version_num) // 10000,
    )


# --- settings check ----------------------------------------------------------------------

_WEAK_SYNC_COMMIT = ("off", "local")


async def check_settings(conn: psycopg.AsyncConnection, application_name: str) -> list[str]:
    """Raise PrimaryConfigError if the primary cannot stream to walsidecar; return warnings."""
    cur = await conn.execute(
        """
        SELECT name, setting FROM pg_settings
        WHERE name IN ('wal_level', 'max_wal_senders', 'max_replication_slots',
                       'synchronous_standby_names', 'synchronous_commit', 'server_version_num')
        """
    )
    settings = {name: setting for name, setting in await cur.fetchall()}

    errors: list[str] = []
    if int(settings["server_version_num"]) < 150000:
        errors.append(
            f"PostgreSQL {int(settings['server_version_num']) // 10000} is too old: walsidecar needs 15 or later"
        )
    if settings["wal_level"] == "minimal":
        errors.append(
            "wal_level is minimal, which cannot stream WAL. Run: ALTER SYSTEM SET wal_level = replica; "
            "then restart PostgreSQL"
        )
    if int(settings["max_wal_senders"]) == 0:
        errors.append(
            "max_wal_senders is 0, so no replication connection is allowed. Run: "
            "ALTER SYSTEM SET max_wal_senders = 10; then restart PostgreSQL"
        )
    if int(settings["max_replication_slots"]) == 0:
        errors.append(
            "max_replication_slots is 0, so walsidecar cannot create its slot. Run: "
            "ALTER SYSTEM SET max_replication_slots = 10; then restart PostgreSQL"
        )
    if errors:
        raise PrimaryConfigError("the primary is not configured for walsidecar:\n  " + "\n  ".join(errors))

    warnings = standby_names_warnings(settings["synchronous_standby_names"], application_name)
    if settings["synchronous_commit"] in _WEAK_SYNC_COMMIT:
        warnings.append(
            f"synchronous_commit is {settings['synchronous_commit']}: commits return before the "
            "safekeeper quorum has the WAL. Run: ALTER SYSTEM SET synchronous_commit = on; "
            "SELECT pg_reload_conf();"
        )
    # Per-role and per-database overrides are invisible to this session but apply to the
    # applications' sessions.
    cur = await conn.execute(
        """
        SELECT r.rolname, d.datname, c
        FROM pg_db_role_setting s
        LEFT JOIN pg_roles r ON r.oid = s.setrole
        LEFT JOIN pg_database d ON d.oid = s.setdatabase,
        unnest(s.setconfig) AS c
        WHERE lower(c) LIKE 'synchronous\\_commit=%'
        """
    )
    for rolname, datname, setting in await cur.fetchall():
        value = setting.split("=", 1)[1].strip().lower()
        if value not in _WEAK_SYNC_COMMIT:
            continue
        if rolname and datname:
            target = f"ALTER ROLE {quote_ident(rolname)} IN DATABASE {quote_ident(datname)}"
        elif rolname:
            target = f"ALTER ROLE {quote_ident(rolname)}"
        else:
            target = f"ALTER DATABASE {quote_ident(datname)}"
        warnings.append(
            f"{target} sets synchronous_commit = {value}: those sessions do not wait for the "
            f"safekeeper quorum. Run: {target} RESET synchronous_commit;"
        )
    return warnings


# --- advisory lock -----------------------------------------------------------------------


class AdvisoryLock:
    """A session advisory lock on a dedicated connection: one walsidecar per primary and slot.

    Advisory locks are per database, so every sidecar must connect to the same database.
    The lock lives as long as its session, so it never goes through the pool (a pooled
    connection is reset and handed to others). A primary restart ends the session: `verify()`
    says so, the service ends its terms and attaches again (its tenacity retry backs off while
    the primary is away), and takes the lock afresh on a new connection before the next term.
    """

    def __init__(
        self,
        dsn: str,
        slot: str,
        *,
        application_name: str = "walsidecar",
        poll_interval: float = 1.0,
    ) -> None:
        self.dsn = dsn
        self.slot = check_slot_name(slot)
        self.application_name = f"{application_name} lock"
        self.poll_interval = poll_interval
        self._conn: psycopg.AsyncConnection | None = None
        self._held = False
        self.attempts = 0

    @property
    def held(self) -> bool:
        """True once acquired, until close() or the connection is found broken."""
        return self._held and self._conn is not None and not self._conn.closed

    async def connect(self) -> None:
        """Open the lock's own session (if not open): the lock is taken on it by `acquire`."""
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, application_name=self.application_name
            )

    async def acquire(self, wait: bool = True) -> bool:
        """Take the lock; with `wait`, poll until it is free. Returns whether it is held."""
        if self.held:
            return True
        await self.connect()
        assert self._conn is not None
        logged = False
        while True:
            self.attempts += 1
            cur = await self._conn.execute(
                "SELECT pg_try_advisory_lock(%s, hashtext(%s))", (ADVISORY_LOCK_CLASS, self.slot)
            )
            row = await cur.fetchone()
            if row is not None and row[0]:
                self._held = True
                if logged:
                    log.info("acquired the walsidecar lock on this primary", slot=self.slot)
                return True
            if not wait:
                return False
            if not logged:
                holder = await self.holder()
                log.warning("another walsidecar holds the lock on this primary; waiting", slot=self.slot,
                            holder=holder or "unknown")
                logged = True
            await asyncio.sleep(self.poll_interval)

    async def holder(self) -> str | None:
        """Describe the backend holding the lock (pid, application_name, client address), if any."""
        assert self._conn is not None
        cur = await self._conn.execute(
            """
            SELECT a.pid, a.application_name, a.client_addr::text
            FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid = %s::bigint::oid AND l.objid = (hashtext(%s)::bigint & 4294967295)::oid
            """,
            (ADVISORY_LOCK_CLASS, self.slot),
        )
        row = await cur.fetchone()
        if row is None:
            return None
        pid, app, addr = row
        return f"pid {pid} application_name {app!r} from {addr or 'local socket'}"

    async def verify(self) -> bool:
        """Check with the server that this session still holds the lock."""
        if not self.held:
            return False
        assert self._conn is not None
        try:
            cur = await self._conn.execute(
                """
                SELECT count(*) FROM pg_locks
                WHERE pid = pg_backend_pid() AND locktype = 'advisory' AND granted AND objsubid = 2
                  AND classid = %s::bigint::oid AND objid = (hashtext(%s)::bigint & 4294967295)::oid
                """,
                (ADVISORY_LOCK_CLASS, self.slot),
            )
            row = await cur.fetchone()
        except psycopg.OperationalError:
            self._held = False
            return False
        self._held = row is not None and row[0] > 0
        return self._held

    async def close(self) -> None:
        """Release the lock by closing its connection; idempotent."""
        self._held = False
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


# --- slots -------------------------------------------------------------------------------


async def _slot_row(conn: psycopg.AsyncConnection, slot: str) -> tuple[str, str | None, str | None] | None:
    cur = await conn.execute(
        "SELECT slot_type, restart_lsn::text, wal_status FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    )
    return await cur.fetchone()


def _restart_lsn_of(slot: str, row: tuple[str, str | None, str | None]) -> int:
    slot_type, restart, wal_status = row
    if slot_type != "physical":
        raise PrimaryConfigError(
            f"replication slot {slot!r} is a {slot_type} slot; walsidecar needs a physical one. "
            f"Pick another slot name, or drop it: SELECT pg_drop_replication_slot({sql_literal(slot)});"
        )
    if wal_status == "lost":
        raise PrimaryConfigError(
            f"replication slot {slot!r} was invalidated (its WAL was removed, see max_slot_wal_keep_size). "
            f"Drop it so walsidecar recreates it: SELECT pg_drop_replication_slot({sql_literal(slot)});"
        )
    return parse_lsn(restart) if restart else INVALID_LSN


async def ensure_slot(conn: psycopg.AsyncConnection, slot: str) -> int:
    """Create the physical slot with reserved WAL if missing; return its restart_lsn (0 if it has none)."""
    check_slot_name(slot)
    row = await _slot_row(conn, slot)
    if row is None:
        try:
            cur = await conn.execute(
                "SELECT lsn::text FROM pg_create_physical_replication_slot(%s, true)", (slot,)
            )
            created = await cur.fetchone()
            assert created is not None
            log.info("created physical replication slot", slot=slot, restart_lsn=created[0])
            return parse_lsn(created[0])
        except psycopg.errors.DuplicateObject:
            # Created concurrently: read what is there now.
            row = await _slot_row(conn, slot)
            if row is None:
                raise
    return _restart_lsn_of(slot, row)


async def advance_slot(conn: psycopg.AsyncConnection, slot: str, lsn: int) -> int:
    """Move an inactive slot's restart_lsn forward to `lsn` (never back); return the new restart_lsn."""
    check_slot_name(slot)
    row = await _slot_row(conn, slot)
    if row is None:
        raise PrimaryConfigError(f"replication slot {slot!r} does not exist")
    current = _restart_lsn_of(slot, row)
    if lsn <= current:
        return current
    if current == INVALID_LSN:
        raise PrimaryConfigError(
            f"replication slot {slot!r} has never reserved WAL, so it cannot be advanced; "
            f"drop it so walsidecar recreates it: SELECT pg_drop_replication_slot({sql_literal(slot)});"
        )
    # The server clamps the target to its own flush position.
    cur = await conn.execute(
        "SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)",
        (slot, format_lsn(lsn)),
    )
    result = await cur.fetchone()
    assert result is not None
    return parse_lsn(result[0])


# --- what commits wait for --------------------------------------------------------------


@dataclass(frozen=True)
class SyncRepState:
    """The primary's flush position, the commits waiting in SyncRep, and the sidecar's walsender."""

    flush_lsn: int
    commits_waiting: int
    oldest_wait_seconds: float | None  # None: no commit waits
    replication_state: str | None  # None: no walsender of that name
    sync_state: str | None
    sidecar_flush_lsn: int | None


async def read_syncrep_state(conn: psycopg.AsyncConnection, application_name: str) -> SyncRepState:
    """One look at what commits wait for (the proposer's poller, `walsidecar status` and `check`)."""
    cur = await conn.execute(
        """
        SELECT pg_current_wal_flush_lsn()::text,
               (SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'),
               (SELECT extract(epoch FROM max(now() - query_start))::float8
                  FROM pg_stat_activity WHERE wait_event = 'SyncRep'),
               r.state, r.sync_state, r.flush_lsn::text
        FROM (SELECT 1) one
        LEFT JOIN LATERAL (SELECT state, sync_state, flush_lsn FROM pg_stat_replication
                           WHERE application_name = %s LIMIT 1) r ON true
        """, (application_name,))
    row = await cur.fetchone()
    assert row is not None
    flush, waiting, oldest, state, sync_state, sidecar_flush = row
    return SyncRepState(parse_lsn(flush), int(waiting), oldest, state, sync_state,
                        parse_lsn(sidecar_flush) if sidecar_flush else None)


# --- commits waiting in SyncRep, and ending them ------------------------------------------


@dataclass(frozen=True)
class SyncRepWaiter:
    """A backend whose commit waits in SyncRep: `key` names this wait, `xid` its transaction."""

    key: WaiterKey
    xid: str | None  # pg_xact_status(xid) later says whether it committed
    user: str | None
    application_name: str | None
    client_addr: str | None
    flush_lsn: int  # the primary's flush position when it was seen: its commit record is at or below it


async def read_syncrep_waiters(conn: psycopg.AsyncConnection) -> list[SyncRepWaiter]:
    """The commits waiting in SyncRep now (every role's only with pg_monitor or pg_read_all_stats)."""
    # The transaction keeps its xid while it waits: the commit record is written, ProcArray not yet cleared.
    cur = await conn.execute(
        """
        SELECT pid, backend_start::text, query_start::text, backend_xid::text, usename, application_name,
               host(client_addr), pg_current_wal_flush_lsn()::text
        FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND pid <> pg_backend_pid()
        ORDER BY query_start
        """)
    return [SyncRepWaiter(WaiterKey(pid, started or "", query or ""), xid, user, app, addr, parse_lsn(flush))
            for pid, started, query, xid, user, app, addr, flush in await cur.fetchall()]


async def terminate_waiter(conn: psycopg.AsyncConnection, key: WaiterKey) -> bool:
    """pg_terminate_backend the backend of this very wait, if it still waits; True once signalled.

    Never pg_cancel_backend: a cancelled SyncRep wait tells the client its commit succeeded.
    Raises psycopg.Error when the role may not (pg_signal_backend cannot end a superuser's backend).
    """
    cur = await conn.execute(
        """
        SELECT pg_terminate_backend(pid) FROM pg_stat_activity
        WHERE pid = %s AND backend_start::text = %s AND query_start::text = %s AND wait_event = 'SyncRep'
        """, (key.pid, key.backend_start, key.query_start))
    row = await cur.fetchone()
    return bool(row and row[0])


# --- the poller --------------------------------------------------------------------------


@dataclass
class PrimarySnapshot:
    """What the last poll of the primary saw (None fields: unknown)."""

    polled_at: float | None = None
    error: str | None = None
    flush_lsn: int | None = None
    commits_waiting: int | None = None
    oldest_wait_seconds: float | None = None
    sync_state: str | None = None
    replication_state: str | None = None
    slots: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Backends the sidecar terminated in SyncRep, by reason (no-quorum: --commit-wait; lineage-ended).
    commits_terminated: dict[str, int] = field(default_factory=dict)


class PrimaryPoller:
    """Polls what the operator sees of the primary: flush, SyncRep waiters, our walsender, our slots."""

    def __init__(self, pool: AsyncConnectionPool, application_name: str, slots: tuple[str, ...],
                 snapshot: PrimarySnapshot | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.application_name, self.slots, self.clock = pool, application_name, slots, clock
        self.snapshot = snapshot if snapshot is not None else PrimarySnapshot()

    async def run(self) -> None:
        """Poll every PRIMARY_POLL seconds; after a failure wait PRIMARY_RETRY, with the error in the snapshot."""
        # Any failure: observing must never stop the proposer, and the next poll may work.
        async for attempt in AsyncRetrying(wait=wait_fixed(PRIMARY_RETRY), before_sleep=self._failed,
                                           retry=retry_if_exception_type(Exception)):
            with attempt:
                while True:
                    await asyncio.wait_for(self.poll(), timeout=POOL_TIMEOUT)
                    await asyncio.sleep(PRIMARY_POLL)

    def _failed(self, state: RetryCallState) -> None:
        e = state.outcome.exception() if state.outcome is not None else None
        self.snapshot.error = str(e).strip() or type(e).__name__
        self.snapshot.polled_at = self.clock()

    async def poll(self) -> None:
        async with self.pool.connection() as conn:
            state = await read_syncrep_state(conn, self.application_name)
            cur = await conn.execute(
                """
                SELECT slot_name, wal_status, safe_wal_size, active,
                       pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint
                FROM pg_replication_slots WHERE slot_name = ANY(%s)
                """, (list(self.slots),))
            slots = {name: {"wal_status": status, "safe_wal_size": safe, "active": active, "retained_bytes": kept}
                     for name, status, safe, active, kept in await cur.fetchall()}
        p = self.snapshot
        p.flush_lsn, p.commits_waiting, p.oldest_wait_seconds = state.flush_lsn, state.commits_waiting, \
            state.oldest_wait_seconds
        p.sync_state, p.replication_state = state.sync_state, state.replication_state
        p.slots, p.error, p.polled_at = slots, None, self.clock()

"""The ordinary SQL side of the primary: settings checks, the advisory lock and slots."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Literal

import psycopg

from sidecar.lsn import INVALID_LSN, format_lsn, parse_lsn

log = logging.getLogger(__name__)

# First key of the two-key advisory lock ("WALS"); the second is hashtext(slot name).
ADVISORY_LOCK_CLASS = 0x57414C53

_SLOT_NAME_RE = re.compile(r"^[a-z0-9_]{1,63}$")


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


def check_slot_name(slot: str) -> str:
    """Return `slot` if PostgreSQL accepts it as a replication slot name, else raise ValueError."""
    if not _SLOT_NAME_RE.match(slot):
        raise ValueError(
            f"invalid replication slot name {slot!r}: use 1-63 lower-case letters, digits and underscores"
        )
    return slot


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


# --- synchronous_standby_names -------------------------------------------------------------


@dataclass(frozen=True)
class SyncStandbyConfig:
    """A parsed synchronous_standby_names value."""

    method: Literal["priority", "quorum"]
    num_sync: int
    names: tuple[str, ...]


class SyncStandbyNamesError(ValueError):
    """synchronous_standby_names does not parse."""


_TOKEN_RE = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<quoted>"(?:[^"]|"")*")
  | (?P<ident>[A-Za-z\x80-\U0010FFFF_][A-Za-z\x80-\U0010FFFF_0-9$]*)
  | (?P<num>[0-9]+)
  | (?P<punct>[*,()])
    """,
    re.VERBOSE,
)


def _tokenize(value: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(value):
        m = _TOKEN_RE.match(value, pos)
        if not m:
            if value[pos] == '"':
                raise SyncStandbyNamesError("unterminated quoted identifier")
            raise SyncStandbyNamesError(f"unexpected character {value[pos]!r} at position {pos}")
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        text = m.group()
        if kind == "space":
            continue
        if kind == "quoted":
            tokens.append(("name", text[1:-1].replace('""', '"')))
        elif kind == "ident":
            # Same as syncrep_scanner.l: ANY and FIRST are keywords unless quoted.
            upper = text.upper()
            tokens.append((upper.lower(), text) if upper in ("ANY", "FIRST") else ("name", text))
        elif kind == "num":
            tokens.append(("num", text))
        elif text == "*":
            tokens.append(("name", "*"))
        else:
            tokens.append((text, text))
    return tokens


def parse_synchronous_standby_names(value: str) -> SyncStandbyConfig | None:
    """Parse as PostgreSQL's syncrep grammar does; None when the setting is empty."""
    tokens = _tokenize(value)
    if not tokens:
        return None
    pos = 0

    def peek(offset: int = 0) -> str | None:
        i = pos + offset
        return tokens[i][0] if i < len(tokens) else None

    method: Literal["priority", "quorum"] = "priority"
    num_sync = 1
    parenthesized = False
    if peek() in ("any", "first"):
        method = "quorum" if peek() == "any" else "priority"
        if peek(1) != "num" or peek(2) != "(":
            raise SyncStandbyNamesError(f"expected a number and '(' after {tokens[pos][1]}")
        num_sync = int(tokens[pos + 1][1])
        pos += 3
        parenthesized = True
    elif peek() == "num" and peek(1) == "(":
        # The pre-9.6 form "n (a, b)" is FIRST n.
        num_sync = int(tokens[pos][1])
        pos += 2
        parenthesized = True

    names: list[str] = []
    while True:
        kind = peek()
        if kind not in ("name", "num"):
            raise SyncStandbyNamesError("expected a standby name")
        names.append(tokens[pos][1])
        pos += 1
        if peek() == ",":
            pos += 1
            continue
        break
    if parenthesized:
        if peek() != ")":
            raise SyncStandbyNamesError("expected ')'")
        pos += 1
    if pos != len(tokens):
        raise SyncStandbyNamesError(f"unexpected {tokens[pos][1]!r} after the standby list")
    if num_sync <= 0:
        raise SyncStandbyNamesError(f"number of synchronous standbys ({num_sync}) must be greater than zero")
    return SyncStandbyConfig(method=method, num_sync=num_sync, names=tuple(names))


def standby_name_matches(config: SyncStandbyConfig | None, application_name: str) -> bool:
    """True if `application_name` is one of the listed synchronous standbys (case-insensitive, or '*')."""
    if config is None:
        return False
    return any(n == "*" or n.lower() == application_name.lower() for n in config.names)


def sidecar_is_required(config: SyncStandbyConfig | None, application_name: str) -> bool:
    """True if no set of other standbys can release a commit without `application_name`."""
    if not standby_name_matches(config, application_name):
        return False
    assert config is not None
    if "*" in config.names:
        # '*' matches every standby, so any other walsender can take the sidecar's place.
        return False
    # Every listed name must be waited for: n >= number of listed standbys.
    return config.num_sync >= len(config.names)


def _quote_standby_name(name: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z_0-9$]*", name) and name.upper() not in ("ANY", "FIRST"):
        return name
    return '"' + name.replace('"', '""') + '"'


def _quote_ident(name: str) -> str:
    if re.fullmatch(r"[a-z_][a-z_0-9$]*", name):
        return name
    return '"' + name.replace('"', '""') + '"'


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _set_standby_names_hint(application_name: str) -> str:
    value = _sql_literal(_quote_standby_name(application_name))
    return f"ALTER SYSTEM SET synchronous_standby_names = {value}; SELECT pg_reload_conf();"


def standby_names_warnings(value: str, application_name: str) -> list[str]:
    """Warnings about a synchronous_standby_names value for a sidecar named `application_name`."""
    hint = _set_standby_names_hint(application_name)
    try:
        config = parse_synchronous_standby_names(value)
    except SyncStandbyNamesError as exc:
        return [
            f"synchronous_standby_names = {_sql_literal(value)} does not parse ({exc}), so commits "
            f"do not wait for the safekeeper quorum. Run: {hint}"
        ]
    if not standby_name_matches(config, application_name):
        shown = _sql_literal(value) if value.strip() else "'' (empty)"
        return [
            f"synchronous_standby_names = {shown} does not name {application_name!r}: commits do not "
            f"wait for the safekeeper quorum and can be lost on failover. Run: {hint}"
        ]
    assert config is not None
    if config.num_sync > len(config.names) and "*" not in config.names:
        return [
            f"synchronous_standby_names = {_sql_literal(value)} asks for {config.num_sync} synchronous "
            f"standbys but lists only {len(config.names)}, so commits wait forever. Run: {hint}"
        ]
    if not sidecar_is_required(config, application_name):
        return [
            f"synchronous_standby_names = {_sql_literal(value)} lets other standbys release a commit "
            f"without {application_name!r}, so an acknowledged commit may not be on a safekeeper "
            f"quorum. To wait for the quorum on every commit, run: {hint}"
        ]
    return []


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
            target = f"ALTER ROLE {_quote_ident(rolname)} IN DATABASE {_quote_ident(datname)}"
        elif rolname:
            target = f"ALTER ROLE {_quote_ident(rolname)}"
        else:
            target = f"ALTER DATABASE {_quote_ident(datname)}"
        warnings.append(
            f"{target} sets synchronous_commit = {value}: those sessions do not wait for the "
            f"safekeeper quorum. Run: {target} RESET synchronous_commit;"
        )
    return warnings


# --- advisory lock -----------------------------------------------------------------------


class AdvisoryLock:
    """A session advisory lock on a dedicated connection: one walsidecar per primary and slot.

    Advisory locks are per database, so every sidecar must connect to the same database.
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

    async def acquire(self, wait: bool = True) -> bool:
        """Take the lock; with `wait`, poll until it is free. Returns whether it is held."""
        if self.held:
            return True
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, application_name=self.application_name
            )
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
                    log.info("acquired the walsidecar lock on this primary for slot %s", self.slot)
                return True
            if not wait:
                return False
            if not logged:
                holder = await self.holder()
                log.warning(
                    "another walsidecar holds the lock on this primary; waiting (slot %s, holder %s)",
                    self.slot,
                    holder or "unknown",
                )
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
            f"Pick another slot name, or drop it: SELECT pg_drop_replication_slot({_sql_literal(slot)});"
        )
    if wal_status == "lost":
        raise PrimaryConfigError(
            f"replication slot {slot!r} was invalidated (its WAL was removed, see max_slot_wal_keep_size). "
            f"Drop it so walsidecar recreates it: SELECT pg_drop_replication_slot({_sql_literal(slot)});"
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
            log.info("created physical replication slot %s at %s", slot, created[0])
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
            f"drop it so walsidecar recreates it: SELECT pg_drop_replication_slot({_sql_literal(slot)});"
        )
    # The server clamps the target to its own flush position.
    cur = await conn.execute(
        "SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)",
        (slot, format_lsn(lsn)),
    )
    result = await cur.fetchone()
    assert result is not None
    return parse_lsn(result[0])

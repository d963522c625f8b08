"""`walsidecar init-postgres`: run sql/install.sql (or uninstall.sql) and say what needs a restart."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from sidecar.config import InitPostgresSettings
from sidecar.ops.probe import redact_dsn
from sidecar.proposer import syncrep

TOUCHED = ("wal_level", "max_wal_senders", "max_replication_slots", "max_slot_wal_keep_size",
           "synchronous_standby_names")
RELOAD_WAIT = 10.0


class InitError(Exception):
    """The SQL could not be applied; the message has psql's error."""


def find_sql_dir(given: Path | None) -> Path:
    """sql/ next to the package (run from a checkout) or share/walsidecar/sql of an installed package."""
    candidates = [given] if given else []
    candidates += [Path(__file__).resolve().parents[2] / "sql", Path(sys.prefix) / "share" / "walsidecar" / "sql"]
    for c in candidates:
        if c is not None and (c / "install.sql").is_file():
            return c
    raise InitError("install.sql not found in " + ", ".join(str(c) for c in candidates) + "; pass --sql-dir")


def find_psql() -> str:
    from sidecar.pgcluster import ClusterError, find_bin_dir
    try:
        path = find_bin_dir() / "psql"
        if path.is_file():
            return str(path)
    except ClusterError:
        pass
    found = shutil.which("psql")
    if found is None:
        raise InitError("psql not found: install the PostgreSQL client (postgresql-client-15)")
    return found


def _settings(conn: psycopg.Connection) -> dict[str, dict[str, Any]]:
    rows = conn.execute(
        """SELECT s.name, current_setting(s.name), s.context, s.pending_restart,
                  (SELECT f.setting FROM pg_file_settings f WHERE f.name = s.name
                    ORDER BY f.seqno DESC LIMIT 1)
             FROM pg_settings s WHERE s.name = ANY(%s)""", (list(TOUCHED),)).fetchall()
    return {name: {"value": value, "context": context, "pending_restart": pending, "file": file}
            for name, value, context, pending, file in rows}


def _same(a: str | None, b: str | None) -> bool:
    norm = (lambda v: (v or "").strip().strip("'").lower())
    return norm(a) == norm(b)


def run_init(s: InitPostgresSettings) -> int:
    """Apply the SQL, wait for the reload, print one line per step; 1 on failure."""
    try:
        return _run(s)
    except (InitError, psycopg.Error) as e:
        print(f"init-postgres failed: {str(e).strip()}", file=sys.stderr)
        return 1


def _run(s: InitPostgresSettings) -> int:
    sql_dir = find_sql_dir(s.sql_dir)
    script = sql_dir / ("uninstall.sql" if s.uninstall else "install.sql")
    standby = syncrep.quote_standby_name(s.application_name)
    with psycopg.connect(s.pg_dsn, autocommit=True, application_name="walsidecar init-postgres") as conn:
        before = _settings(conn)
        role_existed = bool(s.role) and conn.execute(
            "SELECT 1 FROM pg_roles WHERE rolname = %s", (s.role,)).fetchone() is not None
    cmd = [find_psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-v", f"app={s.application_name}",
           "-v", f"slot={s.slot}", "-v", f"role={s.role}", "-v", f"max_slot_wal_keep_size={s.max_slot_wal_keep_size}",
           "-v", f"sync={s.sync}", "-v", f"standby_name={standby}", "-d", s.pg_dsn, "-f", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    if out.returncode != 0:
        raise InitError(f"psql -f {script} exited with {out.returncode}:\n{out.stderr.strip()}")
    print(f"Applied {script} to {redact_dsn(s.pg_dsn)}")
    with psycopg.connect(s.pg_dsn, autocommit=True, application_name="walsidecar init-postgres") as conn:
        after = _wait_reload(conn, before)
        if s.uninstall:
            _report_uninstall(conn, s, after)
            return 0
        restart = _report_settings(before, after)
        slots_made = _report_objects(conn, s, role_existed, after)
    if restart:
        print(f"Restart PostgreSQL to apply: {', '.join(restart)}"
              + ("." if slots_made else "; then run this again to create the slots."))
    else:
        print("No restart needed.")
    return 0


def _wait_reload(conn: psycopg.Connection, before: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """pg_reload_conf() only signals the postmaster: poll until reloadable changes are visible."""
    deadline = time.monotonic() + RELOAD_WAIT
    while True:
        after = _settings(conn)
        pending = [n for n, a in after.items() if a["context"] != "postmaster" and a["file"] is not None
                   and not _same(a["value"], a["file"])]
        if not pending or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def _report_settings(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    restart = []
    for name in TOUCHED:
        b, a = before[name], after[name]
        target = a["file"] if a["file"] is not None else a["value"]
        if name == "synchronous_standby_names":
            continue  # reported with its own advice below
        if a["context"] == "postmaster" and not _same(a["value"], target):
            restart.append(name)
            print(f"  {name} = {target}: needs a restart (running with {a['value']})")
        elif not _same(b["value"], a["value"]):
            print(f"  {name} = {a['value']}: applied by reload (was {b['value']})")
        else:
            print(f"  {name} = {a['value']}: unchanged")
    return restart


def _report_objects(conn: psycopg.Connection, s: InitPostgresSettings, role_existed: bool,
                    after: dict[str, dict[str, Any]]) -> bool:
    """One line per object; True when both slots exist."""
    if s.role:
        row = conn.execute("SELECT rolreplication, rolcanlogin FROM pg_roles WHERE rolname = %s",
                           (s.role,)).fetchone()
        verb = "exists" if role_existed else "created"
        print(f"  role {s.role}: {verb}, REPLICATION {'yes' if row and row[0] else 'no'}, member of pg_monitor; "
              "give it a password (\\password in psql) or a pg_hba.conf rule, and use it in --pg-dsn")
    value = after["synchronous_standby_names"]["value"]
    warnings = syncrep.standby_names_warnings(value, s.application_name)
    if not warnings:
        print(f"  synchronous_standby_names = {value}: names {s.application_name!r}; every commit waits for the "
              "safekeeper quorum")
    elif value == "" and s.sync != "off":
        print(f"  synchronous_standby_names = '': left empty because `walsidecar start` is not streaming yet "
              "(commits would wait for it from the reload on). Once it streams, run "
              f"`walsidecar init-postgres --sync on` or: {syncrep.set_standby_names_hint(s.application_name)}")
    else:
        print(f"  synchronous_standby_names: {warnings[0]}")
    slots = conn.execute(
        "SELECT slot_name, wal_status FROM pg_replication_slots WHERE slot_name IN (%s, %s) ORDER BY 1",
        (s.slot, f"{s.slot}_horizon")).fetchall()
    if len(slots) == 2:
        print("  slots " + ", ".join(f"{n} ({w or 'no WAL reserved'})" for n, w in slots) + ": present")
    else:
        print(f"  slots {s.slot}, {s.slot}_horizon: not created yet (slots need wal_level replica and free "
              "max_replication_slots: after the restart, `walsidecar start` creates them)")
    views = [r[0] for r in conn.execute(
        "SELECT table_name FROM information_schema.views WHERE table_schema = 'walsidecar' ORDER BY 1")]
    print("  views " + ", ".join(f"walsidecar.{v}" for v in views) + ": installed")
    return len(slots) == 2


def _report_uninstall(conn: psycopg.Connection, s: InitPostgresSettings, after: dict[str, dict[str, Any]]) -> None:
    value = after["synchronous_standby_names"]["value"]
    if syncrep.standby_name_matches(_parse(value), s.application_name):
        print(f"  synchronous_standby_names = {value!r} still names {s.application_name!r}: edit it by hand, or "
              "commits wait forever once the sidecar stops")
    else:
        print(f"  synchronous_standby_names = {value!r}: commits no longer wait for the sidecar")
    left = conn.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_name IN (%s, %s)",
                        (s.slot, f"{s.slot}_horizon")).fetchall()
    if left:
        print("  slots " + ", ".join(r[0] for r in left) + ": still there (active: stop `walsidecar start`, "
              "then run this again)")
    else:
        print("  slots: dropped")
    print("  schema walsidecar: dropped")
    if s.role:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (s.role,)).fetchone()
        print(f"  role {s.role}: {'still exists' if exists else 'dropped'}")
    print("  wal_level, max_wal_senders, max_replication_slots, max_slot_wal_keep_size: left as they are")


def _parse(value: str) -> syncrep.SyncStandbyConfig | None:
    try:
        return syncrep.parse_synchronous_standby_names(value)
    except syncrep.SyncStandbyNamesError:
        return None

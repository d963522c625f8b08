"""Which errors from the primary heal by themselves (retry them forever) and which need the operator."""

from __future__ import annotations

import re

import psycopg

# libpq keeps no SQLSTATE for a failed connection, only the server's message: these read it back.
_CONNECT_MESSAGES = (
    (re.compile(r"password authentication failed|fe_sendauth: no password supplied"), "28P01"),
    (re.compile(r'role "[^"]*" does not exist|no pg_hba\.conf entry'), "28000"),
    (re.compile(r'database "[^"]*" does not exist'), "3D000"),
    (re.compile(r"the database system is (starting up|shutting down|in recovery mode|not yet accepting)"), "57P03"),
    (re.compile(r"too many clients already|remaining connection slots are reserved"), "53300"),
)

# What retrying cannot fix, with what to change.
PERMANENT = {
    "28P01": "authentication failed: check the user and password of --pg-dsn (or ~/.pgpass, PGPASSWORD)",
    "28000": "the primary does not let this user in: check user= of --pg-dsn, that the role exists "
             "(`walsidecar init-postgres` creates it) and that pg_hba.conf admits it from this host",
    "3D000": "the database of --pg-dsn does not exist: fix dbname= or create it",
    "42501": "the role lacks a privilege walsidecar needs (REPLICATION, or EXECUTE on the slot functions): "
             "`walsidecar init-postgres` grants them",
}


def sqlstate(e: BaseException) -> str | None:
    """The SQLSTATE of a psycopg error, read from the message for a failed connection."""
    if not isinstance(e, psycopg.Error):
        return None
    if e.sqlstate:
        return e.sqlstate
    text = str(e)
    return next((code for pattern, code in _CONNECT_MESSAGES if pattern.search(text)), None)


def permanent(e: BaseException) -> str | None:
    """What to fix when `e` will not go away by retrying; None when it may heal (network, restarts)."""
    code = sqlstate(e)
    return PERMANENT.get(code) if code else None


def first_line(e: BaseException) -> str:
    """The server's own words, without libpq's "connection to server at ... failed:" preamble."""
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return re.sub(r"^(connection failed: )?connection to server at .*? failed: (FATAL:\s+)?", "", text)

"""Which errors from the primary heal by themselves: by SQLSTATE, or by libpq's message for a failed connection."""

from __future__ import annotations

import psycopg
import pytest

from sidecar.proposer import pgerrors

PREAMBLE = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  '


@pytest.mark.parametrize("message,code,heals", [
    ('password authentication failed for user "pw"', "28P01", False),
    ('role "nosuch" does not exist', "28000", False),
    ('no pg_hba.conf entry for host "127.0.0.1", user "x", database "postgres", no encryption', "28000", False),
    ('database "nosuch" does not exist', "3D000", False),
    ("the database system is starting up", "57P03", True),
    ("the database system is shutting down", "57P03", True),
    ("sorry, too many clients already", "53300", True),
    ("Connection refused", None, True),
])
def test_a_failed_connection_is_classified_by_its_message(message: str, code: str | None, heals: bool) -> None:
    e = psycopg.OperationalError(PREAMBLE + message)
    assert pgerrors.sqlstate(e) == code
    assert (pgerrors.permanent(e) is None) == heals
    assert pgerrors.first_line(e) == message


def test_an_error_with_a_sqlstate_is_classified_by_it() -> None:
    assert pgerrors.permanent(psycopg.errors.InsufficientPrivilege("permission denied")) is not None
    assert pgerrors.permanent(psycopg.errors.AdminShutdown("terminating connection")) is None
    assert pgerrors.permanent(OSError("network is unreachable")) is None

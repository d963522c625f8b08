"""The `synchronous_standby_names` grammar and what it means for the sidecar (pure, no server)."""

from __future__ import annotations

import pytest

from sidecar.proposer.syncrep import (
    SyncStandbyConfig,
    SyncStandbyNamesError,
    parse_synchronous_standby_names,
    sidecar_is_required,
    standby_name_matches,
    standby_names_warnings,
)

APP = "walsidecar"


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

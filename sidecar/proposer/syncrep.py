"""The `synchronous_standby_names` grammar: parse it as PostgreSQL does, and say what it means for the sidecar.

Pure: no connection. The proposer warns with it at attach time, `walsidecar check` and
`init-postgres` report with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal


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


def waited_for_instead(config: SyncStandbyConfig | None, application_name: str) -> str | None:
    """The standbys commits wait for when the setting leaves the sidecar out; None when it names it or is empty."""
    if config is None or standby_name_matches(config, application_name):
        return None
    names = ", ".join(repr(n) for n in config.names)
    if len(config.names) == 1:
        return f"standby {names}"
    how = "the first" if config.method == "priority" else "any"
    return f"{how} {config.num_sync} of the standbys {names}"


def quote_standby_name(name: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z_0-9$]*", name) and name.upper() not in ("ANY", "FIRST"):
        return name
    return '"' + name.replace('"', '""') + '"'


def sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def set_standby_names_hint(application_name: str) -> str:
    value = sql_literal(quote_standby_name(application_name))
    return f"ALTER SYSTEM SET synchronous_standby_names = {value}; SELECT pg_reload_conf();"


def standby_names_warnings(value: str, application_name: str) -> list[str]:
    """Warnings about a synchronous_standby_names value for a sidecar named `application_name`."""
    hint = set_standby_names_hint(application_name)
    try:
        config = parse_synchronous_standby_names(value)
    except SyncStandbyNamesError as exc:
        return [
            f"synchronous_standby_names = {sql_literal(value)} does not parse ({exc}), so commits "
            f"do not wait for the safekeeper quorum. Run: {hint}"
        ]
    if not standby_name_matches(config, application_name):
        shown = sql_literal(value) if value.strip() else "'' (empty)"
        return [
            f"synchronous_standby_names = {shown} does not name {application_name!r}: commits do not "
            f"wait for the safekeeper quorum and can be lost on failover. Run: {hint}"
        ]
    assert config is not None
    if config.num_sync > len(config.names) and "*" not in config.names:
        return [
            f"synchronous_standby_names = {sql_literal(value)} asks for {config.num_sync} synchronous "
            f"standbys but lists only {len(config.names)}, so commits wait forever. Run: {hint}"
        ]
    if not sidecar_is_required(config, application_name):
        return [
            f"synchronous_standby_names = {sql_literal(value)} lets other standbys release a commit "
            f"without {application_name!r}, so an acknowledged commit may not be on a safekeeper "
            f"quorum. To wait for the quorum on every commit, run: {hint}"
        ]
    return []

"""`walsidecar readers slot create|drop|list`: a reader slot on every safekeeper, over its reader port.

A reader that streams from one safekeeper moves only that safekeeper's slot, so a reader that may
switch safekeepers needs its slot on all of them (as a standby's primary_conninfo lists several).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from sidecar.address import Address
from sidecar.config import ReaderSlotSettings
from sidecar.lsn import format_lsn
from sidecar.walclient import ReaderError, WalReader


def _each(s: ReaderSlotSettings, act: Callable[[WalReader], str]) -> int:
    """Run `act` on every safekeeper, one line each; 0 if it worked on all, 1 otherwise."""
    failed = 0
    for text in s.safekeeper_readers:
        try:
            with WalReader(Address.parse(text), s, application_name="walsidecar readers") as r:
                line = act(r)
        except ReaderError as e:
            failed += 1
            line = "FAILED: " + e.message + (f" (SQLSTATE {e.sqlstate})" if e.sqlstate else "")
        click.echo(f"{text}: {line}")
    return 1 if failed else 0


def create(s: ReaderSlotSettings, name: str) -> int:
    def act(r: WalReader) -> str:
        lsn = r.create_slot(name, reserve_wal=s.reserve_wal)
        return f"created slot {name}" + (f" at {format_lsn(lsn)}" if lsn else "")
    return _each(s, act)


def drop(s: ReaderSlotSettings, name: str) -> int:
    def act(r: WalReader) -> str:
        r.drop_slot(name)
        return f"dropped slot {name}"
    return _each(s, act)


def show(s: ReaderSlotSettings, names: tuple[str, ...]) -> int:
    def act(r: WalReader) -> str:
        parts: list[str] = []
        for name in names:
            got: Any = r.read_slot(name)
            if got is None:
                parts.append(f"{name} does not exist")
            elif got == (0, 0):
                parts.append(f"{name} has no position yet")
            else:
                parts.append(f"{name} at {format_lsn(got[0])} (timeline {got[1]})")
        return "; ".join(parts)
    return _each(s, act)

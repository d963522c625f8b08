"""Below which LSN a safekeeper may remove whole WAL segments: one pure function, as Neon's calc_horizon_lsn."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Horizon:
    """The removal horizon (a segment boundary) and what holds it there, for logs, `check` and metrics."""

    lsn: int
    held_by: str


def removal_horizon(*, flush_lsn: int, commit_lsn: int, seg_size: int, backup_lsn: int | None = None,
                    slot_lsns: Iterable[int] | Mapping[str, int] = (), keep_bytes: int | None = None) -> Horizon:
    """Whole segments below the returned LSN are safe to remove.

    With an archive (`backup_lsn` given) WAL goes once archived; without one, only WAL more than
    `keep_bytes` behind the flush position goes, and with neither nothing does. Never above what is
    committed (a later term may still need it to agree) nor what any reader slot still needs; the
    segment holding the last flushed byte always stays, as a restart finds the end of WAL in it.
    """
    bounds: list[tuple[int, str]] = [(max(flush_lsn - 1, 0), "flush_lsn"), (commit_lsn, "commit_lsn")]
    if backup_lsn is not None:
        bounds.append((backup_lsn, "backup_lsn (the archive)"))
    elif keep_bytes is not None:
        bounds.append((max(0, flush_lsn - keep_bytes), "the retention (--keep-wal)"))
    else:
        bounds.append((0, "no archive and no retention set"))
    if isinstance(slot_lsns, Mapping):  # named: the log and `check` can say which slot holds it
        bounds.extend((lsn, f'reader slot "{name}"') for name, lsn in slot_lsns.items())
    else:
        bounds.extend((lsn, "a reader slot") for lsn in slot_lsns)
    lsn, held_by = min(bounds)
    return Horizon(lsn - lsn % seg_size, held_by)

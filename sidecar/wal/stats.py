"""The `pg_waldump --stats=record` table (PostgreSQL 15 layout), from per-record-type counts and sizes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.lsn import format_lsn
from sidecar.wal.rmgrdesc import stats_recid, stats_row_name


@dataclass
class TypeStats:
    """Counts and sizes for one (rmid, recid) row: record size excludes full-page images."""

    count: int = 0
    rec_len: int = 0
    fpi_len: int = 0


@dataclass
class WalStats:
    """What pg_waldump's XLogDumpCountRecord accumulates, keyed by (rmid, recid)."""

    start_lsn: int | None = None
    end_lsn: int | None = None
    rows: dict[tuple[int, int], TypeStats] = field(default_factory=dict)

    def add(self, lsn: int, end_lsn: int, rmid: int, info: int, tot_len: int, fpi_len: int) -> None:
        """Count one record."""
        key = (rmid, stats_recid(rmid, info))
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = TypeStats()
        row.count += 1
        row.rec_len += tot_len - fpi_len
        row.fpi_len += fpi_len
        if self.start_lsn is None or lsn < self.start_lsn:
            self.start_lsn = lsn
        if self.end_lsn is None or end_lsn > self.end_lsn:
            self.end_lsn = end_lsn

    def add_row(self, rmid: int, recid: int, count: int, rec_len: int, fpi_len: int) -> None:
        """Merge an already aggregated row."""
        row = self.rows.setdefault((rmid, recid), TypeStats())
        row.count += count
        row.rec_len += rec_len
        row.fpi_len += fpi_len

    @property
    def count(self) -> int:
        return sum(r.count for r in self.rows.values())


def _pct(part: int, total: int) -> float:
    return 100 * part / total if total else 0.0


def _row(name: str, n: int, tn: int, rec: int, trec: int, fpi: int, tfpi: int, tot: int, ttot: int) -> str:
    return (f"{name:<27} {n:>20} ({_pct(n, tn):6.2f}) {rec:>20} ({_pct(rec, trec):6.2f}) "
            f"{fpi:>20} ({_pct(fpi, tfpi):6.2f}) {tot:>20} ({_pct(tot, ttot):6.2f})")


def format_stats_record(stats: WalStats) -> str:
    """The text pg_waldump --stats=record prints for these counts (PostgreSQL 15 printf layout), newline-terminated."""
    rows = sorted(stats.rows.items())
    total_count = sum(r.count for _, r in rows)
    total_rec = sum(r.rec_len for _, r in rows)
    total_fpi = sum(r.fpi_len for _, r in rows)
    total = total_rec + total_fpi
    lines = [
        f"WAL statistics between {format_lsn(stats.start_lsn or 0)} and {format_lsn(stats.end_lsn or 0)}:",
        (f"{'Type':<27} {'N':>20} {'(%)':>8} {'Record size':>20} {'(%)':>8} {'FPI size':>20} {'(%)':>8} "
         f"{'Combined size':>20} {'(%)':>8}"),
        (f"{'----':<27} {'-':>20} {'---':>8} {'-----------':>20} {'---':>8} {'--------':>20} {'---':>8} "
         f"{'-------------':>20} {'---':>8}"),
    ]
    for (rmid, recid), r in rows:
        if r.count == 0:
            continue
        lines.append(_row(stats_row_name(rmid, recid), r.count, total_count, r.rec_len, total_rec,
                          r.fpi_len, total_fpi, r.rec_len + r.fpi_len, total))
    lines.append(f"{'':<27} {'--------':>20} {'':>8} {'--------':>20} {'':>8} {'--------':>20} {'':>8} {'--------':>20}")
    rec_pct = f"[{_pct(total_rec, total):.2f}%]"
    fpi_pct = f"[{_pct(total_fpi, total):.2f}%]"
    lines.append(f"{'Total':<27} {total_count:>20} {'':<9}{total_rec:>20} {rec_pct:<9}{total_fpi:>20} {fpi_pct:<9}"
                 f"{total:>20} {'[100%]':<6}")
    return "\n".join(lines) + "\n"


def stats_from_records(records: Iterable[tuple[Any, ...]], stop_before: int | None = None) -> WalStats:
    """Accumulate WalStats from segment scan record tuples, counting only records starting before stop_before."""
    stats = WalStats()
    for lsn, end, _prev, _xid, rmid, info, tot, fpi, *_ in records:
        if stop_before is None or lsn < stop_before:
            stats.add(lsn, end, rmid, info, tot, fpi)
    return stats

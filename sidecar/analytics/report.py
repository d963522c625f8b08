"""The HTML report of an analysis, with PNG charts drawn by matplotlib."""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from sidecar.lsn import format_lsn
from sidecar.wal.archive import ArchivePlan, ChainResult
from sidecar.wal.stats import WalStats, format_stats_record

TOP_RELATIONS = 15
MiB = 1024 * 1024


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return f"charts/{path.name}"


def _stacked_barh(path: Path, title: str, labels: Sequence[str], series: dict[str, Sequence[float]], xlabel: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.35 * len(labels) + 1.2)))
    left = [0.0] * len(labels)
    for name, values in series.items():
        ax.barh(labels, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(loc="lower right")
    return _save(fig, path)


def chart_rmgr(stats: WalStats, path: Path) -> str:
    """WAL bytes per resource manager: record bytes and full-page image bytes."""
    from sidecar.wal.rmgrdesc import rmgr_name

    per: dict[str, list[int]] = {}
    for (rmid, _recid), r in stats.rows.items():
        acc = per.setdefault(rmgr_name(rmid), [0, 0])
        acc[0] += r.rec_len
        acc[1] += r.fpi_len
    top = sorted(per.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:12]
    labels = [name for name, _ in top]
    return _stacked_barh(path, "WAL volume by resource manager", labels,
                         {"record": [v[0] / MiB for _, v in top], "full-page images": [v[1] / MiB for _, v in top]},
                         "MiB")


def chart_relations(relations: pa.Table, path: Path) -> str:
    """The relations with the most block data and full-page image bytes."""
    rows = relations.slice(0, TOP_RELATIONS).to_pylist()
    labels = [f"{r['relation']} {r['fork']}" for r in rows]
    return _stacked_barh(path, f"Top {len(rows)} relations by WAL written", labels,
                         {"block data": [r["data_bytes"] / MiB for r in rows],
                          "full-page images": [r["fpi_bytes"] / MiB for r in rows]}, "MiB")


def chart_commits(commits: pa.Table, path: Path) -> str:
    """Commits and aborts per second."""
    plt = _plt()
    rows = commits.to_pylist()
    fig, ax = plt.subplots(figsize=(9, 3.5))
    seconds = [r["second"] for r in rows]
    ax.plot(seconds, [r["commits"] for r in rows], marker=".", label="commits")
    ax.plot(seconds, [r["aborts"] for r in rows], marker=".", label="aborts")
    ax.set_ylabel("per second")
    ax.set_title("Transactions per second (commit timestamps, UTC)")
    ax.legend()
    import matplotlib.dates as mdates

    locator = mdates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    return _save(fig, path)


def chart_segments(segments: pa.Table, path: Path) -> str:
    """Record and full-page image bytes of the records starting in each segment."""
    plt = _plt()
    rows = segments.to_pylist()
    fig, ax = plt.subplots(figsize=(9, 3.5))
    x = [f"{r['segno']:X}" for r in rows]
    fpi = [r["fpi_bytes"] / MiB for r in rows]
    rec = [(r["record_bytes"] - r["fpi_bytes"]) / MiB for r in rows]
    ax.bar(x, rec, label="record")
    ax.bar(x, fpi, bottom=rec, label="full-page images")
    ax.set_xlabel("segment number (hex)")
    ax.set_ylabel("MiB of records starting here")
    ax.set_title("WAL per segment")
    ax.legend()
    return _save(fig, path)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _lsn(v: int | None) -> str:
    return "" if v is None else format_lsn(v)


_STYLE = """
body{font-family:sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:90%}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}
pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:80%}
.bad{color:#b00}
img{max-width:100%}
"""


def write_report(
    out: Path, plan: ArchivePlan, chain: ChainResult, stats: WalStats, tables: dict[str, pa.Table],
    compression: pa.Table,
) -> Path:
    """Write out/report.html and its charts under out/charts."""
    charts_dir = out / "charts"
    charts_dir.mkdir(parents=True, exist_ok=True)
    charts = [("WAL by resource manager", chart_rmgr(stats, charts_dir / "wal_by_rmgr.png")),
              ("WAL per segment", chart_segments(tables["segments"], charts_dir / "segments.png"))]
    if tables["relations"].num_rows:
        charts.append(("Relations", chart_relations(tables["relations"], charts_dir / "top_relations.png")))
    if tables["commits_per_second"].num_rows:
        charts.append(("Commits per second", chart_commits(tables["commits_per_second"], charts_dir / "commits_per_second.png")))

    total = sum(r.rec_len + r.fpi_len for r in stats.rows.values())
    fpi = sum(r.fpi_len for r in stats.rows.values())
    commits = tables["commits_per_second"]
    n_commits = sum(commits.column("commits").to_pylist()) if commits.num_rows else 0
    n_aborts = sum(commits.column("aborts").to_pylist()) if commits.num_rows else 0
    segs = plan.segments
    status = ("<p>Archive intact: every CRC valid, page headers and the xl_prev chain consistent.</p>"
              if not chain.problems else
              "<p class='bad'>Problems found:</p><ul>" + "".join(
                  f"<li class='bad'>{html.escape(p.describe())}</li>" for p in chain.problems[:50]) + "</ul>")
    overview = _table(["", ""], [
        ("Source", plan.storage.location),
        ("Segments", f"{len(segs)} ({segs[0].name} … {segs[-1].name})" if segs else "0"),
        ("Records", f"{stats.count:,}"),
        ("LSN range", f"{_lsn(stats.start_lsn)} – {_lsn(stats.end_lsn)}"),
        ("WAL bytes in records", f"{total:,}"),
        ("Full-page image bytes", f"{fpi:,} ({100 * fpi / total if total else 0:.1f} %)"),
        ("Commits / aborts", f"{n_commits:,} / {n_aborts:,}"),
        ("Generated", datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")),
    ])
    rel_rows = [(r["relation"], r["fork"], f"{r['records']:,}", f"{r['distinct_blocks']:,}", f"{r['fpi_count']:,}",
                 f"{r['fpi_bytes']:,}", f"{r['data_bytes']:,}", f"{r['record_bytes']:,}")
                for r in tables["relations"].slice(0, 20).to_pylist()]
    seg_rows = [(r["name"], r["tli"], _lsn(r["first_lsn"]), _lsn(r["last_lsn"]), f"{r['records']:,}", r["crc_failures"],
                 r["end_reason"], r["chain"]) for r in tables["segments"].to_pylist()]
    comp_rows = [(r["compression"], f"{r['images']:,}", f"{r['stored_bytes']:,}", f"{r['saved_bytes']:,}")
                 for r in compression.to_pylist()]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>WAL report: {html.escape(plan.storage.location)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>WAL report</h1>{overview}{status}",
        *(f"<h2>{html.escape(title)}</h2><img src='{src}' alt='{html.escape(title)}'>" for title, src in charts),
        "<h2>Relations writing the most WAL</h2>",
        _table(["relation (spc/db/rel)", "fork", "records", "blocks", "FPIs", "FPI bytes", "data bytes", "record bytes"],
               rel_rows),
        "<h2>Full-page images by compression</h2>",
        _table(["compression", "images", "stored bytes", "bytes saved"], comp_rows),
        "<h2>Record types (pg_waldump --stats=record)</h2>",
        f"<pre>{html.escape(format_stats_record(stats))}</pre>",
        "<h2>Segments</h2>",
        _table(["segment", "timeline", "first record", "last record", "records", "CRC failures", "ends with", "chain"],
               seg_rows),
        "</body></html>",
    ]
    path = out / "report.html"
    path.write_text("".join(parts))
    return path

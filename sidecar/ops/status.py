"""`walsidecar status`: a `patronictl list`-style table of the proposer and its safekeepers.

Where it looks: the proposer's /status document (`--proposer-metrics`, the proposer's
`--metrics` address) gives the full picture as the proposer sees it. `--safekeepers` asks each
safekeeper directly (its own term, flush and commit LSN), which still works when the proposer
is down. `--pg-dsn` adds the primary's flush LSN, waiting commits and the sidecar's sync state.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import datetime
from typing import Any

import psycopg

from sidecar.broker import Broker, read_clusters
from sidecar.config import StatusSettings
from sidecar.consensus.messages import DegradedRange, InfoReply
from sidecar.lsn import format_lsn, parse_lsn
from sidecar.ops.probe import connect, fetch_status, redact_dsn
from sidecar.skclient import ProbeError, probe_safekeeper
from sidecar.proposer.primary import read_syncrep_state
from sidecar.linkauth import client_security
from sidecar.tls import TlsError, client_context

COLUMNS = ("Safekeeper", "Address", "State", "Term", "Flush LSN", "Lag (bytes)", "Lag (s)", "Last contact", "Backup LSN")


async def gather(s: StatusSettings) -> dict[str, Any]:
    """Ask every source given; each failure is recorded, not raised."""
    doc: dict[str, Any] = {"time": datetime.now().astimezone().isoformat(timespec="seconds")}
    tasks: dict[str, Any] = {}
    ctx = client_context(s.certs_dir) if s.certs_dir is not None else None  # HTTPS endpoints
    link = ctx if s.link_security == "tls" else client_security(s.certs_dir, s.link_security)
    if s.insecure:
        doc["insecure"] = True
    elif s.link_security != "tls":
        doc["link_security"] = s.link_security
    if s.proposer_metrics:
        tasks["proposer"] = fetch_status(s.proposer_metrics, s.timeout, ctx)
    for addr in s.safekeepers:
        tasks[f"sk:{addr}"] = probe_safekeeper(addr, s.timeout, link)
    if s.pg_dsn:
        tasks["primary"] = _primary(s)
    if s.standby_dsn:
        tasks["standby"] = _standby(s.standby_dsn, s.timeout)
    if s.broker:
        tasks["broker"] = _broker(s)
    if s.patroni:
        from sidecar.patroni import patroni_cluster
        tasks["patroni"] = asyncio.to_thread(patroni_cluster, s.patroni, s.timeout)
    results = await asyncio.gather(*tasks.values(), return_exceptions=True)
    got = dict(zip(tasks, results))

    proposer = got.get("proposer")
    if s.proposer_metrics:
        if isinstance(proposer, BaseException):
            doc["proposer"] = {"endpoint": s.proposer_metrics, "error": str(proposer)}
        else:
            doc["proposer"] = {"endpoint": s.proposer_metrics, **{k: v for k, v in proposer.items()
                                                                  if k != "safekeepers"}}
    rows: dict[str, dict[str, Any]] = {}
    if isinstance(proposer, dict):
        for row in proposer.get("safekeepers", []):
            rows[row["address"]] = dict(row)
    for addr in s.safekeepers:
        r = got[f"sk:{addr}"]
        row = rows.setdefault(addr, {"address": addr, "id": None, "state": None, "term": None, "flush_lsn": None,
                                     "lag_bytes": None, "lag_seconds": None, "last_contact_seconds": None})
        if isinstance(r, InfoReply):
            row["own"] = {"id": r.node_id, "system_id": str(r.system_id), "term": r.term,
                          "last_log_term": r.last_log_term, "flush_lsn": format_lsn(r.flush_lsn),
                          "commit_lsn": format_lsn(r.commit_lsn), "proposer_connected": r.proposer_connected,
                          "reader_port": r.reader_port or None, "backup_lsn": format_lsn(r.backup_lsn),
                          "members": r.members or None, "amnesic": r.amnesic,
                          "lost_disk_term": r.lost_disk_term or None,
                          "degraded": _range(r.degraded) if r.degraded else None}
            row["id"] = row["id"] or r.node_id
            if row["term"] is None:
                row["term"] = r.term
            if row["flush_lsn"] is None:
                row["flush_lsn"] = format_lsn(r.flush_lsn)
            if r.amnesic:  # a lost disk: whatever the proposer last saw, it votes for no one now
                row["state"] = "lost disk: learning its term"
            elif r.lost_disk_term and row["state"] in (None, "streaming", "idle"):
                row["state"] = f"lost disk: no vote until a term above {r.lost_disk_term}"
            if row["state"] is None:
                row["state"] = "streaming" if r.proposer_connected else "idle"
        else:
            row["own"] = {"error": str(r)}
            if row["state"] is None:
                row["state"] = "down"
    primary = got.get("primary")
    if s.pg_dsn:
        doc["primary"] = {"error": str(primary)} if isinstance(primary, BaseException) else primary
    if s.standby_dsn:
        standby = got["standby"]
        doc["standby"] = {"error": str(standby)} if isinstance(standby, BaseException) else standby
    if s.broker:
        got_broker = got["broker"]
        doc["broker"] = {"endpoints": list(s.broker), "error": str(got_broker)} \
            if isinstance(got_broker, BaseException) else got_broker
        _rows_from_broker(doc["broker"], rows)
    if s.patroni:
        got_patroni = got["patroni"]
        doc["patroni"] = {"error": str(got_patroni)} if isinstance(got_patroni, BaseException) else got_patroni
    _fill_lag(doc, rows)
    doc["safekeepers"] = sorted(rows.values(), key=lambda r: (r["id"] is None, r["id"] or 0, r["address"]))
    return doc


async def _primary(s: StatusSettings) -> dict[str, Any]:
    try:
        conn = await connect(s.pg_dsn, s.timeout, "status")  # type: ignore[arg-type]
    except (psycopg.Error, OSError, asyncio.TimeoutError) as e:
        raise ProbeError((str(e).strip() or "timed out").splitlines()[0]) from None
    try:
        st = await read_syncrep_state(conn, s.application_name)
    finally:
        await conn.close()
    return {"dsn": redact_dsn(s.pg_dsn), "flush_lsn": format_lsn(st.flush_lsn), "commits_waiting": st.commits_waiting,
            "oldest_wait_seconds": round(st.oldest_wait_seconds, 3) if st.oldest_wait_seconds is not None else None,
            "replication_state": st.replication_state, "sync_state": st.sync_state,
            "sidecar_flush_lsn": format_lsn(st.sidecar_flush_lsn) if st.sidecar_flush_lsn is not None else None}


async def _standby(dsn: str, timeout: float) -> dict[str, Any]:
    """Whether the standby streams from a reader port, and how far it replayed."""
    try:
        conn = await connect(dsn, timeout, "status")
    except (psycopg.Error, OSError, asyncio.TimeoutError) as e:
        raise ProbeError((str(e).strip() or "timed out").splitlines()[0]) from None
    try:
        row = await (await conn.execute(
            "SELECT pg_is_in_recovery(), (SELECT status FROM pg_stat_wal_receiver), "
            "(SELECT sender_host || ':' || sender_port FROM pg_stat_wal_receiver), "
            "coalesce(pg_last_wal_replay_lsn(), '0/0')::text")).fetchone()
    finally:
        await conn.close()
    in_recovery, receiver, sender, replayed = row
    return {"dsn": redact_dsn(dsn), "in_recovery": in_recovery, "receiver": receiver, "sender": sender,
            "replay_lsn": replayed}


def _range(r: DegradedRange) -> dict[str, Any]:
    return {"term": r.term, "start_lsn": format_lsn(r.start_lsn), "version": r.version, "members": sorted(r.members)}


async def _broker(s: StatusSettings) -> dict[str, Any]:
    """Every safekeeper's state as published in the broker, by cluster and timeline; the open degraded range."""
    broker = Broker(s.broker, s.certs_dir, timeout=s.timeout)
    try:
        clusters = await read_clusters(broker, s.cluster)
        degraded = await broker.read_degraded(s.cluster) if s.cluster else None
    finally:
        broker.close()
    now = time.time()
    return {"endpoints": list(s.broker), "degraded": _range(degraded) if degraded else None, "clusters": {
        name: {str(tl): {"uploader": e.uploader, "safekeepers": [
            {"id": st.id, "term": st.term, "last_log_term": st.last_log_term, "flush_lsn": format_lsn(st.flush_lsn),
             "commit_lsn": format_lsn(st.commit_lsn), "backup_lsn": format_lsn(st.backup_lsn),
             "proposer_connected": st.proposer_connected, "age_seconds": round(now - st.last_updated, 1),
             "address": st.address, "pg_address": st.pg_address or None} for st in e.safekeepers.values()]}
            for tl, e in timelines.items()} for name, timelines in clusters.items()}}


def _rows_from_broker(b: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    """Safekeepers nobody else told of get a row from the broker (one cluster's latest timeline only)."""
    clusters = b.get("clusters") or {}
    if len(clusters) != 1:
        return
    timelines = next(iter(clusters.values()))
    for e in timelines[max(timelines, key=int)]["safekeepers"]:
        rows.setdefault(e["address"], {
            "address": e["address"], "id": e["id"], "state": "streaming" if e["proposer_connected"] else "idle",
            "term": e["term"], "flush_lsn": e["flush_lsn"], "lag_bytes": None, "lag_seconds": None,
            "last_contact_seconds": e["age_seconds"]})


def _fill_lag(doc: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    """Without the proposer, lag is measured against the primary (or the most advanced safekeeper)."""
    ref = None
    prim = doc.get("primary") or {}
    if prim.get("flush_lsn"):
        ref = parse_lsn(prim["flush_lsn"])
    elif rows:
        flushes = [parse_lsn(r["flush_lsn"]) for r in rows.values() if r.get("flush_lsn")]
        ref = max(flushes) if flushes else None
    for r in rows.values():
        if r.get("lag_bytes") is None and ref is not None and r.get("flush_lsn"):
            r["lag_bytes"] = max(ref - parse_lsn(r["flush_lsn"]), 0)


def _cell(v: Any) -> str:
    return "" if v is None else str(v)


def table(doc: dict[str, Any]) -> str:
    """patronictl-style box: a title bar, one row per safekeeper, then summary lines."""
    rows = []
    for r in doc["safekeepers"]:
        contact = r.get("last_contact_seconds")
        lag_s = r.get("lag_seconds")
        rows.append([_cell(r.get("id")), r["address"], _cell(r.get("state")), _cell(r.get("term")),
                     _cell(r.get("flush_lsn")), _cell(r.get("lag_bytes")),
                     "" if lag_s is None else f"{lag_s:.1f}",
                     "" if contact is None else f"{contact:.1f}s ago",
                     # 0/0 until this safekeeper or another archived a segment (--archive)
                     (r.get("own") or {}).get("backup_lsn", "")])
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    border = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    prop = doc.get("proposer") or {}
    title = f" Cluster: {prop.get('application_name') or 'walsidecar'} "
    if prop.get("slot"):
        title += f"(slot {prop['slot']}) "
    top = "+" + title + border[len(title) + 1:] if len(title) + 1 < len(border) else "+" + title + "+"

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i < 3 or i == 4 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    out = [top, line(list(COLUMNS)), border] + [line(r) for r in rows] + [border]
    out += _summary(doc)
    return "\n".join(out)


def _summary(doc: dict[str, Any]) -> list[str]:
    lines = []
    prop = doc.get("proposer")
    if doc.get("insecure") or (prop or {}).get("insecure"):
        who = "the proposer runs" if (prop or {}).get("insecure") else "asked"
        lines.append(f" Security: INSECURE ({who} with --insecure: links without TLS or authentication)")
    elif doc.get("link_security") == "auth-only" or (prop or {}).get("link_security") == "auth-only":
        lines.append(" Security: auth-only (certificates checked at connection start; links not encrypted)")
    if prop is not None:
        if prop.get("error"):
            lines.append(f" Proposer: unreachable at {prop['endpoint']}: {prop['error']}")
        else:
            q = "available" if prop.get("quorum_available") else "LOST"
            lines.append(f" Proposer: term {prop.get('term')}, {prop.get('phase')}, "
                         f"commit_lsn {prop.get('commit_lsn') or '-'}, "
                         f"quorum {prop.get('quorum')} of {prop.get('safekeepers_configured')}: {q}")
            limbo = prop.get("limbo") or {}
            alert = " (ALERT)" if limbo.get("alerting") else ""
            oldest = f", the oldest (up to {limbo.get('oldest_lsn')}) for {limbo.get('oldest_wait_seconds', 0):.1f}s" \
                if limbo.get("oldest_lsn") else ""
            lines.append(f" Limbo:    {limbo.get('pending_bytes', 0)} bytes waiting for a quorum{oldest}{alert}")
    direct, seen = doc.get("primary"), (prop or {}).get("primary")
    # The primary as asked directly; else as the proposer last polled it.
    prim = direct if direct and not direct.get("error") else (seen if seen and seen.get("flush_lsn") else direct)
    if prim:
        if prim.get("error") and not prim.get("flush_lsn"):
            lines.append(f" Primary:  unreachable: {prim['error']}")
        else:
            waiting = prim.get("commits_waiting")
            oldest = prim.get("oldest_wait_seconds")
            wait_txt = f"commits waiting {waiting}" + (f" (the oldest for {oldest:.1f}s)" if waiting and oldest else "")
            sync = prim.get("sync_state") or "not connected"
            lines.append(f" Primary:  flush_lsn {prim.get('flush_lsn')}, {wait_txt}, sidecar sync_state {sync}")
    lines += _degraded_lines(doc)
    lines += _standby_lines(doc.get("standby"))
    lines += _reader_lines(doc["safekeepers"])
    lines += _broker_lines(doc.get("broker"))
    if "patroni" in doc:
        from sidecar.patroni import patroni_lines
        lines += patroni_lines(doc["patroni"])
    return lines


def _degraded_lines(doc: dict[str, Any]) -> list[str]:
    """An open degraded range (--commit-wait degrade-after), as etcd, the proposer and each safekeeper hold it."""
    def text(r: dict[str, Any]) -> str:
        return (f"term {r['term']} from {r['start_lsn']}, version {r['version']}, members "
                f"{', '.join(map(str, r['members'])) or 'none'}")
    lines = []
    b, prop = doc.get("broker") or {}, doc.get("proposer") or {}
    if b.get("degraded"):
        lines.append(f" DEGRADED: etcd holds an open range, {text(b['degraded'])}: commits were acknowledged "
                     "without a quorum; failovers refuse unless a member votes")
    if prop.get("degraded"):
        acking = " (acknowledging without a quorum now)" if prop["degraded"].get("acknowledging") else ""
        lines.append(f" DEGRADED: the proposer's open range, {text(prop['degraded'])}{acking}")
    copies = [f"{r['id']}: {text(own['degraded'])}" for r in doc["safekeepers"]
              if (own := r.get("own") or {}).get("degraded")]
    if copies:
        lines.append(f" Degraded: copies on safekeepers {'; '.join(copies)}")
    return lines


def _standby_lines(st: dict[str, Any] | None) -> list[str]:
    if st is None:
        return []
    if st.get("error"):
        return [f" Standby:  unreachable: {st['error']}"]
    if not st["in_recovery"]:
        return [" Standby:  a primary now (promoted)"]
    if st["receiver"] == "streaming":
        return [f" Standby:  streaming from {st['sender']}, replayed up to {st['replay_lsn']}"]
    return [f" Standby:  NOT streaming (WAL receiver {st['receiver'] or 'not running'}), replayed up to "
            f"{st['replay_lsn']}: failover cannot promote it until it catches up; its log says why"]


def _reader_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Where each safekeeper serves readers (standbys, pg_receivewal, restore-wal), as it says itself."""
    ports = [f"{r['id']}: port {own['reader_port']}" if own.get("reader_port") else f"{r['id']}: none"
             for r in rows if "error" not in (own := r.get("own") or {"error": 1})]
    return [f" Readers:  {', '.join(ports)}"] if ports else []


def _broker_lines(b: dict[str, Any] | None) -> list[str]:
    """The broker's view: one line per cluster and timeline, one per safekeeper published there."""
    if b is None:
        return []
    where = ",".join(b["endpoints"])
    if b.get("error"):
        return [f" Broker:   unreachable at {where}: {b['error']}"]
    if not b["clusters"]:
        return [f" Broker:   {where}: no safekeeper publishes there"]
    lines = []
    for name, timelines in b["clusters"].items():
        for tl, e in timelines.items():
            up = f", uploader {e['uploader']}" if e["uploader"] is not None else ""
            lines.append(f" Broker:   {where}: cluster {name}, timeline {tl}{up}")
            for r in e["safekeepers"]:
                lines.append(f"   {r['id']}: term {r['term']}, flush_lsn {r['flush_lsn']}, commit_lsn {r['commit_lsn']}, "
                             f"backup_lsn {r['backup_lsn']}, proposer {'connected' if r['proposer_connected'] else 'not connected'}, "
                             f"{r['age_seconds']:.1f}s ago, at {r['address']}")
    return lines


def render(doc: dict[str, Any], fmt: str) -> str:
    return json.dumps(doc, indent=2) if fmt == "json" else table(doc)


def _healthy(s: StatusSettings, doc: dict[str, Any]) -> bool:
    """The proposer answers and has its quorum; without it, a majority of the safekeepers answer."""
    prop = doc.get("proposer")
    if s.proposer_metrics:
        return prop is not None and not prop.get("error") and bool(prop.get("quorum_available"))
    if s.broker and not (s.proposer_metrics or s.safekeepers or s.pg_dsn):
        b = doc.get("broker") or {}
        return not b.get("error") and bool(b.get("clusters"))
    if s.safekeepers:
        answering = sum("error" not in (r.get("own") or {"error": 1}) for r in doc["safekeepers"])
        return answering >= len(s.safekeepers) // 2 + 1
    return bool(doc.get("primary") and not doc["primary"].get("error"))


def run_status(s: StatusSettings) -> int:
    """Print once, or every --watch seconds until Ctrl-C (or --count times); the exit code is `status`'s."""
    n = 0
    while True:
        try:
            doc = asyncio.run(gather(s))
        except TlsError as e:
            print(f"walsidecar status: {e}", file=sys.stderr, flush=True)
            return 2
        text = render(doc, s.format)
        if s.watch:
            if sys.stdout.isatty():
                sys.stdout.write("\033[H\033[J")
            print(f"{time.strftime('%a %b %d %H:%M:%S %Y')} (every {s.watch:g}s)\n", flush=True)
        print(text, flush=True)
        n += 1
        if not s.watch or (s.count is not None and n >= s.count):
            return 0 if _healthy(s, doc) else 1
        try:
            time.sleep(s.watch)
        except KeyboardInterrupt:
            return 0

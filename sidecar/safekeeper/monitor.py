"""What a safekeeper shows operators: its metrics, its /status document and /health, read from its view."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from sidecar import __version__
from sidecar.http import HttpEndpoint, Response, json_response, metrics_handler
from sidecar.lsn import format_lsn
from sidecar.metrics import SafekeeperMetrics, gauge, info
from sidecar.safekeeper.view import SafekeeperView

if TYPE_CHECKING:
    from prometheus_client.core import Metric


class Observed(Protocol):
    """What the monitor needs of a safekeeper: its event metrics and a view of it."""

    stats: SafekeeperMetrics

    def view(self) -> SafekeeperView: ...


class SafekeeperMonitor:
    """Scrape-time view of one safekeeper; its event metrics live in `sk.stats`."""

    def __init__(self, sk: Observed) -> None:
        self.view = sk.view
        self.stats = sk.stats
        self.started = time.monotonic()
        sk.stats.add_collector(self._collect)

    def endpoint(self, host: str, port: int) -> HttpEndpoint:
        return HttpEndpoint(host, port, {
            "/metrics": metrics_handler(self.stats.registry),
            "/status": lambda: json_response(self.status()),
            "/health": self.health,
        }, what="safekeeper metrics")

    def health(self) -> Response:
        """200 while the safekeeper accepts WAL; 503 and the reason once it stopped (a full disk, a failed fsync)."""
        reason = _stopped_reason(self.view())
        if reason is not None:
            return Response(503, "text/plain", f"{reason}\n".encode())
        return Response(200, "text/plain", b"ok\n")

    def status(self) -> dict[str, Any]:
        """The /status document."""
        v = self.view()
        s, p = v.state, v.positions
        return {
            "role": "safekeeper",
            "version": __version__,
            "id": v.node_id,
            "listen": v.listen,
            "insecure": v.link_security is None,
            "link_security": v.link_security,
            "uptime_seconds": round(time.monotonic() - self.started, 1),
            "system_id": str(s.system_id) if s.system_id else None,
            "timeline": s.timeline,
            "wal_seg_size": s.wal_seg_size,
            "pg_version": s.pg_version,
            "term": p.term,
            "term_history": [[e.term, format_lsn(e.start_lsn)] for e in s.term_history],
            "elected_term": v.elected_term,
            # An empty data directory: not voting until this many peers told their term (amnesia.py).
            "learning_term_from_peers": v.learning_term_from,
            "members": v.members,
            # A lost disk that learned this term: no vote until its WAL holds the start of a later one.
            "lost_disk_term": v.lost_disk_term,
            "flush_lsn": format_lsn(p.flush_lsn),
            "write_lsn": format_lsn(v.write_lsn),
            "commit_lsn": format_lsn(p.commit_lsn),
            "peer_horizon_lsn": format_lsn(s.peer_horizon_lsn),
            "backup_lsn": format_lsn(s.backup_lsn),
            "archiving": v.archive is not None,
            "archive_failing": v.archive_error is not None,
            "archive_mismatch": v.archive_mismatch,
            # No proposer address, paths or error texts: a stranger may read this; the log has them.
            "proposer_connected": v.proposer_connected,
            "reader_listen": v.reader_listen,
            "readers": v.readers,
            "streaming_readers": v.streaming_readers,
            "slots": [{"name": sl.name, "restart_lsn": format_lsn(sl.restart_lsn) if sl.restart_lsn else None,
                       "timeline": sl.timeline or None, "temporary": sl.temporary, "active": sl.active}
                      for sl in v.slots],
            "removal_horizon": format_lsn(v.removal_horizon.lsn),
            "removal_held_by": v.removal_stopped_by or v.removal_horizon.held_by,
            "wal_bytes": v.disk_usage.wal_bytes,
            "disk_guard": v.disk_guard,
            "fatal": v.fatal,
            "stopped": _stopped_reason(v),
            "broker": _broker_status(v),
        }

    def _collect(self) -> Iterable[Metric]:
        v = self.view()
        s, p = v.state, v.positions
        sid = str(v.node_id)

        def g(name: str, doc: str, value: float) -> Metric:
            fam = gauge(name, doc, labels=["safekeeper_id"])
            fam.add_metric([sid], value)
            return fam

        yield info("walsidecar_safekeeper", "Identity of this safekeeper.",
                   {"safekeeper_id": sid, "version": __version__,
                    "system_id": str(s.system_id), "timeline": str(s.timeline)})
        yield g("walsidecar_safekeeper_term", "Highest term this safekeeper has promised.", p.term)
        yield g("walsidecar_safekeeper_last_log_term", "Term of the last entry of the term history.",
                s.term_history[-1].term if s.term_history else 0)
        yield g("walsidecar_safekeeper_flush_lsn_bytes", "End of the WAL fsynced here.", p.flush_lsn)
        yield g("walsidecar_safekeeper_write_lsn_bytes", "End of the WAL written here (maybe not yet fsynced).",
                v.write_lsn)
        yield g("walsidecar_safekeeper_commit_lsn_bytes", "Quorum-acknowledged position learned from the proposer.",
                p.commit_lsn)
        yield g("walsidecar_safekeeper_peer_horizon_lsn_bytes", "Position every safekeeper holds, as last learned.",
                s.peer_horizon_lsn)
        yield g("walsidecar_safekeeper_backup_lsn_bytes", "End of the WAL the archive holds every segment of "
                "(--archive).", s.backup_lsn)
        yield g("walsidecar_safekeeper_archive_failing", "1 while archiving fails (the log says why); it is "
                "retried.", 1 if v.archive_error else 0)
        yield g("walsidecar_safekeeper_archive_mismatch", "1 while an archived object is not this safekeeper's WAL of "
                "its segment (/status and the log name it): backup_lsn, and so removal, stop below it.",
                1 if v.archive_mismatch else 0)
        yield g("walsidecar_safekeeper_disk_full", "1 once a full disk stopped this safekeeper acknowledging WAL "
                "(free space, then restart it).", 1 if v.disk_full else 0)
        yield g("walsidecar_safekeeper_proposer_connected", "1 while an elected proposer streams to this safekeeper.",
                1 if v.proposer_connected else 0)
        yield g("walsidecar_safekeeper_readers", "Reader connections on the reader port (--pg-listen).", v.readers)
        yield g("walsidecar_safekeeper_streaming_readers", "Readers in START_REPLICATION now.", v.streaming_readers)
        slots = gauge("walsidecar_reader_slot_lsn_bytes", "Position a reader slot's reader flushed to (0: none yet).",
                      labels=["safekeeper_id", "slot"])
        active = gauge("walsidecar_reader_slot_active", "1 while a reader streams with the slot.",
                       labels=["safekeeper_id", "slot"])
        for sl in v.slots:
            slots.add_metric([sid, sl.name], sl.restart_lsn)
            active.add_metric([sid, sl.name], 1 if sl.active else 0)
        yield slots
        yield active
        horizon = gauge("walsidecar_safekeeper_removal_horizon_lsn_bytes", "WAL below this position is removed; "
                        "held_by says what holds it there (the archive, a reader slot, the retention, commit_lsn).",
                        labels=["safekeeper_id", "held_by"])
        horizon.add_metric([sid, v.removal_stopped_by or v.removal_horizon.held_by], v.removal_horizon.lsn)
        yield horizon
        u = v.disk_usage
        yield g("walsidecar_safekeeper_wal_disk_bytes", "Bytes the WAL segment files of this safekeeper take.",
                u.wal_bytes)
        yield g("walsidecar_safekeeper_filesystem_used_bytes", "Bytes in use on the data directory's filesystem.",
                u.fs_used)
        yield g("walsidecar_safekeeper_filesystem_size_bytes", "Size of the data directory's filesystem.", u.fs_total)
        yield g("walsidecar_safekeeper_disk_guard_active", "1 while disk use above --max-disk-usage stops this "
                "safekeeper taking new WAL (commits go on with the others); /status says what holds the WAL.",
                1 if v.disk_guard else 0)
        if v.broker is not None:
            yield from _peer_gauges(sid, v)


def _broker_status(v: SafekeeperView) -> dict[str, Any] | None:
    b = v.broker
    if b is None:
        return None
    return {"endpoints": list(b.endpoints), "cluster": b.cluster, "timeline": b.timeline, "connected": b.connected,
            "error": b.error, "published_seconds_ago": b.published_ago, "uploader": b.uploader, "leading": b.leading,
            "peers": [{"id": p.id, "term": p.term, "flush_lsn": format_lsn(p.flush_lsn),
                       "commit_lsn": format_lsn(p.commit_lsn), "backup_lsn": format_lsn(p.backup_lsn),
                       "proposer_connected": p.proposer_connected, "age_seconds": round(p.age(), 1),
                       "address": p.address, "pg_address": p.pg_address or None} for p in b.peers]}


def _peer_gauges(sid: str, v: SafekeeperView) -> Iterable[Metric]:
    """What this safekeeper reads of every safekeeper of its timeline in the broker (itself included)."""
    b = v.broker
    assert b is not None
    yield _one(gauge("walsidecar_safekeeper_broker_connected", "1 while the broker (etcd) takes this safekeeper's "
                     "publishes; 0 while it does not answer (commits go on; uploader hand-over and removal wait).",
                     labels=["safekeeper_id"]), [sid], 1 if b.connected else 0)
    now = time.time()
    for name, doc, value in (
            ("flush_lsn_bytes", "A peer's flush LSN as published in the broker.", lambda p: p.flush_lsn),
            ("commit_lsn_bytes", "A peer's commit LSN as published in the broker.", lambda p: p.commit_lsn),
            ("backup_lsn_bytes", "End of the WAL a peer says the archive holds.", lambda p: p.backup_lsn),
            ("term", "A peer's term as published in the broker.", lambda p: p.term),
            ("proposer_connected", "1 while a peer says an elected proposer streams to it.",
             lambda p: 1 if p.proposer_connected else 0),
            ("age_seconds", "Seconds since a peer's last publish in the broker.", lambda p: max(now - p.last_updated, 0))):
        fam = gauge(f"walsidecar_safekeeper_peer_{name}", doc, labels=["safekeeper_id", "peer_id"])
        for p in b.peers:
            fam.add_metric([sid, str(p.id)], value(p))
        yield fam
    yield _one(gauge("walsidecar_safekeeper_uploader", "1 while this safekeeper holds the timeline's upload lease.",
                     labels=["safekeeper_id"]), [sid], 1 if b.leading else 0)


def _one(fam: Any, labels: list[str], value: float) -> Metric:
    fam.add_metric(labels, value)
    return fam


def _stopped_reason(v: SafekeeperView) -> str | None:
    """Why the safekeeper stopped acknowledging, without paths or error texts (the log has those)."""
    if not v.stopped:
        return None
    if v.disk_full:
        return "disk full: no longer acknowledging WAL; free space, then restart the safekeeper"
    return f"stopped after a fatal {v.fatal}: WAL in doubt; see the safekeeper's log"

"""What a safekeeper shows operators: its metrics, its /status document and its InfoReply."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sidecar import __version__
from sidecar.consensus.messages import InfoReply
from sidecar.http import HttpEndpoint, Response, json_response, metrics_handler
from sidecar.logs import set_context_provider
from sidecar.lsn import format_lsn
from sidecar.metrics import gauge, info

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from sidecar.safekeeper.server import Safekeeper


def info_reply(sk: Safekeeper) -> InfoReply:
    """Answer to an InfoRequest: identity and positions, read-only."""
    acc = sk.acceptor
    if acc is None:
        return InfoReply(sk.node_id, 0, 0, 0, 0, 0, 0, 0, 0, False)
    s = acc.state
    last_log_term = s.term_history[-1].term if s.term_history else 0
    return InfoReply(sk.node_id, s.system_id, s.wal_seg_size, s.pg_version, s.timeline, s.term, last_log_term,
                     acc.flush_lsn, s.commit_lsn, sk.proposer_address() is not None)


class SafekeeperMonitor:
    """Scrape-time view of one Safekeeper; its event metrics live in `sk.stats`."""

    def __init__(self, sk: Safekeeper) -> None:
        self.sk = sk
        self.started = time.monotonic()
        sk.stats.add_collector(self._collect)
        # Lines logged by this safekeeper (bound with node=) also carry its term and flush LSN.
        set_context_provider("node", self._log_context)

    def endpoint(self, host: str, port: int) -> HttpEndpoint:
        return HttpEndpoint(host, port, {
            "/metrics": metrics_handler(self.sk.stats.registry),
            "/status": lambda: json_response(self.status()),
            "/health": self.health,
        }, what="safekeeper metrics")

    def health(self) -> Response:
        """200 while the safekeeper accepts WAL; 503 and the reason once it stopped (a full disk, a failed fsync)."""
        reason = self.stopped_reason()
        if reason is not None:
            return Response(503, "text/plain", f"{reason}\n".encode())
        return Response(200, "text/plain", b"ok\n")

    def stopped_reason(self) -> str | None:
        """Why the safekeeper stopped acknowledging, without paths or error texts (the log has those)."""
        sk = self.sk
        if sk.stopped is None:
            return None
        if sk.disk_full:
            return "disk full: no longer acknowledging WAL; free space, then restart the safekeeper"
        return f"stopped after a fatal {type(sk.fatal).__name__}: WAL in doubt; see the safekeeper's log"

    def _log_context(self, node: object) -> dict[str, object]:
        acc = self.sk.acceptor
        if acc is None or node != self.sk.node_id:
            return {}
        return {"term": acc.state.term, "flush_lsn": format_lsn(acc.flush_lsn)}

    def status(self) -> dict[str, Any]:
        """The /status document."""
        sk, acc = self.sk, self.sk.acceptor
        s = acc.state if acc else None
        return {
            "role": "safekeeper",
            "version": __version__,
            "id": sk.node_id,
            "listen": f"{sk.host}:{sk.port}",
            "insecure": sk.ssl_context is None and sk.link_auth is None,
            "link_security": "tls" if sk.ssl_context else "auth-only" if sk.link_auth else None,
            "uptime_seconds": round(time.monotonic() - self.started, 1),
            "system_id": str(s.system_id) if s and s.system_id else None,
            "timeline": s.timeline if s else None,
            "wal_seg_size": s.wal_seg_size if s else None,
            "pg_version": s.pg_version if s else None,
            "term": s.term if s else 0,
            "term_history": [[e.term, format_lsn(e.start_lsn)] for e in s.term_history] if s else [],
            "elected_term": acc.elected_term if acc else 0,
            "flush_lsn": format_lsn(acc.flush_lsn) if acc else None,
            "write_lsn": format_lsn(acc.write_lsn) if acc else None,
            "commit_lsn": format_lsn(s.commit_lsn) if s else None,
            "peer_horizon_lsn": format_lsn(s.peer_horizon_lsn) if s else None,
            # No proposer address, paths or error texts: a stranger may read this; the log has them.
            "proposer_connected": sk.proposer_address() is not None,
            "fatal": type(sk.fatal).__name__ if sk.fatal is not None else None,
            "stopped": self.stopped_reason(),
        }

    def _collect(self) -> Iterable[Metric]:
        sk, acc = self.sk, self.sk.acceptor
        sid = str(sk.node_id)
        s = acc.state if acc else None

        def g(name: str, doc: str, value: float) -> Metric:
            fam = gauge(name, doc, labels=["safekeeper_id"])
            fam.add_metric([sid], value)
            return fam

        yield info("walsidecar_safekeeper", "Identity of this safekeeper.",
                   {"safekeeper_id": sid, "version": __version__,
                    "system_id": str(s.system_id) if s else "0", "timeline": str(s.timeline) if s else "0"})
        yield g("walsidecar_safekeeper_term", "Highest term this safekeeper has promised.", s.term if s else 0)
        yield g("walsidecar_safekeeper_last_log_term", "Term of the last entry of the term history.",
                s.term_history[-1].term if s and s.term_history else 0)
        yield g("walsidecar_safekeeper_flush_lsn_bytes", "End of the WAL fsynced here.", acc.flush_lsn if acc else 0)
        yield g("walsidecar_safekeeper_write_lsn_bytes", "End of the WAL written here (maybe not yet fsynced).",
                acc.write_lsn if acc else 0)
        yield g("walsidecar_safekeeper_commit_lsn_bytes", "Quorum-acknowledged position learned from the proposer.",
                s.commit_lsn if s else 0)
        yield g("walsidecar_safekeeper_peer_horizon_lsn_bytes", "Position every safekeeper holds, as last learned.",
                s.peer_horizon_lsn if s else 0)
        yield g("walsidecar_safekeeper_disk_full", "1 once a full disk stopped this safekeeper acknowledging WAL "
                "(free space, then restart it).", 1 if sk.disk_full else 0)
        yield g("walsidecar_safekeeper_proposer_connected", "1 while an elected proposer streams to this safekeeper.",
                1 if sk.proposer_address() is not None else 0)

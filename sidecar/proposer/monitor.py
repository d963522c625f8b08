"""What the proposer shows operators: metrics, the /status document, the limbo and its alert.

The service calls the cheap hooks (`wal_received`, `committed`, `peer_contact`, `event`) on its
hot path; everything else is computed from its published view when scraped or on a slow tick.
The clock lives here, not in the consensus core: the core exposes positions and this module
timestamps them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar import __version__
from sidecar.consensus.proposer import Campaign, ElectionWon, PeerJoined, Phase, ProposerEvent
from sidecar.http import HttpEndpoint, Response, json_response, metrics_handler
from sidecar.proposer.limbo import Limbo
from sidecar.linkauth import LinkAuth
from sidecar.logs import get_logger, set_context_provider
from sidecar.lsn import format_lsn, parse_lsn
from sidecar.metrics import SLOT_WAL_STATUSES, ProposerMetrics, counter, gauge, info
from sidecar.proposer.view import PeerView, ProposerView

if TYPE_CHECKING:
    from prometheus_client.core import Metric

TICK = 0.5
ALERT_REPEAT = 60.0
PROGRESS_EVERY = 5.0
# A safekeeper this far behind what the primary sent is "catching up" rather than streaming.
CATCHING_UP_BYTES = 16 * 1024 * 1024

STATES = ("streaming", "catching up", "joining", "down")


@dataclass
class _CatchUp:
    started: float
    start_flush: int
    last_log: float
    last_flush: int


class ProposerMonitor:
    """Observes one proposer through its published view; optionally serves /metrics and /status."""

    def __init__(self, view: ProposerView, quorum_wait_alert: float | None = 10.0, clock=time.monotonic) -> None:
        self.view = view
        self.alert_after = quorum_wait_alert if quorum_wait_alert else None
        self.clock = clock
        self.limbo = Limbo()
        self.metrics = ProposerMetrics()
        self.metrics.add_collector(self._collect)
        self.log = get_logger(role="proposer")
        self.last_contact: dict[str, float] = {}
        self.node_ids: dict[str, int] = {}
        self.terms: dict[str, int] = {}
        self.flushes: dict[str, int] = {}
        self.alerting_since: float | None = None
        self._alert_logged = 0.0
        self._catchups: dict[str, _CatchUp] = {}
        self.started = clock()
        set_context_provider("peer", self._peer_log_context)

    # ---- hot-path hooks ----------------------------------------------------------------------

    def wal_received(self, end_lsn: int, nbytes: int) -> None:
        self.metrics.wal_received.inc(nbytes)
        self.limbo.received(end_lsn, self.clock())

    def committed(self, commit_lsn: int) -> None:
        waits = self.limbo.acknowledged(commit_lsn, self.clock())
        for w in waits:
            self.metrics.commit_ack.observe(w)

    def peer_contact(self, name: str) -> None:
        self.last_contact[name] = self.clock()

    def event(self, event: ProposerEvent) -> None:
        match event:
            case ElectionWon():
                self.metrics.elections.inc()
            case Campaign():
                self.metrics.campaigns.inc()
            case PeerJoined():
                self._joined(event.peer, event.flush_lsn)

    def _joined(self, name: str, flush: int) -> None:
        """A safekeeper far behind starts catching up now: log it even if it is done before the next tick."""
        view = self.view
        behind = max(self.limbo.received_lsn - flush, 0)
        if view.phase is None or not (behind > CATCHING_UP_BYTES or flush < view.term_start):
            return
        now = self.clock()
        self._catchups[name] = _CatchUp(now, flush, now, flush)
        self.log.info("safekeeper catching up", peer=name, behind_bytes=behind,
                      term_start_lsn=format_lsn(view.term_start))

    def term_lost(self) -> None:
        self.metrics.terms_lost.inc()

    # ---- the endpoint ------------------------------------------------------------------------

    def endpoint(self, host: str, port: int) -> HttpEndpoint:
        return HttpEndpoint(host, port, {
            "/metrics": metrics_handler(self.metrics.registry),
            "/status": lambda: json_response(self.status()),
            "/health": lambda: Response(200, "text/plain", b"ok\n"),
            # HAProxy/Kubernetes style: 200 while a quorum holds the current term, else 503.
            "/quorum": lambda: json_response({"quorum_available": self._quorum_available()},
                                             200 if self._quorum_available() else 503),
        }, what="proposer metrics")

    # ---- background --------------------------------------------------------------------------

    async def run(self) -> None:
        """Tick: cache peer facts, watch the limbo, log catch-up progress."""
        while True:
            await asyncio.sleep(TICK)
            try:
                self._tick()
            except Exception:  # observing must never stop the proposer
                self.log.exception("monitor tick failed")

    def _tick(self) -> None:
        now = self.clock()
        self._remember_peers()
        self._check_limbo(now)
        self._catch_up_progress(now)

    def _remember_peers(self) -> None:
        if self.view.phase is None:
            return
        term = self.view.term
        for p in self.view.peers():
            if p.node_id is not None:
                self.node_ids[p.name] = p.node_id
            if p.elected:
                self.terms[p.name] = term
                self.flushes[p.name] = p.flush_lsn
            elif p.greeted_term is not None:
                self.terms[p.name] = max(p.greeted_term, self.terms.get(p.name, 0))

    def _check_limbo(self, now: float) -> None:
        pr = self.view.primary_poll
        if not self._streaming() and pr.flush_lsn and pr.error is None and pr.replication_state is None:
            # No sidecar streams from the primary at all (not even another one holding the lock),
            # yet it has WAL no quorum acknowledged: commits wait for that WAL too.
            self.limbo.received(pr.flush_lsn, now)
        oldest = self.limbo.oldest(now)
        if self.alert_after is None:
            return
        if oldest is not None and oldest[1] > self.alert_after:
            if self.alerting_since is None:
                self.alerting_since = now
                self.metrics.quorum_wait_alerts.inc()
            if now - self._alert_logged >= ALERT_REPEAT or self._alert_logged < self.alerting_since:
                self._alert_logged = now
                self.log.error("commits are waiting for the safekeeper quorum",
                               waited_seconds=round(oldest[1], 1), oldest_lsn=format_lsn(oldest[0]),
                               commit_lsn=format_lsn(self.limbo.acknowledged_lsn),
                               pending_bytes=self.limbo.pending_bytes, quorum=self._quorum(),
                               acknowledged=self._ack_vector(), down=self._down(),
                               alert_after_seconds=self.alert_after)
        elif self.alerting_since is not None:
            self.log.warning("the safekeeper quorum acknowledges WAL again",
                             alerted_for_seconds=round(now - self.alerting_since, 1),
                             commit_lsn=format_lsn(self.limbo.acknowledged_lsn))
            self.alerting_since = None

    def _catch_up_progress(self, now: float) -> None:
        for p in self.view.peers():
            name = p.name
            state = self._state(p)
            cu = self._catchups.get(name)
            flush = p.flush_lsn
            remaining = max(self.limbo.received_lsn - flush, 0)
            ids = {"peer": name}
            if state == "catching up":
                if cu is None:
                    self._catchups[name] = _CatchUp(now, flush, now, flush)
                    self.log.info("safekeeper catching up", **ids, behind_bytes=remaining,
                                  source="the primary's pg_wal" if p.fetching else "the proposer's buffer")
                elif now - cu.last_log >= PROGRESS_EVERY:
                    rate = (flush - cu.last_flush) / max(now - cu.last_log, 1e-9)
                    self.log.info("catch-up progress", **ids, done_bytes=flush - cu.start_flush,
                                  remaining_bytes=remaining, rate_mib_per_s=round(rate / 2**20, 1),
                                  eta_seconds=round(remaining / rate, 0) if rate > 0 else None)
                    cu.last_log, cu.last_flush = now, flush
            elif cu is not None:
                del self._catchups[name]
                took = max(now - cu.started, 1e-9)
                done = max(flush - cu.start_flush, 0)
                if state == "streaming":
                    self.log.info("safekeeper caught up", **ids, done_bytes=done, seconds=round(took, 1),
                                  rate_mib_per_s=round(done / took / 2**20, 1))
                else:
                    self.log.warning("catch-up interrupted", **ids, done_bytes=done, state=state)

    # ---- derived state -----------------------------------------------------------------------

    def _streaming(self) -> bool:
        return self.view.phase is Phase.STREAMING

    def _quorum(self) -> int:
        return self.view.options.quorum

    def _quorum_available(self) -> bool:
        if not self._streaming():
            return False
        return sum(1 for p in self.view.peers() if p.elected and p.connected) >= self._quorum()

    def _state(self, p: PeerView) -> str:
        if not p.connected:
            return "down"
        if not p.elected:
            return "joining"
        if p.fetching or p.flush_lsn < self.view.term_start or \
                self.limbo.received_lsn - p.flush_lsn > CATCHING_UP_BYTES:
            return "catching up"
        return "streaming"

    def _flush(self, p: PeerView) -> int:
        if p.elected:
            return p.flush_lsn
        return self.flushes.get(p.name, 0)

    def _term(self, p: PeerView) -> int | None:
        if p.elected:
            return self.view.term
        if p.greeted_term is not None:
            return p.greeted_term
        return self.terms.get(p.name)

    def _node_id(self, p: PeerView) -> int | None:
        return p.node_id if p.node_id is not None else self.node_ids.get(p.name)

    def _ack_vector(self) -> dict[str, str]:
        return {p.name: format_lsn(self._flush(p)) for p in self.view.peers()}

    def _down(self) -> list[str]:
        return [p.name for p in self.view.peers() if not p.connected]

    def _peer_log_context(self, name: object) -> dict[str, object]:
        """Fields every log line about safekeeper `name` should carry."""
        p = self.view.peer(name) if isinstance(name, str) else None
        if p is None:
            return {}
        out: dict[str, object] = {}
        node = self._node_id(p)
        if node is not None:
            out["safekeeper_id"] = node
        term = self._term(p)
        if term is not None:
            out["term"] = term
        out["flush_lsn"] = format_lsn(self._flush(p))
        return out

    def peers(self) -> list[dict[str, Any]]:
        """One row per configured safekeeper, as `walsidecar status` shows it."""
        now = self.clock()
        rows = []
        for p in self.view.peers():
            flush = self._flush(p)
            received = self.limbo.received_lsn
            contact = self.last_contact.get(p.name)
            rows.append({
                "id": self._node_id(p),
                "address": p.name,
                "state": self._state(p),
                "term": self._term(p),
                "flush_lsn": format_lsn(flush) if flush else None,
                "lag_bytes": max(received - flush, 0) if received and flush else None,
                "lag_seconds": round(self.limbo.lag_seconds(flush, now), 3) if received and flush else None,
                "last_contact_seconds": round(now - contact, 3) if contact is not None else None,
                "reconnects": p.reconnects,
                "catching_up_from_primary": p.fetching,
            })
        return rows

    def status(self) -> dict[str, Any]:
        """The /status document."""
        view, opts = self.view, self.view.options
        now = self.clock()
        oldest = self.limbo.oldest(now)
        pr = view.primary_poll
        return {
            "role": "proposer",
            "version": __version__,
            "application_name": opts.application_name,
            "slot": opts.slot,
            "insecure": opts.ssl_context is None,
            "link_security": _link_security(opts.ssl_context),
            "uptime_seconds": round(now - self.started, 1),
            "phase": view.phase.value if view.phase is not None else "between terms",
            "term": view.term,
            "term_start_lsn": format_lsn(view.term_start) if view.term_start else None,
            "commit_lsn": format_lsn(view.commit_lsn) if view.commit_lsn else None,
            "received_lsn": format_lsn(self.limbo.received_lsn) if self.limbo.received_lsn else None,
            "quorum": self._quorum(),
            "safekeepers_configured": len(view.peers()),
            "quorum_available": self._quorum_available(),
            "commit_wait": str(opts.commit_wait),
            "degraded": {"term": view.degraded.term, "start_lsn": format_lsn(view.degraded.start_lsn),
                         "version": view.degraded.version, "members": sorted(view.degraded.members),
                         "acknowledging": view.degraded_acknowledging} if view.degraded else None,
            "limbo": {
                "pending_bytes": self.limbo.pending_bytes,
                "oldest_lsn": format_lsn(oldest[0]) if oldest else None,
                "oldest_wait_seconds": round(oldest[1], 3) if oldest else 0.0,
                "acknowledged": self._ack_vector(),
                "alert_after_seconds": self.alert_after,
                "alerting": self.alerting_since is not None,
            },
            "primary": {
                "flush_lsn": format_lsn(pr.flush_lsn) if pr.flush_lsn else None,
                "commits_waiting": pr.commits_waiting,
                "oldest_wait_seconds": round(pr.oldest_wait_seconds, 3) if pr.oldest_wait_seconds else None,
                "sync_state": pr.sync_state,
                "replication_state": pr.replication_state,
                "slots": pr.slots,
                "commits_terminated": dict(pr.commits_terminated),
                # The error text can name hosts and users: the log has it, a stranger need not.
                "error": "unreachable (see the proposer's log)" if pr.error else None,
                "polled_seconds_ago": round(now - pr.polled_at, 1) if pr.polled_at else None,
            },
            "safekeepers": self.peers(),
        }

    # ---- scrape-time gauges --------------------------------------------------------------------

    def _collect(self) -> Iterable[Metric]:
        view, opts = self.view, self.view.options
        now = self.clock()
        yield info("walsidecar_proposer", "Version and names this proposer runs with.",
                   {"version": __version__, "application_name": opts.application_name, "slot": opts.slot})
        yield gauge("walsidecar_proposer_term", "Current (or last) term of this proposer.", view.term)
        yield gauge("walsidecar_proposer_streaming", "1 while a term streams WAL from the primary.",
                    1 if self._streaming() else 0)
        yield gauge("walsidecar_proposer_term_start_lsn_bytes", "Where the current term's WAL starts.",
                    view.term_start)
        yield gauge("walsidecar_proposer_commit_lsn_bytes",
                    "Quorum-flushed position reported to the primary as flush.", view.commit_lsn)
        yield gauge("walsidecar_proposer_received_lsn_bytes", "End of the WAL received from the primary.",
                    self.limbo.received_lsn)
        yield gauge("walsidecar_proposer_quorum_available",
                    "1 while at least a quorum of safekeepers are connected and in the current term.",
                    1 if self._quorum_available() else 0)
        yield gauge("walsidecar_proposer_quorum_size", "Safekeepers needed to acknowledge a commit.", self._quorum())
        yield gauge("walsidecar_proposer_safekeepers", "Safekeepers configured.", len(view.peers()))
        degraded = view.degraded
        yield gauge("walsidecar_proposer_degraded",
                    "1 while a degraded range is open (--commit-wait degrade-after): commits were or are acknowledged "
                    "without a quorum, and failovers refuse until a quorum holds them.", 1 if degraded else 0)
        yield gauge("walsidecar_proposer_degraded_start_lsn_bytes",
                    "Where the open degraded range starts (0 when none is open).", degraded.start_lsn)
        yield gauge("walsidecar_proposer_degraded_acknowledging",
                    "1 while commits are acknowledged above the quorum, by the range's members.",
                    1 if view.degraded_acknowledging else 0)
        oldest = self.limbo.oldest(now)
        yield gauge("walsidecar_proposer_limbo_bytes", "WAL received but not yet acknowledged by a quorum.",
                    self.limbo.pending_bytes)
        yield gauge("walsidecar_proposer_limbo_oldest_seconds",
                    "How long the oldest unacknowledged WAL has waited for the quorum (0 when none waits).",
                    oldest[1] if oldest else 0.0)
        yield gauge("walsidecar_proposer_quorum_wait_alert",
                    "1 while the oldest unacknowledged WAL has waited longer than --quorum-wait-alert.",
                    1 if self.alerting_since is not None else 0)
        labels = ["safekeeper", "safekeeper_id"]
        fams = {
            "up": gauge("walsidecar_proposer_safekeeper_up", "1 while the TCP connection is up.", labels=labels),
            "streaming": gauge("walsidecar_proposer_safekeeper_streaming",
                               "1 while the safekeeper is in the current term and caught up.", labels=labels),
            "flush": gauge("walsidecar_proposer_safekeeper_flush_lsn_bytes",
                           "Flush position the safekeeper acknowledged.", labels=labels),
            "lag": gauge("walsidecar_proposer_safekeeper_lag_bytes",
                         "WAL received from the primary that the safekeeper has not acknowledged.", labels=labels),
            "lag_s": gauge("walsidecar_proposer_safekeeper_lag_seconds",
                           "Age of the oldest WAL the safekeeper has not acknowledged.", labels=labels),
            "contact": gauge("walsidecar_proposer_safekeeper_last_contact_seconds",
                             "Seconds since the last message from the safekeeper.", labels=labels),
        }
        reconnects = counter("walsidecar_proposer_safekeeper_reconnects",
                             "Connections to the safekeeper that were lost (each is retried).", labels)
        for row in self.peers():
            lv = [row["address"], str(row["id"] or "")]
            fams["up"].add_metric(lv, 0 if row["state"] == "down" else 1)
            fams["streaming"].add_metric(lv, 1 if row["state"] == "streaming" else 0)
            flush = parse_lsn(row["flush_lsn"]) if row["flush_lsn"] else 0
            fams["flush"].add_metric(lv, flush)
            fams["lag"].add_metric(lv, row["lag_bytes"] or 0)
            fams["lag_s"].add_metric(lv, row["lag_seconds"] or 0)
            if row["last_contact_seconds"] is not None:
                fams["contact"].add_metric(lv, row["last_contact_seconds"])
            reconnects.add_metric(lv, row["reconnects"])
        yield from fams.values()
        yield reconnects
        yield from self._primary_metrics(now)

    def _primary_metrics(self, now: float) -> Iterable[Metric]:
        pr = self.view.primary_poll
        yield gauge("walsidecar_primary_up", "1 if the last poll of the primary succeeded.",
                    1 if pr.polled_at is not None and pr.error is None else 0)
        if pr.flush_lsn is not None:
            yield gauge("walsidecar_primary_flush_lsn_bytes", "The primary's WAL flush position.", pr.flush_lsn)
        if pr.commits_waiting is not None:
            yield gauge("walsidecar_primary_commits_waiting",
                        "Backends waiting in SyncRep for the quorum (needs pg_monitor to see other roles).",
                        pr.commits_waiting)
            yield gauge("walsidecar_primary_commit_wait_oldest_seconds",
                        "How long the oldest SyncRep waiter's statement has run.", pr.oldest_wait_seconds or 0.0)
        terminated = counter("walsidecar_primary_commits_terminated",
                             "Backends the sidecar terminated while they waited in SyncRep (their clients got an "
                             "error): reason no-quorum (--commit-wait terminate-after) or lineage-ended.", ["reason"])
        for reason in ("no-quorum", "lineage-ended"):
            terminated.add_metric([reason], pr.commits_terminated.get(reason, 0))
        yield terminated
        if pr.polled_at is None or pr.error is not None:
            return
        status = gauge("walsidecar_primary_slot_wal_status",
                       "1 for the slot's current wal_status (missing: the slot does not exist).",
                       labels=["slot", "wal_status"])
        safe = gauge("walsidecar_primary_slot_safe_wal_size_bytes",
                     "WAL that can still be written before the slot is at risk (absent when unlimited).",
                     labels=["slot"])
        kept = gauge("walsidecar_primary_slot_retained_bytes", "WAL the slot keeps on the primary.", labels=["slot"])
        for slot in (self.view.options.slot, self.view.options.catchup_slot):
            row = pr.slots.get(slot)
            current = (row or {}).get("wal_status") or ("missing" if row is None else "reserved")
            for s in SLOT_WAL_STATUSES:
                status.add_metric([slot, s], 1 if s == current else 0)
            if row and row.get("safe_wal_size") is not None:
                safe.add_metric([slot], row["safe_wal_size"])
            if row and row.get("retained_bytes") is not None:
                kept.add_metric([slot], row["retained_bytes"])
        yield status
        yield safe
        yield kept


def _link_security(security: object) -> str | None:
    """tls, auth-only, or None under --insecure."""
    return None if security is None else "auth-only" if isinstance(security, LinkAuth) else "tls"

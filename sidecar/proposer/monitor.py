"""What the proposer shows operators: metrics, the /status document, the limbo and its alert.

The service calls the cheap hooks (`wal_received`, `committed`, `peer_contact`, `note`) on its
hot path; everything else is computed from the service's state when scraped or on a slow tick.
The clock lives here, not in the consensus core: the core exposes positions and this module
timestamps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg

from sidecar import __version__
from sidecar.consensus.proposer import Phase, PeerState
from sidecar.http import HttpEndpoint, Response, json_response, metrics_handler
from sidecar.limbo import Limbo
from sidecar.logs import get_logger, set_context_provider
from sidecar.lsn import format_lsn, parse_lsn
from sidecar.metrics import SLOT_WAL_STATUSES, ProposerMetrics, counter, gauge, info

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from sidecar.proposer.service import ProposerService

TICK = 0.5
PRIMARY_POLL = 1.0
PRIMARY_RETRY = 5.0
ALERT_REPEAT = 60.0
PROGRESS_EVERY = 5.0
# A safekeeper this far behind what the primary sent is "catching up" rather than streaming.
CATCHING_UP_BYTES = 16 * 1024 * 1024

STATES = ("streaming", "catching up", "joining", "down")


@dataclass
class PrimarySnapshot:
    """What the last poll of the primary saw (None fields: unknown)."""

    polled_at: float | None = None
    error: str | None = None
    flush_lsn: int | None = None
    commits_waiting: int | None = None
    oldest_wait_seconds: float | None = None
    sync_state: str | None = None
    replication_state: str | None = None
    slots: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class _CatchUp:
    started: float
    start_flush: int
    last_log: float
    last_flush: int


class ProposerMonitor:
    """Observes one ProposerService; optionally serves /metrics and /status."""

    def __init__(self, quorum_wait_alert: float | None = 10.0, clock=time.monotonic) -> None:
        self.alert_after = quorum_wait_alert if quorum_wait_alert else None
        self.clock = clock
        self.limbo = Limbo()
        self.metrics = ProposerMetrics()
        self.metrics.add_collector(self._collect)
        self.primary = PrimarySnapshot()
        self.service: ProposerService | None = None
        self.log = get_logger(role="proposer")
        self.last_contact: dict[str, float] = {}
        self.node_ids: dict[str, int] = {}
        self.terms: dict[str, int] = {}
        self.flushes: dict[str, int] = {}
        self.alerting_since: float | None = None
        self._alert_logged = 0.0
        self._catchups: dict[str, _CatchUp] = {}
        self.started = clock()

    def attach(self, service: ProposerService) -> None:
        self.service = service
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

    def note(self, event: str, fields: dict[str, Any]) -> None:
        if event == "elected":
            self.metrics.elections.inc()
        elif event == "campaign":
            self.metrics.campaigns.inc()
        elif event == "safekeeper joined term":
            self._joined(str(fields.get("peer")), int(fields.get("flush_lsn") or 0))

    def _joined(self, name: str, flush: int) -> None:
        """A safekeeper far behind starts catching up now: log it even if it is done before the next tick."""
        core = self.service.core if self.service else None
        behind = max(self.limbo.received_lsn - flush, 0)
        if core is None or not (behind > CATCHING_UP_BYTES or flush < core.term_start):
            return
        now = self.clock()
        self._catchups[name] = _CatchUp(now, flush, now, flush)
        self.log.info("safekeeper catching up", peer=name, behind_bytes=behind,
                      term_start_lsn=format_lsn(core.term_start))

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
        """Tick: cache peer facts, watch the limbo, log catch-up progress, poll the primary."""
        poller = asyncio.ensure_future(self._poll_primary())
        try:
            while True:
                await asyncio.sleep(TICK)
                try:
                    self._tick()
                except Exception:  # observing must never stop the proposer
                    self.log.exception("monitor tick failed")
        finally:
            poller.cancel()
            with contextlib.suppress(BaseException):
                await poller

    def _tick(self) -> None:
        now = self.clock()
        self._remember_peers()
        self._check_limbo(now)
        self._catch_up_progress(now)

    def _remember_peers(self) -> None:
        core = self.service.core if self.service else None
        if core is None:
            return
        for name, p in core.peers.items():
            if p.node_id is not None:
                self.node_ids[name] = p.node_id
            if p.elected:
                self.terms[name] = core.term
                self.flushes[name] = p.flush_lsn
            elif p.greeted_term is not None:
                self.terms[name] = max(p.greeted_term, self.terms.get(name, 0))

    def _check_limbo(self, now: float) -> None:
        pr = self.primary
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
        core = self.service.core if self.service else None
        for name in self.service.links if self.service else ():
            p = core.peers.get(name) if core else None
            state = self._state(name, p)
            cu = self._catchups.get(name)
            flush = p.flush_lsn if p is not None else 0
            remaining = max(self.limbo.received_lsn - flush, 0)
            ids = {"peer": name}
            if state == "catching up" and p is not None:
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

    async def _poll_primary(self) -> None:
        svc = self.service
        assert svc is not None
        opts = svc.opts
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                        opts.pg_dsn, autocommit=True, connect_timeout=5,
                        application_name=f"{opts.application_name} monitor") as conn:
                    while True:
                        await asyncio.wait_for(self._poll_once(conn), timeout=10)
                        await asyncio.sleep(PRIMARY_POLL)
            except (psycopg.Error, OSError, asyncio.TimeoutError) as e:
                self.primary.error = str(e).strip() or type(e).__name__
                self.primary.polled_at = self.clock()
                await asyncio.sleep(PRIMARY_RETRY)

    async def _poll_once(self, conn: psycopg.AsyncConnection) -> None:
        opts = self.service.opts  # type: ignore[union-attr]
        cur = await conn.execute(
            """
            SELECT pg_current_wal_flush_lsn()::text,
                   (SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'),
                   (SELECT extract(epoch FROM max(now() - query_start))::float8
                      FROM pg_stat_activity WHERE wait_event = 'SyncRep'),
                   (SELECT sync_state FROM pg_stat_replication WHERE application_name = %(app)s LIMIT 1),
                   (SELECT state FROM pg_stat_replication WHERE application_name = %(app)s LIMIT 1)
            """, {"app": opts.application_name})
        row = await cur.fetchone()
        assert row is not None
        cur = await conn.execute(
            """
            SELECT slot_name, wal_status, safe_wal_size, active,
                   pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint
            FROM pg_replication_slots WHERE slot_name IN (%s, %s)
            """, (opts.slot, opts.horizon_slot))
        slots = {name: {"wal_status": status, "safe_wal_size": safe, "active": active, "retained_bytes": kept}
                 for name, status, safe, active, kept in await cur.fetchall()}
        p = self.primary
        p.flush_lsn = parse_lsn(row[0])
        p.commits_waiting, p.oldest_wait_seconds = int(row[1]), row[2]
        p.sync_state, p.replication_state = row[3], row[4]
        p.slots, p.error, p.polled_at = slots, None, self.clock()

    # ---- derived state -----------------------------------------------------------------------

    def _streaming(self) -> bool:
        core = self.service.core if self.service else None
        return core is not None and core.phase is Phase.STREAMING

    def _quorum(self) -> int:
        return self.service.opts.quorum if self.service else 0

    def _quorum_available(self) -> bool:
        core = self.service.core if self.service else None
        if core is None or core.phase is not Phase.STREAMING:
            return False
        links = self.service.links  # type: ignore[union-attr]
        joined = sum(1 for n, p in core.peers.items() if p.elected and links[n].connected)
        return joined >= self._quorum()

    def _state(self, name: str, p: PeerState | None) -> str:
        link = self.service.links[name]  # type: ignore[union-attr]
        core = self.service.core  # type: ignore[union-attr]
        if not link.connected:
            return "down"
        if p is None or core is None or not p.elected:
            return "joining"
        if p.fetching or p.flush_lsn < core.term_start or \
                self.limbo.received_lsn - p.flush_lsn > CATCHING_UP_BYTES:
            return "catching up"
        return "streaming"

    def _flush(self, name: str, p: PeerState | None) -> int:
        if p is not None and p.elected:
            return p.flush_lsn
        return self.flushes.get(name, 0)

    def _term(self, name: str, p: PeerState | None) -> int | None:
        core = self.service.core if self.service else None
        if p is not None and p.elected and core is not None:
            return core.term
        if p is not None and p.greeted_term is not None:
            return p.greeted_term
        return self.terms.get(name)

    def _ack_vector(self) -> dict[str, str]:
        core = self.service.core if self.service else None
        return {name: format_lsn(self._flush(name, core.peers.get(name) if core else None))
                for name in (self.service.links if self.service else ())}

    def _down(self) -> list[str]:
        return [n for n, link in (self.service.links.items() if self.service else ()) if not link.connected]

    def _peer_log_context(self, name: object) -> dict[str, object]:
        """Fields every log line about safekeeper `name` should carry."""
        svc = self.service
        if svc is None or name not in svc.links:
            return {}
        p = svc.core.peers.get(name) if svc.core else None  # type: ignore[arg-type]
        out: dict[str, object] = {}
        node = self.node_ids.get(name) if p is None or p.node_id is None else p.node_id
        if node is not None:
            out["safekeeper_id"] = node
        term = self._term(name, p)  # type: ignore[arg-type]
        if term is not None:
            out["term"] = term
        out["flush_lsn"] = format_lsn(self._flush(name, p))  # type: ignore[arg-type]
        return out

    def peers(self) -> list[dict[str, Any]]:
        """One row per configured safekeeper, as `walsidecar status` shows it."""
        svc = self.service
        if svc is None:
            return []
        now = self.clock()
        core = svc.core
        rows = []
        for name, link in svc.links.items():
            p = core.peers.get(name) if core else None
            flush = self._flush(name, p)
            received = self.limbo.received_lsn
            contact = self.last_contact.get(name)
            node = p.node_id if p is not None and p.node_id is not None else self.node_ids.get(name)
            rows.append({
                "id": node,
                "address": name,
                "state": self._state(name, p),
                "term": self._term(name, p),
                "flush_lsn": format_lsn(flush) if flush else None,
                "lag_bytes": max(received - flush, 0) if received and flush else None,
                "lag_seconds": round(self.limbo.lag_seconds(flush, now), 3) if received and flush else None,
                "last_contact_seconds": round(now - contact, 3) if contact is not None else None,
                "reconnects": link.reconnects,
                "catching_up_from_primary": bool(p is not None and p.fetching),
            })
        return rows

    def status(self) -> dict[str, Any]:
        """The /status document."""
        svc = self.service
        now = self.clock()
        core = svc.core if svc else None
        oldest = self.limbo.oldest(now)
        pr = self.primary
        return {
            "role": "proposer",
            "version": __version__,
            "application_name": svc.opts.application_name if svc else None,
            "slot": svc.opts.slot if svc else None,
            "insecure": svc.opts.ssl_context is None if svc else None,
            "link_security": _link_security(svc.opts.ssl_context) if svc else None,
            "uptime_seconds": round(now - self.started, 1),
            "phase": core.phase.value if core else "between terms",
            "term": core.term if core and core.term else (svc.last_term if svc else 0),
            "term_start_lsn": format_lsn(core.term_start) if core and core.term_start else None,
            "commit_lsn": format_lsn(core.commit_lsn) if core and core.commit_lsn else None,
            "received_lsn": format_lsn(self.limbo.received_lsn) if self.limbo.received_lsn else None,
            "quorum": self._quorum(),
            "safekeepers_configured": len(svc.links) if svc else 0,
            "quorum_available": self._quorum_available(),
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
                # The error text can name hosts and users: the log has it, a stranger need not.
                "error": "unreachable (see the proposer's log)" if pr.error else None,
                "polled_seconds_ago": round(now - pr.polled_at, 1) if pr.polled_at else None,
            },
            "safekeepers": self.peers(),
        }

    # ---- scrape-time gauges --------------------------------------------------------------------

    def _collect(self) -> Iterable[Metric]:
        svc = self.service
        now = self.clock()
        core = svc.core if svc else None
        yield info("walsidecar_proposer", "Version and names this proposer runs with.",
                   {"version": __version__, "application_name": svc.opts.application_name if svc else "",
                    "slot": svc.opts.slot if svc else ""})
        term = core.term if core and core.term else (svc.last_term if svc else 0)
        yield gauge("walsidecar_proposer_term", "Current (or last) term of this proposer.", term)
        yield gauge("walsidecar_proposer_streaming", "1 while a term streams WAL from the primary.",
                    1 if self._streaming() else 0)
        yield gauge("walsidecar_proposer_term_start_lsn_bytes", "Where the current term's WAL starts.",
                    core.term_start if core else 0)
        yield gauge("walsidecar_proposer_commit_lsn_bytes",
                    "Quorum-flushed position reported to the primary as flush.", core.commit_lsn if core else 0)
        yield gauge("walsidecar_proposer_received_lsn_bytes", "End of the WAL received from the primary.",
                    self.limbo.received_lsn)
        yield gauge("walsidecar_proposer_quorum_available",
                    "1 while at least a quorum of safekeepers are connected and in the current term.",
                    1 if self._quorum_available() else 0)
        yield gauge("walsidecar_proposer_quorum_size", "Safekeepers needed to acknowledge a commit.", self._quorum())
        yield gauge("walsidecar_proposer_safekeepers", "Safekeepers configured.", len(svc.links) if svc else 0)
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
        pr = self.primary
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
        svc = self.service
        if svc is None or pr.polled_at is None or pr.error is not None:
            return
        status = gauge("walsidecar_primary_slot_wal_status",
                       "1 for the slot's current wal_status (missing: the slot does not exist).",
                       labels=["slot", "wal_status"])
        safe = gauge("walsidecar_primary_slot_safe_wal_size_bytes",
                     "WAL that can still be written before the slot is at risk (absent when unlimited).",
                     labels=["slot"])
        kept = gauge("walsidecar_primary_slot_retained_bytes", "WAL the slot keeps on the primary.", labels=["slot"])
        for slot in (svc.opts.slot, svc.opts.horizon_slot):
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
    from sidecar.linkauth import LinkAuth
    return None if security is None else "auth-only" if isinstance(security, LinkAuth) else "tls"

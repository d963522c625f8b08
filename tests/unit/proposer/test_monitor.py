"""ProposerMonitor against a fake published view: the /status document, the gauges and the limbo alert."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import structlog

from sidecar.consensus.messages import NO_DEGRADED, DegradedRange
from sidecar.consensus.proposer import Campaign, ElectionWon, PeerJoined, Phase
from sidecar.lsn import format_lsn
from sidecar.consensus.commitwait import parse_commit_wait
from sidecar.proposer.monitor import CATCHING_UP_BYTES, ProposerMonitor
from sidecar.proposer.options import StartOptions
from sidecar.proposer.primary import PrimarySnapshot
from sidecar.proposer.view import PeerView

BOOT = 0x3000000
PEERS = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


@dataclass
class FakeView:
    options: StartOptions = field(default_factory=lambda: StartOptions("dbname=none", PEERS, 2))
    term: int = 0
    phase: Phase | None = None
    term_start: int = 0
    commit_lsn: int = 0
    primary_poll: PrimarySnapshot = field(default_factory=PrimarySnapshot)
    degraded: DegradedRange = NO_DEGRADED
    degraded_acknowledging: bool = False
    rows: dict[str, PeerView] = field(default_factory=lambda: {n: PeerView(n, False, 0) for n in PEERS})

    def peers(self) -> list[PeerView]:
        return list(self.rows.values())

    def peer(self, name: str) -> PeerView | None:
        return self.rows.get(name)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def streaming_view() -> FakeView:
    """Term 4 streaming from BOOT: one safekeeper caught up, one catching up from pg_wal, one down."""
    view = FakeView(term=4, phase=Phase.STREAMING, term_start=BOOT, commit_lsn=BOOT + 100)
    a, b, c = PEERS
    view.rows = {
        a: PeerView(a, True, 0, node_id=1, greeted_term=3, elected=True, flush_lsn=BOOT + 100),
        b: PeerView(b, True, 2, node_id=2, greeted_term=3, elected=True, flush_lsn=BOOT - 10, fetching=True),
        c: PeerView(c, False, 5),
    }
    return view


def sample(monitor: ProposerMonitor, name: str, **labels: str) -> float | None:
    return monitor.metrics.registry.get_sample_value(name, labels)


def test_between_terms_the_document_says_so() -> None:
    view = FakeView(term=7)
    monitor = ProposerMonitor(view, clock=Clock())
    doc = monitor.status()
    assert doc["phase"] == "between terms" and doc["term"] == 7
    assert doc["commit_lsn"] is None and doc["quorum"] == 2 and doc["safekeepers_configured"] == 3
    assert not doc["quorum_available"]
    assert doc["insecure"] is True and doc["link_security"] is None
    assert [r["state"] for r in doc["safekeepers"]] == ["down"] * 3
    assert doc["primary"]["error"] is None and doc["primary"]["flush_lsn"] is None
    assert sample(monitor, "walsidecar_proposer_term") == 7
    assert sample(monitor, "walsidecar_proposer_streaming") == 0
    assert sample(monitor, "walsidecar_primary_up") == 0


def test_status_rows_and_gauges_follow_the_view() -> None:
    view, clock = streaming_view(), Clock()
    monitor = ProposerMonitor(view, clock=clock)
    monitor.wal_received(BOOT + 300, 300)
    clock.now += 2
    monitor.committed(BOOT + 100)
    monitor.peer_contact(PEERS[0])
    clock.now += 1

    doc = monitor.status()
    assert doc["phase"] == "streaming" and doc["term"] == 4
    assert doc["term_start_lsn"] == format_lsn(BOOT) and doc["commit_lsn"] == format_lsn(BOOT + 100)
    assert doc["received_lsn"] == format_lsn(BOOT + 300)
    assert doc["quorum_available"]  # the one catching up is in the term too
    rows = {r["address"]: r for r in doc["safekeepers"]}
    a, b, c = PEERS
    assert rows[a] | {"last_contact_seconds": None} == {
        "id": 1, "address": a, "state": "streaming", "term": 4, "flush_lsn": format_lsn(BOOT + 100),
        "lag_bytes": 200, "lag_seconds": 3.0, "last_contact_seconds": None, "reconnects": 0,
        "catching_up_from_primary": False}
    assert rows[a]["last_contact_seconds"] == 1.0
    assert rows[b]["state"] == "catching up" and rows[b]["catching_up_from_primary"]
    assert rows[c]["state"] == "down" and rows[c]["term"] is None and rows[c]["reconnects"] == 5
    assert doc["limbo"]["pending_bytes"] == 200 and doc["limbo"]["acknowledged"][c] == format_lsn(0)

    assert sample(monitor, "walsidecar_proposer_commit_lsn_bytes") == BOOT + 100
    assert sample(monitor, "walsidecar_proposer_safekeeper_up", safekeeper=c, safekeeper_id="") == 0
    assert sample(monitor, "walsidecar_proposer_safekeeper_streaming", safekeeper=a, safekeeper_id="1") == 1
    assert sample(monitor, "walsidecar_proposer_safekeeper_lag_bytes", safekeeper=a, safekeeper_id="1") == 200
    assert sample(monitor, "walsidecar_proposer_safekeeper_reconnects_total", safekeeper=b,
                  safekeeper_id="2") == 2


def test_quorum_is_available_while_a_quorum_of_connected_safekeepers_is_in_the_term() -> None:
    view = streaming_view()
    monitor = ProposerMonitor(view, clock=Clock())
    assert monitor.status()["quorum_available"]
    view.rows[PEERS[1]] = replace(view.rows[PEERS[1]], connected=False)
    assert not monitor.status()["quorum_available"]
    assert sample(monitor, "walsidecar_proposer_quorum_available") == 0


def test_events_count_elections_and_campaigns() -> None:
    monitor = ProposerMonitor(FakeView(), clock=Clock())
    monitor.event(Campaign(1))
    monitor.event(Campaign(2))
    monitor.event(ElectionWon(2, PEERS[0], BOOT, list(PEERS[:2])))
    assert sample(monitor, "walsidecar_proposer_campaigns_total") == 2
    assert sample(monitor, "walsidecar_proposer_elections_total") == 1


def test_the_primary_poll_shows_in_status_and_gauges() -> None:
    view, clock = FakeView(), Clock()
    view.primary_poll = PrimarySnapshot(polled_at=clock.now - 3, flush_lsn=BOOT + 5, commits_waiting=2,
                                        oldest_wait_seconds=1.25, sync_state="sync", replication_state="streaming",
                                        slots={"walsidecar": {"wal_status": "reserved", "safe_wal_size": None,
                                                              "active": True, "retained_bytes": 100}})
    monitor = ProposerMonitor(view, clock=clock)
    primary = monitor.status()["primary"]
    assert primary["flush_lsn"] == format_lsn(BOOT + 5) and primary["polled_seconds_ago"] == 3.0
    assert primary["sync_state"] == "sync" and primary["commits_waiting"] == 2
    assert sample(monitor, "walsidecar_primary_up") == 1
    assert sample(monitor, "walsidecar_primary_slot_wal_status", slot="walsidecar", wal_status="reserved") == 1
    assert sample(monitor, "walsidecar_primary_slot_wal_status", slot="walsidecar_horizon",
                  wal_status="missing") == 1
    assert sample(monitor, "walsidecar_primary_slot_retained_bytes", slot="walsidecar") == 100

    view.primary_poll = replace(view.primary_poll, error="connection refused")
    assert monitor.status()["primary"]["error"] == "unreachable (see the proposer's log)"
    assert sample(monitor, "walsidecar_primary_up") == 0


def test_commits_waiting_past_the_alert_are_logged_once_and_cleared() -> None:
    view, clock = streaming_view(), Clock()
    monitor = ProposerMonitor(view, quorum_wait_alert=10, clock=clock)
    monitor.wal_received(BOOT + 300, 300)
    clock.now += 11
    with structlog.testing.capture_logs() as logs:
        monitor._tick()
        monitor._tick()
        monitor.committed(BOOT + 300)
        monitor._tick()
    assert [e["event"] for e in logs if e["log_level"] != "info"] == [
        "commits are waiting for the safekeeper quorum", "the safekeeper quorum acknowledges WAL again"]
    assert logs[0]["down"] == [PEERS[2]] and logs[0]["quorum"] == 2
    assert sample(monitor, "walsidecar_proposer_quorum_wait_alerts_total") == 1
    assert sample(monitor, "walsidecar_proposer_quorum_wait_alert") == 0


def test_a_safekeeper_far_behind_is_logged_catching_up_when_it_joins() -> None:
    view = streaming_view()
    monitor = ProposerMonitor(view, clock=Clock())
    monitor.wal_received(BOOT + CATCHING_UP_BYTES + 100, CATCHING_UP_BYTES + 100)
    with structlog.testing.capture_logs() as logs:
        monitor.event(PeerJoined(PEERS[0], 4, BOOT))
    assert [(e["event"], e["peer"], e["behind_bytes"]) for e in logs] == [
        ("safekeeper catching up", PEERS[0], CATCHING_UP_BYTES + 100)]


def test_the_commit_wait_policy_and_the_terminated_commits_show() -> None:
    view = FakeView(options=StartOptions("dbname=none", PEERS, 2, commit_wait=parse_commit_wait("terminate-after=30s")))
    monitor = ProposerMonitor(view, clock=Clock())
    assert monitor.status()["commit_wait"] == "terminate-after=30s"
    assert sample(monitor, "walsidecar_primary_commits_terminated_total", reason="no-quorum") == 0
    view.primary_poll.commits_terminated.update({"no-quorum": 3, "lineage-ended": 1})
    assert sample(monitor, "walsidecar_primary_commits_terminated_total", reason="no-quorum") == 3
    assert sample(monitor, "walsidecar_primary_commits_terminated_total", reason="lineage-ended") == 1
    assert monitor.status()["primary"]["commits_terminated"] == {"no-quorum": 3, "lineage-ended": 1}
    assert ProposerMonitor(FakeView(), clock=Clock()).status()["commit_wait"] == "wait"


def test_an_open_degraded_range_shows_in_status_and_gauges() -> None:
    view = FakeView(options=StartOptions("dbname=none", PEERS, 2, commit_wait=parse_commit_wait("degrade-after=30s")))
    monitor = ProposerMonitor(view, clock=Clock())
    assert monitor.status()["degraded"] is None
    assert sample(monitor, "walsidecar_proposer_degraded") == 0
    view.degraded, view.degraded_acknowledging = DegradedRange(4, BOOT, 2, frozenset({3, 1})), True
    assert monitor.status()["degraded"] == {"term": 4, "start_lsn": format_lsn(BOOT), "version": 2, "members": [1, 3],
                                            "acknowledging": True}
    assert sample(monitor, "walsidecar_proposer_degraded") == 1
    assert sample(monitor, "walsidecar_proposer_degraded_start_lsn_bytes") == BOOT
    assert sample(monitor, "walsidecar_proposer_degraded_acknowledging") == 1

"""The safekeeper's monitor against a view it is handed (no server): /status, /health and the gauges
say what the view says, and nothing a stranger should not read."""

from __future__ import annotations

import time
from dataclasses import replace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.broker import SafekeeperState
from sidecar.consensus.messages import TermEntry
from sidecar.consensus.state import AcceptorState
from sidecar.metrics import SafekeeperMetrics
from sidecar.safekeeper.monitor import SafekeeperMonitor
from sidecar.safekeeper.diskguard import DiskUsage
from sidecar.safekeeper.horizon import Horizon
from sidecar.safekeeper.positions import Positions
from sidecar.safekeeper.view import BrokerView, SafekeeperView, SlotView

SEG = 16 << 20
STATE = AcceptorState(7301, SEG, 15, 2, term=5, term_history=(TermEntry(3, 0x1000000), TermEntry(5, 0x2000000)),
                      commit_lsn=0x2000100, peer_horizon_lsn=0x2000080, backup_lsn=0x2000000)
VIEW = SafekeeperView(
    node_id=2, listen="127.0.0.1:7602", link_security="tls", state=STATE,
    positions=Positions(term=5, flush_lsn=0x2000200, commit_lsn=0x2000100, generation=1), elected_term=5,
    write_lsn=0x2000300, proposer_connected=True, disk_full=False, fatal=None, stopped=False,
    reader_listen="127.0.0.1:7612", readers=2, streaming_readers=1,
    slots=(SlotView("standby1", 0x2000080, 2, False, True), SlotView("new", 0, 0, False, False)),
    removal_horizon=Horizon(0x2000000, 'reader slot "standby1"'), disk_usage=DiskUsage(2 * SEG, 10 << 30, 100 << 30),
    archive="s3://bucket/wal", archive_error="ArchiveMismatch: the archived 000000010000000000000002 is not ...",
    archive_mismatch="000000010000000000000002")


class Published:
    """Stands in for a Safekeeper: event metrics and a view the test changes at will."""

    def __init__(self, view: SafekeeperView) -> None:
        self.stats = SafekeeperMetrics(view.node_id)
        self.current = view

    def view(self) -> SafekeeperView:
        return self.current


def gauges(mon: SafekeeperMonitor) -> dict[str, float]:
    text = generate_latest(mon.stats.registry).decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_status_is_the_view() -> None:
    doc = SafekeeperMonitor(Published(VIEW)).status()
    uptime = doc.pop("uptime_seconds")
    assert uptime >= 0
    assert doc == {
        "role": "safekeeper", "version": doc["version"], "id": 2, "listen": "127.0.0.1:7602", "insecure": False,
        "link_security": "tls", "system_id": "7301", "timeline": 2, "wal_seg_size": SEG, "pg_version": 15,
        "term": 5, "term_history": [[3, "0/1000000"], [5, "0/2000000"]], "elected_term": 5,
        "learning_term_from_peers": 0, "members": 0, "lost_disk_term": 0, "flush_lsn": "0/2000200", "write_lsn": "0/2000300", "commit_lsn": "0/2000100",
        "peer_horizon_lsn": "0/2000080", "backup_lsn": "0/2000000", "archiving": True, "archive_failing": True,
        "archive_mismatch": "000000010000000000000002",
        "proposer_connected": True, "fatal": None, "stopped": None,
        "reader_listen": "127.0.0.1:7612", "readers": 2, "streaming_readers": 1,
        "slots": [{"name": "standby1", "restart_lsn": "0/2000080", "timeline": 2, "temporary": False, "active": True},
                  {"name": "new", "restart_lsn": None, "timeline": None, "temporary": False, "active": False}],
        "broker": None,
        "removal_horizon": "0/2000000", "removal_held_by": 'reader slot "standby1"', "wal_bytes": 2 * SEG,
        "disk_guard": None,
    }


def test_a_fresh_safekeeper_shows_no_identity() -> None:
    doc = SafekeeperMonitor(Published(replace(VIEW, state=AcceptorState(), positions=Positions(),
                                              link_security=None))).status()
    assert doc["system_id"] is None and doc["term_history"] == [] and doc["insecure"] is True
    assert (doc["term"], doc["flush_lsn"], doc["commit_lsn"]) == (0, "0/0", "0/0")


def test_an_empty_data_directory_shows_how_many_peers_it_waits_for() -> None:
    doc = SafekeeperMonitor(Published(replace(VIEW, state=AcceptorState(), learning_term_from=2, members=3))).status()
    assert (doc["learning_term_from_peers"], doc["members"]) == (2, 3)
    doc = SafekeeperMonitor(Published(replace(VIEW, lost_disk_term=4))).status()
    assert doc["lost_disk_term"] == 4


def test_health_says_why_it_stopped_without_error_texts() -> None:
    sk = Published(VIEW)
    mon = SafekeeperMonitor(sk)
    assert (mon.health().status, mon.health().body) == (200, b"ok\n")
    sk.current = replace(VIEW, stopped=True, disk_full=True)
    assert mon.health().status == 503 and mon.health().body.startswith(b"disk full: no longer acknowledging")
    assert mon.status()["stopped"].startswith("disk full") and mon.status()["fatal"] is None
    sk.current = replace(VIEW, stopped=True, fatal="OSError")
    health = mon.health()
    assert health.status == 503 and health.body == b"stopped after a fatal OSError: WAL in doubt; " \
        b"see the safekeeper's log\n"
    assert mon.status()["fatal"] == "OSError"


def test_gauges_follow_the_published_view() -> None:
    sk = Published(VIEW)
    mon = SafekeeperMonitor(sk)
    g = gauges(mon)
    assert g["walsidecar_safekeeper_term"] == 5 and g["walsidecar_safekeeper_last_log_term"] == 5
    assert g["walsidecar_safekeeper_flush_lsn_bytes"] == 0x2000200
    assert g["walsidecar_safekeeper_write_lsn_bytes"] == 0x2000300
    assert g["walsidecar_safekeeper_commit_lsn_bytes"] == 0x2000100
    assert g["walsidecar_safekeeper_peer_horizon_lsn_bytes"] == 0x2000080
    assert g["walsidecar_safekeeper_backup_lsn_bytes"] == 0x2000000 and g["walsidecar_safekeeper_archive_failing"] == 1
    assert g["walsidecar_safekeeper_archive_mismatch"] == 1
    assert g["walsidecar_safekeeper_proposer_connected"] == 1 and g["walsidecar_safekeeper_disk_full"] == 0
    assert g["walsidecar_safekeeper_readers"] == 2 and g["walsidecar_safekeeper_streaming_readers"] == 1
    text = generate_latest(mon.stats.registry).decode()
    assert 'walsidecar_reader_slot_lsn_bytes{safekeeper_id="2",slot="standby1"} 3.355456e+07' in text
    assert 'walsidecar_reader_slot_active{safekeeper_id="2",slot="standby1"} 1.0' in text
    sk.current = replace(VIEW, positions=VIEW.positions._replace(commit_lsn=0x2000200), proposer_connected=False,
                         stopped=True, disk_full=True)
    g = gauges(mon)
    assert g["walsidecar_safekeeper_commit_lsn_bytes"] == 0x2000200
    assert g["walsidecar_safekeeper_proposer_connected"] == 0 and g["walsidecar_safekeeper_disk_full"] == 1


def test_peer_gauges_are_what_the_broker_showed_it() -> None:
    peers = (SafekeeperState(1, flush_lsn=0x2000300, commit_lsn=0x2000100, term=5, proposer_connected=True,
                             last_updated=time.time()),
             SafekeeperState(3, flush_lsn=0x1000000, term=4, last_updated=time.time() - 60))
    broker = BrokerView(("http://127.0.0.1:2379",), "prod", 2, connected=False, error="no etcd endpoint answered",
                        published_ago=12.0, peers=peers, uploader=1, leading=False)
    mon = SafekeeperMonitor(Published(replace(VIEW, broker=broker)))
    text = generate_latest(mon.stats.registry).decode()
    samples = {(s.name, s.labels.get("peer_id")): s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples}
    assert samples[("walsidecar_safekeeper_broker_connected", None)] == 0
    assert samples[("walsidecar_safekeeper_peer_flush_lsn_bytes", "1")] == 0x2000300
    assert samples[("walsidecar_safekeeper_peer_flush_lsn_bytes", "3")] == 0x1000000
    assert samples[("walsidecar_safekeeper_peer_term", "3")] == 4
    assert samples[("walsidecar_safekeeper_peer_proposer_connected", "1")] == 1
    assert samples[("walsidecar_safekeeper_peer_age_seconds", "3")] >= 60
    assert samples[("walsidecar_safekeeper_uploader", None)] == 0
    doc = mon.status()["broker"]
    assert doc["cluster"] == "prod" and doc["uploader"] == 1 and doc["error"] == "no etcd endpoint answered"
    assert [p["id"] for p in doc["peers"]] == [1, 3] and doc["peers"][1]["flush_lsn"] == "0/1000000"


def test_removal_horizon_wal_bytes_and_the_disk_guard_are_exported() -> None:
    mon = SafekeeperMonitor(Published(replace(VIEW, disk_guard="disk guard: over the limit")))
    g = gauges(mon)
    assert g["walsidecar_safekeeper_removal_horizon_lsn_bytes"] == 0x2000000
    assert g["walsidecar_safekeeper_wal_disk_bytes"] == 2 * SEG
    assert g["walsidecar_safekeeper_filesystem_used_bytes"] == 10 << 30
    assert g["walsidecar_safekeeper_disk_guard_active"] == 1
    assert 'held_by="reader slot \\"standby1\\""' in generate_latest(mon.stats.registry).decode()
    assert mon.status()["disk_guard"] == "disk guard: over the limit"

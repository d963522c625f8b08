"""Prometheus metrics of the proposer and the safekeepers (all named walsidecar_*).

Event metrics (counters, histograms) are updated where things happen; state gauges are
computed at scrape time from the services' in-memory state, so the WAL path pays nothing
for them. LSNs are exported as byte positions, as Patroni and postgres_exporter do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

# The *_created series only double the output; counters here start with the process anyway.
disable_created_metrics()

# Commit acknowledgements are milliseconds when healthy and can hang for minutes without a quorum.
ACK_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
FSYNC_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)

SLOT_WAL_STATUSES = ("reserved", "extended", "unreserved", "lost", "missing")


class ProposerMetrics:
    """Event metrics of the proposer, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.wal_received = Counter("walsidecar_proposer_wal_received_bytes",
                                    "WAL bytes received from the primary's replication stream.", registry=r)
        self.commit_ack = Histogram("walsidecar_proposer_commit_ack_seconds",
                                    "Time from WAL arriving from the primary to a quorum of safekeepers "
                                    "acknowledging it (the sidecar's share of commit latency).",
                                    buckets=ACK_BUCKETS, registry=r)
        self.elections = Counter("walsidecar_proposer_elections",
                                 "Terms this proposer won (a new replication stream is a new term).", registry=r)
        self.campaigns = Counter("walsidecar_proposer_campaigns",
                                 "Vote requests sent for a term (retries after timeouts or higher terms).",
                                 registry=r)
        self.terms_lost = Counter("walsidecar_proposer_terms_lost",
                                  "Terms ended because a safekeeper had promised a higher term.", registry=r)
        self.quorum_wait_alerts = Counter("walsidecar_proposer_quorum_wait_alerts",
                                          "Times the oldest unacknowledged WAL waited past --quorum-wait-alert.",
                                          registry=r)

    def add_collector(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Register scrape-time gauges produced by `collect`."""
        self.registry.register(_FunctionCollector(collect))


class SafekeeperMetrics:
    """Event metrics of one safekeeper, labelled with its id."""

    def __init__(self, node_id: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, sk = self.registry, str(node_id)
        self.wal_written = Counter("walsidecar_safekeeper_wal_written_bytes", "WAL bytes written to segment files.",
                                   ["safekeeper_id"], registry=r).labels(sk)
        self.fsync = Histogram("walsidecar_safekeeper_fsync_seconds",
                               "Duration of one group fdatasync of the WAL (what an acknowledgement waits for).",
                               ["safekeeper_id"], buckets=FSYNC_BUCKETS, registry=r).labels(sk)
        votes = Counter("walsidecar_safekeeper_votes", "Vote requests answered.", ["safekeeper_id", "granted"],
                        registry=r)
        self.votes_granted, self.votes_refused = votes.labels(sk, "true"), votes.labels(sk, "false")
        self.elections = Counter("walsidecar_safekeeper_elections",
                                 "Elected messages applied: terms this safekeeper joined.", ["safekeeper_id"],
                                 registry=r).labels(sk)
        self.connections = Counter("walsidecar_safekeeper_connections", "Connections accepted.",
                                   ["safekeeper_id"], registry=r).labels(sk)
        self.disk_full = Counter("walsidecar_safekeeper_disk_full_errors",
                                 "Writes that found no space (ENOSPC): WAL, control file or the spare segment.",
                                 ["safekeeper_id"], registry=r).labels(sk)
        self.wal_removed = Counter("walsidecar_safekeeper_wal_removed_bytes",
                                   "WAL bytes removed below the removal horizon (whole segments).",
                                   ["safekeeper_id"], registry=r).labels(sk)
        self.archived = Counter("walsidecar_safekeeper_archived_bytes", "WAL bytes this safekeeper uploaded to the "
                                "archive (--archive).", ["safekeeper_id"], registry=r).labels(sk)
        self.archive_mismatches = Counter("walsidecar_safekeeper_archive_mismatches",
                                          "Archived objects found not to hold this safekeeper's WAL of their segment "
                                          "(each counted once; the log names them): backup_lsn stops below them.",
                                          ["safekeeper_id"], registry=r).labels(sk)

    def add_collector(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Register scrape-time gauges produced by `collect`."""
        self.registry.register(_FunctionCollector(collect))


class _FunctionCollector(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()

    def describe(self) -> Iterable[Metric]:
        return []  # the metric set depends on state, so it is not pre-declared


def gauge(name: str, doc: str, value: float | None = None, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    """A gauge family; pass `value` for an unlabelled one."""
    g = GaugeMetricFamily(name, doc, labels=list(labels) if value is None else None)
    if value is not None:
        g.add_metric([], value)
    return g


def counter(name: str, doc: str, labels: Iterable[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


def info(name: str, doc: str, values: dict[str, str]) -> InfoMetricFamily:
    i = InfoMetricFamily(name, doc)
    i.add_metric([], values)
    return i

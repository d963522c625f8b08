"""Operator tooling against a real primary and real safekeepers: check, status, metrics, views, init-postgres."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.backends import PgServer
from support.deployment import APP, Deployment, start_commit, syncrep_waiters
from support.helpers import free_port, wait_for, walsidecar
from support.procs import ProcessTracker
from sidecar.consensus.state import AcceptorState
from sidecar.lsn import parse_lsn
from sidecar.safekeeper.control import CONTROL_FILE, ControlData, load_control, save_control

pytestmark = pytest.mark.integration


def scrape(address: str) -> dict[str, list]:
    """Samples by metric family name, parsed with prometheus_client's own parser."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {fam.name: fam.samples for fam in text_string_to_metric_families(text)}


def value(samples: dict[str, list], family: str, sample: str | None = None, **labels: str) -> float:
    for s in samples[family]:
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{family} {sample} {labels}")


def status_json(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/status", timeout=10) as resp:
        return json.loads(resp.read())


class Ops:
    """A Deployment whose proposer and safekeepers serve metrics."""

    def __init__(self, d: Deployment) -> None:
        self.d = d
        self.proposer_metrics = f"127.0.0.1:{free_port()}"
        self.sk_metrics = {i: f"127.0.0.1:{free_port()}" for i in (1, 2, 3)}

    def start_safekeeper(self, i: int) -> None:
        self.d.start_safekeeper(i, "--metrics", self.sk_metrics[i])

    def start(self, *proposer_args: str) -> None:
        for i in (1, 2, 3):
            self.start_safekeeper(i)
        self.d.start_proposer("--metrics", self.proposer_metrics, *proposer_args)
        self.d.wait_sync()
        # A quorum is enough for sync; the tests start from all three streaming.
        wait_for(lambda: {r["state"] for r in status_json(self.proposer_metrics)["safekeepers"]} == {"streaming"},
                 timeout=60, what="all three safekeepers streaming")

    @property
    def sks(self) -> str:
        return ",".join(self.d.addresses)

    def check(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return walsidecar("check", "--pg-dsn", self.d.pg.dsn(), "--safekeepers", self.sks, *self.d.tls("client"),
                          *extra)

    def status(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return walsidecar("status", "--proposer-metrics", self.proposer_metrics, "--safekeepers", self.sks,
                          "--pg-dsn", self.d.pg.dsn(), *self.d.tls("client"), *extra)


@pytest.fixture
def ops(pg_factory, procs: ProcessTracker, test_dir: Path) -> Ops:
    pg: PgServer = pg_factory(settings={"synchronous_standby_names": APP, "max_slot_wal_keep_size": "1GB"})
    o = Ops(Deployment(pg, procs, test_dir))
    o.start("--quorum-wait-alert", "1")
    with o.d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
    return o


def commit_lsn(d: Deployment, sql: str) -> int:
    with d.sql() as c:
        c.execute(sql)
        return parse_lsn(c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])


def test_check_passes_on_a_healthy_deployment(ops: Ops) -> None:
    out = ops.check("--proposer-metrics", ops.proposer_metrics)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    checks = [ln.strip() for ln in lines[1:-1]]
    assert all(": OK" in c or ": WARNING" in c for c in checks), out.stdout
    assert any(c.startswith("TLS: OK") for c in checks), out.stdout
    for name in ("wal_level", "max_wal_senders", "max_replication_slots", "synchronous_standby_names",
                 "synchronous_commit", "max_slot_wal_keep_size", "replication slot walsidecar",
                 "safekeeper quorum", "sidecar streaming"):
        assert any(c.startswith(f"{name}: OK") for c in checks), (name, out.stdout)
    assert sum(c.startswith("safekeeper 127.0.0.1:") and "system id: OK" in c for c in checks) == 3
    assert lines[-1].endswith("0 FAILED")
    doc = json.loads(ops.check("--format", "json").stdout)
    assert doc["ok"] is True and doc["counts"]["FAILED"] == 0
    assert {c["name"] for c in doc["checks"]} >= {"PostgreSQL", "safekeeper quorum", "sidecar streaming"}


def test_check_fails_with_hints_and_changes_nothing(pg_factory, procs: ProcessTracker, test_dir: Path) -> None:
    # synchronous_standby_names left empty, no sidecar, one safekeeper holding another cluster's WAL,
    # one fresh and one not running at all.
    pg: PgServer = pg_factory()
    d = Deployment(pg, procs, test_dir)
    d.sk_dir(1).mkdir()
    save_control(d.sk_dir(1), ControlData(1, AcceptorState(system_id=42, wal_seg_size=16 << 20, pg_version=15,
                                                           timeline=1, term=7)))
    before = (d.sk_dir(1) / CONTROL_FILE).read_bytes()
    d.start_safekeeper(1)
    d.start_safekeeper(2)
    wait_for(lambda: all(_listening(a) for a in d.addresses[:2]), timeout=30, what="safekeepers to listen")
    out = walsidecar("check", "--pg-dsn", pg.dsn(), "--safekeepers", ",".join(d.addresses), *d.tls("client"))
    assert out.returncode == 1, out.stdout
    text = out.stdout
    sync = next(ln for ln in text.splitlines() if ln.strip().startswith("synchronous_standby_names:"))
    assert "FAILED" in sync and "does not name 'walsidecar'" in sync
    assert "hint: ALTER SYSTEM SET synchronous_standby_names = 'walsidecar'; SELECT pg_reload_conf();" in sync
    foreign = next(ln for ln in text.splitlines() if f"safekeeper {d.addresses[0]} system id" in ln)
    assert "FAILED" in foreign and "holds WAL of system 42" in foreign and "hint: it belongs to another cluster" in foreign
    fresh = next(ln for ln in text.splitlines() if f"safekeeper {d.addresses[1]} system id" in ln)
    assert "OK" in fresh and "not initialised yet" in fresh
    down = next(ln for ln in text.splitlines() if ln.strip().startswith(f"safekeeper {d.addresses[2]}:"))
    assert "FAILED" in down and "Connection refused" in down and "hint: start it" in down
    # The hint is a command: with its placeholders filled in, it starts the missing safekeeper.
    pasted = down.split("hint: start it (", 1)[1].split(", with its own id", 1)[0]
    filled = {"N": "3", "DIR": str(d.sk_dir(3)), "CERTS_DIR": str(d.pki.certs("safekeeper", 3))}
    argv = [filled.get(w, w) for w in shlex.split(pasted)]
    assert argv[:2] == ["walsidecar", "safekeeper"] and {"--id", "--data-dir", "--listen"} <= set(argv), pasted
    procs.start([sys.executable, "-m", "sidecar", *argv[1:]], name="pasted-safekeeper")
    wait_for(lambda: _listening(d.addresses[2]), timeout=30, what="the pasted command's safekeeper to listen")
    quorum = next(ln for ln in text.splitlines() if ln.strip().startswith("safekeeper quorum"))
    assert "FAILED" in quorum and "only 1 of 3 usable" in quorum
    streaming = next(ln for ln in text.splitlines() if ln.strip().startswith("sidecar streaming"))
    assert "FAILED" in streaming and "hint: start the proposer" in streaming
    doc = json.loads(walsidecar("check", "--pg-dsn", pg.dsn(), "--safekeepers", ",".join(d.addresses),
                                *d.tls("client"), "--format", "json").stdout)
    assert doc["ok"] is False and all(c["hint"] for c in doc["checks"] if c["status"] == "FAILED")
    # The probe is read-only: the fresh safekeeper did not adopt this primary, the other kept its state.
    assert (load_control(d.sk_dir(2)) is None) or load_control(d.sk_dir(2)).state.system_id == 0
    assert (d.sk_dir(1) / CONTROL_FILE).read_bytes() == before
    assert load_control(d.sk_dir(1)).state.system_id == 42


def test_check_names_the_standby_commits_wait_for_when_it_is_not_the_sidecar(
        pg_factory, procs: ProcessTracker, test_dir: Path) -> None:
    pg: PgServer = pg_factory(settings={"synchronous_standby_names": "FIRST 1 (other)"})
    o = Ops(Deployment(pg, procs, test_dir))
    for i in (1, 2, 3):
        o.start_safekeeper(i)
    o.d.start_proposer("--metrics", o.proposer_metrics)
    wait_for(lambda: (o.d.replication_row() or (None, None))[1] == "streaming", timeout=60, what="the sidecar streams")
    wait_for(lambda: status_json(o.proposer_metrics)["quorum_available"], timeout=60, what="the quorum")
    thread, result = start_commit(pg.dsn(), "CREATE TABLE waits_for_other ()")
    wait_for(lambda: syncrep_waiters(o.d) == 1, timeout=30, what="the commit to wait")
    out = o.check("--proposer-metrics", o.proposer_metrics)
    lines = {ln.strip().split(":", 1)[0]: ln.strip() for ln in out.stdout.splitlines()}
    assert out.returncode == 1, out.stdout
    hint = "hint: ALTER SYSTEM SET synchronous_standby_names = 'walsidecar'; SELECT pg_reload_conf();"
    assert "commits wait for standby 'other', not for the safekeeper quorum" in lines["synchronous_standby_names"]
    waiting = lines["commits waiting"]
    assert "FAILED (1 waiting for standby 'other' named in synchronous_standby_names, which is not the sidecar " \
           "'walsidecar': the safekeeper quorum cannot release them)" in waiting and waiting.endswith(hint), waiting
    assert lines["safekeeper quorum"].startswith("safekeeper quorum: OK"), out.stdout  # the quorum is not blamed
    with o.d.sql() as c:  # the fix, as given
        c.execute("ALTER SYSTEM SET synchronous_standby_names = 'walsidecar'")
        c.execute("SELECT pg_reload_conf()")
    thread.join(60)
    assert result.get("done"), result
    assert o.check().returncode == 0


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def test_metrics_endpoints_are_scraped_and_parsed(ops: Ops) -> None:
    lsn = commit_lsn(ops.d, "INSERT INTO load SELECT g, repeat('m', 100) FROM generate_series(1, 1000) g")
    wait_for(lambda: value(scrape(ops.proposer_metrics), "walsidecar_proposer_commit_lsn_bytes") >= lsn,
             timeout=30, what="the commit LSN metric to pass the commit")
    m = scrape(ops.proposer_metrics)
    assert value(m, "walsidecar_proposer_term") >= 1
    assert value(m, "walsidecar_proposer_quorum_available") == 1
    assert value(m, "walsidecar_proposer_quorum_size") == 2
    assert value(m, "walsidecar_proposer_elections", "walsidecar_proposer_elections_total") >= 1
    assert value(m, "walsidecar_proposer_wal_received_bytes", "walsidecar_proposer_wal_received_bytes_total") > 0
    assert value(m, "walsidecar_proposer_commit_ack_seconds", "walsidecar_proposer_commit_ack_seconds_count") > 0
    # The primary is polled once a second, independently of the stream.
    wait_for(lambda: value(scrape(ops.proposer_metrics), "walsidecar_primary_slot_wal_status", slot="walsidecar",
                           wal_status="reserved") == 1, timeout=30, what="the slot status metric")
    assert value(m, "walsidecar_primary_up") == 1
    flushes = [value(m, "walsidecar_proposer_safekeeper_flush_lsn_bytes", safekeeper=a) for a in ops.d.addresses]
    assert sorted(flushes)[1] >= lsn  # a quorum (2 of 3) holds the commit
    for a in ops.d.addresses:
        wait_for(lambda: value(scrape(ops.proposer_metrics), "walsidecar_proposer_safekeeper_up", safekeeper=a) == 1,
                 timeout=30, what=f"safekeeper {a} up in the metrics")
        assert value(m, "walsidecar_proposer_safekeeper_lag_bytes", safekeeper=a) >= 0
        assert value(m, "walsidecar_proposer_safekeeper_reconnects",
                     "walsidecar_proposer_safekeeper_reconnects_total", safekeeper=a) >= 0
    assert all(name.startswith("walsidecar_") for name in m)
    for i, addr in ops.sk_metrics.items():
        sid = str(i)
        # The commit needed two safekeepers; the third may still be writing and syncing it.
        def synced(addr: str = addr, sid: str = sid) -> dict | None:
            m = scrape(addr)
            fsyncs = value(m, "walsidecar_safekeeper_fsync_seconds", "walsidecar_safekeeper_fsync_seconds_count",
                           safekeeper_id=sid)
            return m if fsyncs > 0 else None

        s = wait_for(synced, timeout=30, what=f"safekeeper {i} to have fsynced WAL")
        assert value(s, "walsidecar_safekeeper_term", safekeeper_id=sid) >= 1
        assert value(s, "walsidecar_safekeeper_wal_written_bytes", "walsidecar_safekeeper_wal_written_bytes_total",
                     safekeeper_id=sid) > 0
        assert value(s, "walsidecar_safekeeper_fsync_seconds", "walsidecar_safekeeper_fsync_seconds_count",
                     safekeeper_id=sid) > 0
        assert value(s, "walsidecar_safekeeper_proposer_connected", safekeeper_id=sid) == 1
        doc = status_json(addr)
        assert doc["id"] == i and doc["proposer_connected"] and parse_lsn(doc["flush_lsn"]) > 0
    def all_streaming() -> dict | None:
        # The primary's part comes from the proposer's poller, which may not have polled since the
        # sidecar became the synchronous standby: wait for a poll that has seen it.
        doc = status_json(ops.proposer_metrics)
        streaming = {r["state"] for r in doc["safekeepers"]} == {"streaming"}
        return doc if streaming and (doc.get("primary") or {}).get("sync_state") == "sync" else None

    doc = wait_for(all_streaming, timeout=30, what="all three safekeepers streaming and the primary polled")
    assert doc["quorum_available"] and doc["phase"] == "streaming" and len(doc["safekeepers"]) == 3
    assert doc["primary"]["sync_state"] == "sync"
    with urllib.request.urlopen(f"http://{ops.proposer_metrics}/quorum", timeout=10) as resp:
        assert resp.status == 200
    # The dashboard and alert rules only use metrics that exist.
    from support.monitoring import referenced_metrics
    exported = set(m) | set(scrape(ops.sk_metrics[1]))
    assert referenced_metrics() <= exported, referenced_metrics() - exported


def test_status_table_json_and_watch(ops: Ops) -> None:
    out = ops.status()
    assert out.returncode == 0, out.stderr
    table = out.stdout
    assert table.splitlines()[0].startswith("+ Cluster: walsidecar")
    for col in ("Safekeeper", "Address", "State", "Term", "Flush LSN", "Lag (bytes)", "Lag (s)", "Last contact"):
        assert col in table
    assert table.count("| streaming") == 3 and "quorum 2 of 3: available" in table
    assert "sidecar sync_state sync" in table
    doc = json.loads(ops.status("--format", "json").stdout)
    assert [r["id"] for r in doc["safekeepers"]] == [1, 2, 3]
    assert all(r["own"]["proposer_connected"] for r in doc["safekeepers"])
    # Each safekeeper says where it serves readers (its --pg-listen port).
    ports = [a.port for a in ops.d.reader_addresses]
    assert [r["own"]["reader_port"] for r in doc["safekeepers"]] == ports
    assert f" Readers:  1: port {ports[0]}, 2: port {ports[1]}, 3: port {ports[2]}" in table
    ops.d.safekeepers[3].kill9()

    def sk3_down() -> bool:
        rows = json.loads(ops.status("--format", "json").stdout)["safekeepers"]
        return rows[2]["state"] == "down" and "error" in rows[2]["own"]

    wait_for(sk3_down, timeout=30, what="status to show safekeeper 3 down")
    out = ops.status()
    row3 = next(ln for ln in out.stdout.splitlines() if ops.d.addresses[2] in ln)
    assert "| down" in row3
    watched = ops.status("--watch", "0.2", "--count", "2")
    assert watched.returncode == 0 and watched.stdout.count("(every 0.2s)") == 2
    # A second safekeeper down loses the quorum: status says so and exits 1, for scripts.
    ops.d.safekeepers[2].kill9()
    lost = wait_for(lambda: (out := ops.status()).returncode == 1 and out, timeout=30, what="status to exit 1")
    assert "quorum 2 of 3: LOST" in lost.stdout, lost.stdout
    alone = walsidecar("status", "--safekeepers", ops.sks, *ops.d.tls("client"))
    assert alone.returncode == 1 and alone.stdout.count("| down") == 2, alone.stdout
    ops.start_safekeeper(2)
    wait_for(lambda: ops.status().returncode == 0, timeout=60, what="the quorum back")
    # With the proposer gone, status still reports each safekeeper's own view.
    ops.d.proposer.kill9()
    out = ops.status()
    assert out.returncode == 1 and "Proposer: unreachable" in out.stdout
    assert out.stdout.count("| idle") + out.stdout.count("| streaming") >= 2


def test_quorum_wait_alert_limbo_and_waiting_commits_view(ops: Ops) -> None:
    d = ops.d
    out = walsidecar("init-postgres", "--pg-dsn", d.pg.dsn(), "--role", "")
    assert out.returncode == 0, out.stderr
    d.safekeepers[2].kill9()
    d.safekeepers[3].kill9()
    result: dict = {}

    def commit() -> None:
        with psycopg.connect(d.pg.dsn(), autocommit=True) as c:
            c.execute("INSERT INTO load VALUES (42, 'waits for the quorum')")
        result["done"] = True

    t = threading.Thread(target=commit, daemon=True)
    t.start()
    with d.sql() as c:
        row = wait_for(lambda: c.execute("SELECT pid, waiting > interval '0', query FROM walsidecar.waiting_commits"
                                         ).fetchone(), timeout=30, what="the commit to show in waiting_commits")
        assert row[1] and "INSERT INTO load" in row[2]
        st = c.execute("SELECT protecting_commits, commits_waiting FROM walsidecar.status").fetchone()
        assert st == (True, 1)
    wait_for(lambda: value(scrape(ops.proposer_metrics), "walsidecar_proposer_quorum_wait_alert") == 1,
             timeout=30, what="the quorum-wait alert")
    m = scrape(ops.proposer_metrics)
    assert value(m, "walsidecar_proposer_quorum_available") == 0
    assert value(m, "walsidecar_proposer_limbo_oldest_seconds") > 1
    assert value(m, "walsidecar_proposer_limbo_bytes") > 0
    wait_for(lambda: value(scrape(ops.proposer_metrics), "walsidecar_primary_commits_waiting") >= 1, timeout=30,
             what="the proposer to see the waiting commit on the primary")
    doc = status_json(ops.proposer_metrics)
    assert doc["limbo"]["alerting"] and doc["limbo"]["oldest_wait_seconds"] > 1
    assert set(doc["limbo"]["acknowledged"]) == set(d.addresses)
    log = d.proposer.log_text()
    assert "commits are waiting for the safekeeper quorum" in log
    alert_line = next(ln for ln in log.splitlines() if "commits are waiting for the safekeeper quorum" in ln)
    assert "oldest_lsn=" in alert_line and "acknowledged=" in alert_line and "down=" in alert_line
    assert "WAITING" not in ops.status().stdout  # the table stays readable
    assert "(ALERT)" in ops.status().stdout
    ops.start_safekeeper(3)
    t.join(timeout=60)
    assert result.get("done")
    wait_for(lambda: value(scrape(ops.proposer_metrics), "walsidecar_proposer_quorum_wait_alert") == 0,
             timeout=30, what="the alert to clear")
    m = scrape(ops.proposer_metrics)
    slow = value(m, "walsidecar_proposer_commit_ack_seconds", "walsidecar_proposer_commit_ack_seconds_bucket",
                 le="1.0")
    total = value(m, "walsidecar_proposer_commit_ack_seconds", "walsidecar_proposer_commit_ack_seconds_count")
    assert total > slow, "the commit that waited must show in the latency histogram above 1s"
    assert "the safekeeper quorum acknowledges WAL again" in d.proposer.log_text()


def test_peer_log_lines_name_id_term_and_lsn(ops: Ops) -> None:
    ops.d.safekeepers[2].kill9()
    wait_for(lambda: "connection lost" in ops.d.proposer.log_text(), timeout=30, what="the lost connection log line")
    line = next(ln for ln in ops.d.proposer.log_text().splitlines()
                if "connection lost" in ln and f"peer={ops.d.addresses[1]}" in ln)
    assert f"peer={ops.d.addresses[1]}" in line and "safekeeper_id=2" in line and "term=" in line \
        and "flush_lsn=" in line, line
    sk_line = next(ln for ln in ops.d.safekeepers[1].log_text().splitlines() if "greeting" in ln)
    assert "node=1" in sk_line and "term=" in sk_line and "flush_lsn=" in sk_line, sk_line


def test_catch_up_progress_is_logged(pg_factory, procs: ProcessTracker, test_dir: Path) -> None:
    pg: PgServer = pg_factory(settings={"synchronous_standby_names": APP})
    o = Ops(Deployment(pg, procs, test_dir))
    o.start("--wal-buffer", "1")
    o.d.safekeepers[3].kill9()
    with o.d.sql() as c:
        c.execute("CREATE TABLE big AS SELECT g, repeat('z', 300) AS pad FROM generate_series(1, 80000) g")
    # Only lines after the restart count: safekeeper 3 may have caught up briefly at the start too.
    before = len(o.d.proposer.log_text().splitlines())
    o.start_safekeeper(3)
    sk3 = o.d.addresses[2]
    wait_for(lambda: any("safekeeper caught up" in ln and sk3 in ln
                         for ln in o.d.proposer.log_text().splitlines()[before:]),
             timeout=120, what="the caught-up log line of safekeeper 3")
    log = o.d.proposer.log_text().splitlines()[before:]
    started = next(ln for ln in log if "safekeeper catching up" in ln and sk3 in ln)
    done = next(ln for ln in log if "safekeeper caught up" in ln and sk3 in ln)
    behind = int(started.split("behind_bytes=")[1].split()[0])
    assert behind > 16 * 1024 * 1024 and "safekeeper_id=3" in started
    assert int(done.split("done_bytes=")[1].split()[0]) > 16 * 1024 * 1024 and "rate_mib_per_s=" in done


def test_init_postgres_views_and_uninstall(pg_factory, procs: ProcessTracker, test_dir: Path) -> None:
    pg: PgServer = pg_factory(settings={"max_wal_senders": "5"})
    out = walsidecar("init-postgres", "--pg-dsn", pg.dsn())
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "max_wal_senders = 10: needs a restart (running with 5)" in text
    assert "max_slot_wal_keep_size = 10GB: applied by reload (was -1)" in text
    assert "wal_level = replica: unchanged" in text
    assert "synchronous_standby_names = '': left empty" in text and "--sync on" in text
    assert "role walsidecar: created, REPLICATION yes" in text
    assert "slots walsidecar (reserved), walsidecar_horizon (reserved): present" in text
    assert "walsidecar.replication" in text and "walsidecar.waiting_commits" in text
    assert text.rstrip().endswith("Restart PostgreSQL to apply: max_wal_senders.")
    with psycopg.connect(pg.dsn(), autocommit=True) as c:
        assert c.execute("SELECT pending_restart FROM pg_settings WHERE name = 'max_wal_senders'").fetchone()[0]
        assert c.execute("SELECT rolreplication FROM pg_roles WHERE rolname = 'walsidecar'").fetchone()[0]
        # It may terminate commits waiting in SyncRep (--commit-wait terminate-after, a fenced-out primary).
        assert c.execute("SELECT pg_has_role('walsidecar', 'pg_signal_backend', 'MEMBER')").fetchone()[0]
        assert c.execute("SELECT count(*) FROM walsidecar.slots WHERE wal_status = 'reserved'").fetchone()[0] == 2
        assert c.execute("SELECT protecting_commits FROM walsidecar.status").fetchone()[0] is False
    pg.restart()
    again = walsidecar("init-postgres", "--pg-dsn", pg.dsn())
    assert "max_wal_senders = 10: unchanged" in again.stdout and "No restart needed." in again.stdout

    # The sidecar streams asynchronously until init-postgres (sync auto) sees it and names it.
    d = Deployment(pg, procs, test_dir)
    for i in (1, 2, 3):
        d.start_safekeeper(i)
    d.start_proposer()
    wait_for(lambda: (r := d.replication_row()) is not None and r[1] == "streaming", timeout=60,
             what="the sidecar to stream")
    named = walsidecar("init-postgres", "--pg-dsn", pg.dsn())
    assert "synchronous_standby_names = walsidecar: names 'walsidecar'" in named.stdout, named.stdout
    d.wait_sync()
    with psycopg.connect(pg.dsn(), autocommit=True) as c:
        c.execute("CREATE TABLE t (x int)")
        c.execute("INSERT INTO t VALUES (1)")
        row = wait_for(lambda: c.execute(
            "SELECT state, sync_state, flush_lag_bytes, replay_lag_bytes, sent_lag_bytes FROM walsidecar.replication"
        ).fetchone(), timeout=30, what="the replication view row")
        assert row[0] == "streaming" and row[1] == "sync" and row[2] >= 0 and row[3] >= 0
        slots = c.execute("SELECT purpose, active, wal_status, safe_wal_size > 0 FROM walsidecar.slots "
                          "ORDER BY purpose").fetchall()
        assert slots == [("horizon", False, "reserved", True), ("stream", True, "reserved", True)]
        assert c.execute("SELECT protecting_commits, commits_waiting FROM walsidecar.status").fetchone() == (True, 0)
        assert c.execute("SELECT count(*) FROM walsidecar.waiting_commits").fetchone()[0] == 0

    # Uninstall while the sidecar runs: commits stop waiting, its active slot stays; then for good.
    out = walsidecar("init-postgres", "--pg-dsn", pg.dsn(), "--uninstall")
    assert out.returncode == 0, out.stderr
    assert "commits no longer wait for the sidecar" in out.stdout
    assert "slots walsidecar: still there" in out.stdout
    d.proposer.terminate()
    out = walsidecar("init-postgres", "--pg-dsn", pg.dsn(), "--uninstall")
    assert "slots: dropped" in out.stdout and "role walsidecar: dropped" in out.stdout, out.stdout
    with psycopg.connect(pg.dsn(), autocommit=True) as c:
        assert c.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'walsidecar'").fetchone()[0] == 0
        assert c.execute("SELECT count(*) FROM pg_replication_slots").fetchone()[0] == 0
        assert c.execute("SHOW synchronous_standby_names").fetchone()[0] == ""

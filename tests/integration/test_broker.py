"""The safekeepers publish to a real etcd: every entry, a dead one's going with its lease, commits with etcd down."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.broker import Broker, SafekeeperState, read_clusters
from support.backends import PgServer
from support.deployment import APP, Deployment, Writer
from support.etcd import EtcdServer
from support.helpers import free_port, wait_for, walsidecar
from support.procs import ProcessTracker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
LEASE = 3  # seconds: how long a dead safekeeper's entry outlives it


def published(etcd: EtcdServer, cluster: str) -> dict[int, SafekeeperState]:
    """The safekeepers' entries of the cluster's highest timeline, as etcd holds them now."""
    async def read() -> dict[int, SafekeeperState]:
        broker = Broker([etcd.url])
        try:
            timelines = (await read_clusters(broker, cluster)).get(cluster, {})
        finally:
            broker.close()
        return timelines[max(timelines)].safekeepers if timelines else {}
    return asyncio.run(read())


def check(d: Deployment, etcd: EtcdServer) -> dict[str, dict]:
    """`walsidecar check --broker`'s lines about the broker, by name."""
    out = walsidecar("check", "--pg-dsn", d.pg.dsn(), "--safekeepers", ",".join(d.addresses), "--broker", etcd.url,
                     "--format", "json", *d.tls("client"))
    return {c["name"]: c for c in json.loads(out.stdout)["checks"] if "broker" in c["name"]}


def metrics(address: str) -> dict[str, list]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        return {f.name: f.samples for f in text_string_to_metric_families(resp.read().decode())}


def acks_while(writer: Writer, condition: Callable[[], bool], more: int = 20) -> None:
    """Wait until `more` further commits are acknowledged, checking `condition` holds before and after."""
    assert condition()
    start = len(writer.acked)
    wait_for(lambda: len(writer.acked) >= start + more or writer.error, timeout=60, what=f"{more} more commits")
    assert writer.error is None and condition()


def test_safekeepers_publish_to_etcd_and_commits_never_wait_for_it(pg_factory: Callable[..., PgServer],
                                                                   procs: ProcessTracker, test_dir, etcd: EtcdServer) -> None:
    pg = pg_factory(settings={"synchronous_standby_names": APP})
    d = Deployment(pg, procs, test_dir)
    sk1_metrics = f"127.0.0.1:{free_port()}"
    for i in (1, 2, 3):
        d.extra[f"safekeeper{i}"] = ["--broker", etcd.url, "--broker-lease", str(LEASE)]
    d.extra["safekeeper1"] += ["--metrics", sk1_metrics]
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
        cluster = str(c.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0])

    # Every safekeeper publishes, under the system id, its term and positions and where it is reached.
    entries = wait_for(lambda: (e := published(etcd, cluster)) and len(e) == 3 and
                       all(s.proposer_connected and s.commit_lsn for s in e.values()) and e,
                       timeout=30, what="three safekeepers' entries in etcd")
    assert sorted(s.address for s in entries.values()) == sorted(d.addresses)
    assert all(s.pg_address == str(d.members[f"safekeeper{i}"].reader_address) for i, s in entries.items())
    assert len({s.term for s in entries.values()}) == 1 and all(s.backup_lsn == 0 for s in entries.values())
    lines = check(d, etcd)
    assert [c["status"] for c in lines.values()] == ["OK"] * 4, lines
    seen = metrics(sk1_metrics)
    assert {s.labels["peer_id"] for s in seen["walsidecar_safekeeper_peer_flush_lsn_bytes"]} == {"1", "2", "3"}
    assert seen["walsidecar_safekeeper_broker_connected"][0].value == 1
    status = json.loads(walsidecar("status", "--broker", etcd.url, "--format", "json", *d.tls("client")).stdout)
    assert len(status["broker"]["clusters"][cluster]["1"]["safekeepers"]) == 3

    # A safekeeper killed: its entry goes with its lease, and `check` says which one is missing.
    d.kill("safekeeper3")
    wait_for(lambda: set(published(etcd, cluster)) == {1, 2}, timeout=LEASE * 5, interval=0.2,
             what="safekeeper 3's entry to go with its lease")
    missing = check(d, etcd)[f"safekeeper {d.addresses[2]} in the broker"]
    assert missing["status"] == "FAILED" and "publishes nothing" in missing["detail"]
    d.start("safekeeper3")

    # etcd stopped under load: commits go on, `check` says the broker is unreachable; back, the entries return.
    writer = Writer(d.dsn())
    writer.start()
    try:
        acks_while(writer, lambda: True)
        etcd.stop()
        acks_while(writer, lambda: not etcd.child.running, more=200)
        down = check(d, etcd)["broker"]
        assert down["status"] == "FAILED" and "unreachable" in down["detail"]
        assert metrics(sk1_metrics)["walsidecar_safekeeper_broker_connected"][0].value == 0
        restarted = time.time()
        etcd.start()
        wait_for(lambda: len(e := published(etcd, cluster)) == 3 and all(s.last_updated > restarted for s in e.values()),
                 timeout=30, interval=0.2, what="all three entries published again after etcd's restart")
        acks_while(writer, lambda: True)
    finally:
        acked = writer.stop()
    assert writer.error is None
    with d.sql() as c:
        assert c.execute("SELECT count(*) FROM load WHERE id <= %s", (acked[-1],)).fetchone()[0] == len(acked)


def test_an_upload_lease_written_into_etcd_is_named_by_check_and_stops_uploads_only_while_it_looks_real(
        pg_factory: Callable[..., PgServer], procs: ProcessTracker, test_dir, etcd: EtcdServer) -> None:
    """Write access to etcd (audit-2 L-6): an upload lease key on a live lease that no safekeeper's entry hangs on
    is deleted by the safekeepers, so uploads go on; one dressed up with an entry of its own (an id that is no
    safekeeper of the cluster) still holds them up, and `check` names it, its lease, and the archive falling behind."""
    from sidecar.broker import safekeepers_prefix, uploader_key
    from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG, format_lsn, parse_lsn
    from sidecar.safekeeper.control import load_control

    pg = pg_factory(settings={"synchronous_standby_names": APP})
    d = Deployment(pg, procs, test_dir)
    for i in (1, 2, 3):
        d.extra[f"safekeeper{i}"] = ["--broker", etcd.url, "--broker-lease", str(LEASE),
                                     "--archive", f"file://{test_dir / 'archive'}"]
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
        cluster = str(c.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0])
    key = uploader_key(cluster, 1)

    def holder() -> tuple[str, int] | None:
        async def read() -> tuple[str, int] | None:
            broker = Broker([etcd.url])
            try:
                return await broker.holder(key)
            finally:
                broker.close()
        return asyncio.run(read())

    def backup_lsn() -> int:
        return min(load_control(d.sk_dir(i)).state.backup_lsn for i in (1, 2, 3))

    def switch(n: int) -> int:
        """n segments committed and completed; the end of the last."""
        with d.sql() as c:
            for i in range(n):
                c.execute("INSERT INTO load VALUES (%s, 'x')", (i,))
                c.execute("SELECT pg_switch_wal()")
            c.execute("INSERT INTO load VALUES (-1, 'after')")
            lsn = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
        return lsn - lsn % SEG

    def forge(values: dict[str, str]) -> int:
        """Write `values` on a lease of 600 s (alive for the whole test, as if renewed); the lease."""
        async def write() -> int:
            broker = Broker([etcd.url])
            try:
                lease = await broker.grant(600)
                assert await broker.put_all(values, lease)
                return lease
            finally:
                broker.close()
        return asyncio.run(write())

    def revoke(lease: int) -> None:
        broker = Broker([etcd.url])
        try:
            asyncio.run(broker.revoke(lease))
        finally:
            broker.close()

    wait_for(lambda: (h := holder()) is not None and h[0] in ("1", "2", "3"), timeout=30,
             what="a safekeeper to take the upload lease")
    # A key on a live lease, naming an id no safekeeper publishes under that lease: deleted, uploads go on.
    forge({key: "99"})
    wait_for(lambda: (h := holder()) is not None and h[0] in ("1", "2", "3"), timeout=30,
             what="the safekeepers to delete the forged upload lease key and one of them to take it again")
    end = switch(2)
    wait_for(lambda: backup_lsn() >= end, timeout=60, what=f"uploads up to {format_lsn(end)} after the forged key")
    # Whole lines only: a line a safekeeper is still writing would run into the next log's first line.
    texts = (d.log_path(f"safekeeper{i}").read_text() for i in (1, 2, 3))
    log = "".join(text[:text.rfind("\n") + 1] for text in texts)
    deleted = [line for line in log.splitlines() if "an upload lease key no safekeeper wrote; deleting it" in line]
    assert deleted and all("99" in line for line in deleted), deleted or log[-3000:]

    # The same key with an entry of id 99 on its lease, as a safekeeper would write them: obeyed, so nobody
    # uploads; check names the holder and its lease, the stranger's entry, and the archive falling behind.
    prefix = safekeepers_prefix(cluster, 1)
    lease = forge({f"{prefix}99/last_updated": f"{time.time():.3f}", f"{prefix}99/commit_lsn": "0/0", key: "99"})
    wait_for(lambda: holder() == ("99", lease), timeout=30, what="the forged holder to stand")
    stalled = backup_lsn()
    switch(6)
    out = walsidecar("check", "--pg-dsn", d.pg.dsn(), "--safekeepers", ",".join(d.addresses), "--broker", etcd.url,
                     "--format", "json", *d.tls("client"))
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    uploader = checks.get("broker uploader")
    assert uploader is not None and uploader["status"] == "WARNING", out.stdout
    assert "'99'" in uploader["detail"] and f"lease {lease:x}" in uploader["detail"] and \
        "not uploading" in uploader["detail"], uploader
    assert checks["broker entries"]["status"] == "WARNING" and "99" in checks["broker entries"]["detail"]
    assert backup_lsn() == stalled, "nobody uploads while the forged holder stands"
    archive = [c for c in json.loads(out.stdout)["checks"] if c["name"] == "archive"]
    assert archive and all(c["status"] == "WARNING" and "falls behind" in c["detail"] for c in archive), archive

    # Its lease revoked, the safekeepers take the key again and the archive catches up.
    revoke(lease)
    end = switch(1)
    wait_for(lambda: backup_lsn() >= end, timeout=60, what="uploads to resume once the forged lease is revoked")

"""`walsidecar up --ha` with real Patroni, etcd, two PostgreSQL 15 nodes and three safekeepers.

A host loss of the leader (`ctl kill`, every process of the node at once) under a ledger workload:
Patroni promotes the other node through `walsidecar failover-gate`, which holds every acknowledged
row, and the old node rejoins as a replica (pg_rewind). And the gate's veto: with a safekeeper majority
down it cannot fence, exits non-zero, and Patroni keeps the candidate a replica. And a short run of
`scripts/chaos.py --kinds ha-live`: Patroni promotes the other node through the gate while the old leader's
PostgreSQL and sidecar still take writes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from support.helpers import consecutive_free_ports, wait_for, walsidecar
from support.installed import installed_command
from support.procs import ManagedProcess, ProcessTracker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHAOS = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


def require_patroni() -> None:
    if importlib.util.find_spec("patroni") is None or not Path(sys.executable).with_name("patroni").exists():
        pytest.fail(f"Patroni is not installed in {Path(sys.executable).parent.parent}: scripts/install.sh installs "
                    "the ha extra (pip install 'walsidecar[ha]')")


class UpHa:
    """One `walsidecar up --ha` in its own --dir, on free ports; node1 on pg_port, node2 on pg_port + 1."""

    def __init__(self, procs: ProcessTracker, base: Path) -> None:
        require_patroni()
        installed_command()  # the nodes run the installed walsidecar (gate, follower): it must be this checkout's
        self.dir = base
        self.pg_port = consecutive_free_ports(2)
        self.stderr = base.with_name(base.name + "-stderr.log")
        argv = [sys.executable, "-m", "sidecar", "up", "--ha", "--dir", str(base), "--pg-port", str(self.pg_port),
                "--safekeeper-port", str(consecutive_free_ports(3))]
        self.proc: ManagedProcess = procs.start(["sh", "-c", 'exec "$@" 2>>"$0"', str(self.stderr), *argv],
                                                name="up-ha")
        wait_for(lambda: "Press Ctrl-C to stop." in self.proc.log_text() or not self.proc.running, timeout=300,
                 what="walsidecar up --ha to be ready")
        assert self.proc.running, self.proc.log_text()[-2000:] + self.log()[-3000:]
        self.ports = {"node1": self.pg_port, "node2": self.pg_port + 1}
        # Whichever node leads takes the writes: libpq tries both and keeps the one that is not read-only.
        self.any_dsn = (f"host=127.0.0.1,127.0.0.1 port={self.pg_port},{self.pg_port + 1} user=postgres "
                        "dbname=postgres target_session_attrs=read-write connect_timeout=3")

    def dsn(self, node: str) -> str:
        return f"host=127.0.0.1 port={self.ports[node]} user=postgres dbname=postgres connect_timeout=3"

    def log(self) -> str:
        return self.stderr.read_text(errors="replace") if self.stderr.exists() else ""

    def node_log(self, node: str, name: str = "patroni.log") -> str:
        path = self.dir / node / name
        return path.read_text(errors="replace") if path.exists() else ""

    def ctl(self, *args: str) -> str:
        out = walsidecar("ctl", "--dir", str(self.dir), *args, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def members(self) -> dict[str, str]:
        """name -> state, as `ctl members` prints it (a node's: "running: primary, PostgreSQL running, ...")."""
        out = {}
        for line in self.ctl("members").splitlines()[1:]:
            m = re.match(r"(\S+)\s+(\S+)\s+(.*?)\s+(\d+)$", line)
            assert m, line
            out[m.group(1)] = m.group(3)
        return out

    def role(self, node: str) -> str | None:
        """'primary' or 'replica' from PostgreSQL itself; None when it does not answer."""
        try:
            with psycopg.connect(self.dsn(node), autocommit=True) as c:
                return "replica" if c.execute("SELECT pg_is_in_recovery()").fetchone()[0] else "primary"
        except psycopg.OperationalError:
            return None

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(timeout=180) == 0, self.log()[-3000:]


class Ledger(threading.Thread):
    """Inserts ids one commit at a time through whichever node leads, reconnecting when it goes; an id counts
    as acknowledged only once its COMMIT returned. Records when each node acknowledged its first commit."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.acked: list[int] = []
        self.first_ack: dict[int, float] = {}  # port -> time.monotonic() of its first acknowledged commit
        self.stopping = threading.Event()

    def run(self) -> None:
        i, conn = 0, None
        while not self.stopping.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, autocommit=True)
                i += 1
                conn.execute("INSERT INTO ledger VALUES (%s)", (i,))
                self.acked.append(i)
                self.first_ack.setdefault(conn.info.port, time.monotonic())
            except psycopg.Error:
                # Unknown outcome: not acknowledged, so not counted; the row may or may not exist.
                if conn is not None:
                    conn.close()
                conn = None
                self.stopping.wait(0.2)
        if conn is not None:
            conn.close()

    def stop(self) -> list[int]:
        self.stopping.set()
        self.join(timeout=120)
        assert not self.is_alive(), "the ledger writer is stuck in a commit"
        return self.acked


def missing(dsn: str, ids: list[int]) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as c:
        have = {r[0] for r in c.execute("SELECT id FROM ledger")}
    return sorted(set(ids) - have)


def no_tracebacks(up: UpHa) -> None:
    for node in ("node1", "node2"):
        for name in ("patroni.log", "sidecar.log"):
            assert "Traceback" not in up.node_log(node, name), f"{node}/{name}:\n{up.node_log(node, name)[-4000:]}"


@pytest.fixture
def up(procs: ProcessTracker, test_dir: Path) -> Any:
    u = UpHa(procs, test_dir / "ha")
    try:
        wait_for(lambda: u.members().get("node1", "").startswith("running: primary")
                 and u.members().get("node2", "").startswith("running: replica"), timeout=120,
                 interval=1.0, what="node1 leading and node2 its replica")
        with psycopg.connect(u.dsn("node1"), autocommit=True) as c:
            c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY)")
        yield u
    finally:
        if u.proc.running:
            u.stop()


def test_a_host_loss_of_the_leader_promotes_the_other_node_with_every_acknowledged_row(up: UpHa) -> None:
    ledger = Ledger(up.any_dsn)
    ledger.start()
    try:
        wait_for(lambda: len(ledger.acked) >= 200, timeout=120, what="acknowledged ledger rows on node1")
        killed = time.monotonic()
        assert "killed node1" in up.ctl("kill", "node1")
        wait_for(lambda: up.ports["node2"] in ledger.first_ack, timeout=300,
                 what="the first commit acknowledged by node2 (Patroni promoted it through failover-gate)")
        took = ledger.first_ack[up.ports["node2"]] - killed
        after = len(ledger.acked)
        wait_for(lambda: len(ledger.acked) >= after + 100, timeout=60, what="more rows on node2")
    finally:
        acked = ledger.stop()
    print(f"kill of node1 -> first commit acknowledged on node2: {took:.1f}s; {len(acked)} rows acknowledged")

    assert up.members()["node2"].startswith("running: primary")
    assert missing(up.dsn("node2"), acked) == []
    # `status` with the file `up --ha` writes: Patroni's leader beside the safekeepers, and the primary found
    # wherever it now is (its pg_dsn names both nodes, read-write).
    status = walsidecar("status", "--config", str(up.dir / "walsidecar.toml"), "--format", "json")
    doc = json.loads(status.stdout)
    assert doc["patroni"]["leader"] == "node2", status.stdout + status.stderr
    assert doc["primary"].get("sync_state") == "sync", doc["primary"]
    gate = up.node_log("node2")
    assert "gate open: the standby replayed E" in gate and "exited with 0" in gate
    # node2's follower saw node1's host lost (its ports refused, its lease unrenewed in etcd) and ended
    # node1's lease: Patroni elected without waiting out ttl.
    assert "the leader's host is lost: ended its etcd lease" in up.node_log("node2", "sidecar.log")

    # node1 comes back as a replica of node2 (Patroni rewinds it: it may hold WAL no quorum acknowledged).
    up.ctl("start", "node1")
    wait_for(lambda: up.members()["node1"].startswith("running: replica, PostgreSQL running"), timeout=300,
             interval=1.0, what="node1 to rejoin as a replica")
    wait_for(lambda: not missing(up.dsn("node1"), acked), timeout=120, ignore=(psycopg.OperationalError,),
             interval=0.5, what="node1 to replay every acknowledged row from node2")
    assert up.role("node1") == "replica" and up.role("node2") == "primary"
    up.stop()
    no_tracebacks(up)


def test_the_gate_keeps_the_candidate_a_replica_while_a_safekeeper_majority_is_down(up: UpHa) -> None:
    ledger = Ledger(up.any_dsn)
    ledger.start()
    try:
        wait_for(lambda: len(ledger.acked) >= 50, timeout=120, what="acknowledged ledger rows on node1")
    finally:
        acked = ledger.stop()
    up.ctl("stop", "safekeeper2")
    up.ctl("stop", "safekeeper3")
    up.ctl("kill", "node1")

    # Patroni gives node2 the leader key once node1's expires, runs the gate, and the gate cannot fence.
    wait_for(lambda: "gate closed: not promoting this standby" in up.node_log("node2"), timeout=300,
             interval=0.5, what="node2's failover-gate to refuse")
    wait_for(lambda: re.search(r"pre_promote script .* exited with 1", up.node_log("node2")) is not None,
             timeout=60, what="Patroni to see the gate's veto")
    assert up.role("node2") == "replica"
    # It stays so: Patroni runs the gate again after its backoff, and it refuses again.
    refusals = up.node_log("node2").count("gate closed: not promoting this standby")
    wait_for(lambda: up.node_log("node2").count("gate closed: not promoting this standby") > refusals,
             timeout=300, interval=0.5, what="a second refusal")
    assert up.role("node2") == "replica"
    assert "exited with 0" not in up.node_log("node2")

    # With a majority back the same gate lets Patroni promote node2, and it holds every acknowledged row.
    up.ctl("start", "safekeeper2")
    wait_for(lambda: up.role("node2") == "primary", timeout=300, interval=0.5,
             what="node2 promoted once the gate can fence")
    assert missing(up.dsn("node2"), acked) == []
    up.stop()
    no_tracebacks(up)


def test_a_replica_that_fell_behind_gets_the_rest_from_the_safekeepers_when_its_leader_dies(up: UpHa) -> None:
    # node2's WAL receiver is paused (SIGSTOP, by the PID PostgreSQL reports): the leader's WAL reaches the
    # safekeepers, which acknowledge it, and not node2, whose leader then dies with the rest.
    def streaming_receiver() -> int | None:
        with psycopg.connect(up.dsn("node2"), autocommit=True) as c:
            row = c.execute("SELECT pid FROM pg_stat_wal_receiver WHERE status = 'streaming'").fetchone()
        return row[0] if row else None
    receiver = wait_for(streaming_receiver, timeout=120, interval=0.5, ignore=(psycopg.OperationalError,),
                        what="node2 to stream from node1")
    os.kill(receiver, signal.SIGSTOP)
    try:
        acked: list[int] = []
        with psycopg.connect(up.dsn("node1"), autocommit=True) as c:
            c.execute("CREATE TABLE bulk (id int PRIMARY KEY, pad text)")
            # About 40 MiB of WAL (1 KiB random rows, below the TOAST threshold: not compressed), more than the
            # paused receiver's socket buffers hold, across segment boundaries.
            for batch in range(32):
                c.execute("INSERT INTO bulk SELECT g, (SELECT string_agg(md5(random()::text || i), '') "
                          "FROM generate_series(1, 32) i) FROM generate_series(%s::int, %s::int) g",
                          (batch * 1000 + 1, batch * 1000 + 1000))
                acked += range(batch * 1000 + 1, batch * 1000 + 1001)
        up.ctl("kill", "node1")
    finally:
        os.kill(receiver, signal.SIGCONT)
    wait_for(lambda: up.role("node2") == "primary", timeout=300, interval=0.5,
             what="node2 promoted once its gate brought it to E")
    with psycopg.connect(up.dsn("node2"), autocommit=True) as c:
        have = {r[0] for r in c.execute("SELECT id FROM bulk")}
    assert sorted(set(acked) - have) == []
    gate = up.node_log("node2")
    assert re.search(r"wrote [0-9A-F]{24} into the standby's pg_wal", gate), gate[-4000:]
    up.stop()
    no_tracebacks(up)


def test_failover_live_under_patroni_loses_nothing_the_old_leader_acknowledged(test_dir: Path) -> None:
    # `chaos.py --kinds ha-live`: only the leader's Patroni is lost (seed 1: SIGKILL in round 1, SIGSTOP in round 2
    # with a safekeeper down), so its PostgreSQL and sidecar go on taking the writers' commits while Patroni
    # promotes the other node through failover-gate. Whatever the old primary acknowledged must be on the new
    # leader, and it may acknowledge nothing after the promotion: the gate's fence ended its timeline, and its
    # sidecar must stop (LineageFenced). Without the fence (lineage.fenced_out answering None) the old sidecar
    # wins the next term and its primary's commits, acknowledged after the gate's E, are missing on the new
    # leader: round 1 ends with "508 of 22883 acknowledged writes are missing on node2", old_acks=510.
    require_patroni()
    installed_command()
    base = test_dir / "chaos-ha"
    out = subprocess.run([sys.executable, str(CHAOS), "--kinds", "ha-live", "--rounds", "2", "--seed", "1",
                          "--writers", "2", "--dir", str(base)],
                         check=False, capture_output=True, text=True, timeout=840, stdin=subprocess.DEVNULL)
    report = f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-6000:]}"
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    fields = dict(re.findall(r"(\w+)=(\S+)", summary))
    assert summary.startswith("chaos ha:"), report
    assert fields["lost"] == "0" and fields["old_acks"] == "0", report
    assert fields["rounds"] == "2" and fields["promotions"] == "2", report
    assert fields["old_alive"] == "2", report  # each promotion happened while the old primary took writes
    assert int(fields["acknowledged"]) > 0, report
    assert fields["result"] == "ok" and out.returncode == 0, report
    assert not base.exists(), "the data directory is removed after a passing run"

#!/usr/bin/env python3
"""`scripts/chaos.py --kinds ha`: automatic failovers under Patroni while writers commit; 0 lost.

Builds what `walsidecar up --ha` builds (etcd, three safekeepers, two Patroni-managed PostgreSQL 15
nodes, each with `walsidecar failover-gate` as pre_promote and `follow-leader`), runs writer threads
that record every acknowledged commit through whichever node leads, and each round SIGKILLs the
leader's whole node (Patroni, PostgreSQL and its backends, the sidecar) as a host loss; in some
rounds a safekeeper is down as well. It times the kill to the first commit the other node
acknowledges, brings the killed node back (Patroni rewinds it into a replica) and waits until it
streams again. At the end every acknowledged key must be on the leader.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psycopg  # noqa: E402

from sidecar.embedded_ha import HaDeployment, Node  # noqa: E402
from sidecar.logs import configure, get_logger  # noqa: E402


@dataclass
class HaSummary:
    seed: int
    rounds: int = 0
    failovers: int = 0
    with_safekeeper_down: int = 0
    acknowledged: int = 0
    lost: int = 0
    kill_to_commit: list[float] = field(default_factory=list)
    failure: str | None = None
    result: str = "fail"
    data_dir: str = ""

    def line(self) -> str:
        times = self.kill_to_commit
        median = f"{statistics.median(times):.1f}s" if times else "-"
        worst = f"{max(times):.1f}s" if times else "-"
        return (f"chaos ha: rounds={self.rounds} failovers={self.failovers} "
                f"with_safekeeper_down={self.with_safekeeper_down} acknowledged={self.acknowledged} "
                f"lost={self.lost} kill_to_first_commit_median={median} max={worst} seed={self.seed} "
                f"result={self.result}")


class Writer(threading.Thread):
    """Keys (w, i) one commit at a time through whichever node leads; a key counts once its COMMIT returned."""

    def __init__(self, w: int, dsn: str) -> None:
        super().__init__(daemon=True)
        self.w, self.dsn = w, dsn
        self.acked: list[int] = []
        self.acks: list[tuple[float, int]] = []  # (time.monotonic(), port) of each acknowledgement
        self.stopping = threading.Event()

    def run(self) -> None:
        i, conn = 0, None
        while not self.stopping.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, autocommit=True)
                i += 1
                conn.execute("INSERT INTO ledger VALUES (%s, %s)", (self.w, i))
                self.acked.append(i)
                self.acks.append((time.monotonic(), conn.info.port))
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
                self.stopping.wait(0.1)
        if conn is not None:
            conn.close()


class ChaosFailure(Exception):
    pass


def wait(predicate, timeout: float, what: str, poll: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ChaosFailure(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(poll)


def streaming_replica(node: Node) -> bool:
    st = node.patroni_state()
    return bool(st and st.get("role") == "replica" and st.get("state") == "running"
                and st.get("replication_state") == "streaming")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # cleanup stops every process of the deployment


def run(rounds: int, seed: int | None, base_dir: Path | None, writers: int, round_timeout: float, keep: bool,
        json_file: Path | None) -> int:
    configure("plain", "warning")
    seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    base = base_dir.absolute() if base_dir else Path(tempfile.mkdtemp(prefix="walsidecar-chaos-ha-", dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)
    summary = HaSummary(seed=seed, data_dir=str(base))
    print(f"chaos ha: {rounds} leader kills under Patroni, seed {seed}, {writers} writers, in {base}", flush=True)
    ha = HaDeployment(base, log=get_logger(role="chaos-ha"))
    threads: list[Writer] = []
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        ha.start_all()
        leader = ha.wait_leader(120)
        wait(lambda: all(streaming_replica(n) for n in ha.nodes if n is not leader), 180, "the replica to stream")
        with psycopg.connect(leader.dsn(), autocommit=True) as c:
            c.execute("CREATE TABLE ledger (w int, id bigint, PRIMARY KEY (w, id))")
        ports = ",".join(str(n.pg_port) for n in ha.nodes)
        dsn = (f"host={','.join('127.0.0.1' for _ in ha.nodes)} port={ports} user=postgres dbname=postgres "
               "target_session_attrs=read-write connect_timeout=3")
        threads = [Writer(w, dsn) for w in range(writers)]
        for t in threads:
            t.start()
        for r in range(1, rounds + 1):
            leader = ha.wait_leader(round_timeout)
            other = next(n for n in ha.nodes if n is not leader)
            before = sum(len(t.acked) for t in threads)
            wait(lambda: sum(len(t.acked) for t in threads) >= before + 50, round_timeout, "commits on the leader")
            down = None
            # Every fourth round, and one at random among the others, with a safekeeper down: 2 of 3 remain.
            if r % 4 == 2 or rng.random() < 0.1:
                down = rng.choice(["safekeeper1", "safekeeper2", "safekeeper3"])
                ha.d.members[down].stop()
            killed = time.monotonic()
            leader.kill()
            port = other.pg_port

            def first_ack() -> float | None:
                after = [at for t in threads for at, p in list(t.acks) if p == port and at > killed]
                return min(after) if after else None
            at = wait(first_ack, round_timeout, f"the first commit acknowledged by {other.name} after "
                                                f"{leader.name}'s kill (round {r})")
            took = at - killed
            summary.kill_to_commit.append(took)
            summary.failovers += 1
            summary.with_safekeeper_down += down is not None
            print(f"round {r}: killed {leader.name}{f' with {down} down' if down else ''}; {other.name} "
                  f"acknowledged a commit {took:.1f}s later", flush=True)
            if down is not None:
                ha.d.members[down].start()
            leader.start()
            wait(lambda: streaming_replica(leader), round_timeout, f"{leader.name} to rejoin as a streaming replica")
            summary.rounds = r
        for t in threads:
            t.stopping.set()
        for t in threads:
            t.join(120)
        leader = ha.wait_leader(round_timeout)
        with psycopg.connect(leader.dsn(), autocommit=True) as c:
            have = {(w, i) for w, i in c.execute("SELECT w, id FROM ledger")}
        acked = {(t.w, i) for t in threads for i in t.acked}
        summary.acknowledged = len(acked)
        summary.lost = len(acked - have)
        summary.result = "ok" if summary.lost == 0 else "fail"
    except ChaosFailure as e:
        summary.failure = str(e)
        print(f"CHAOS FAILURE: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        summary.failure = summary.result = "interrupted"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for t in threads:
            t.stopping.set()
        ha.stop_all()
        signal.signal(signal.SIGTERM, old_term)
    if json_file is not None:
        json_file.write_text(json.dumps(asdict(summary), indent=2) + "\n")
    if summary.result == "ok" and not keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"chaos ha: data and logs kept in {base}", flush=True)
    print(summary.line(), flush=True)
    return 0 if summary.result == "ok" else 1

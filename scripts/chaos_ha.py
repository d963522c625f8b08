#!/usr/bin/env python3
"""`scripts/chaos.py --kinds ha,ha-live`: failovers under Patroni while writers commit; 0 lost.

Builds what `walsidecar up --ha` builds (etcd, three safekeepers, two Patroni-managed PostgreSQL 15
nodes, each with `walsidecar failover-gate` as pre_promote and `follow-leader`) and runs writer threads
that record every acknowledged commit. Each round is one of two kinds; in some rounds a safekeeper is
down as well (2 of 3 remain).

* `ha`: a host loss. The leader's whole node (Patroni, PostgreSQL and its backends, the sidecar) is
  SIGKILLed at once; the writers go through libpq's multi-host routing to whichever node leads. It times
  the kill to the first commit the other node acknowledges.
* `ha-live`: failover-live's form under Patroni. Only the leader's Patroni is lost (SIGKILL: it crashed;
  SIGSTOP: it hangs); its PostgreSQL, backends and sidecar go on, and the writers keep committing on it
  over a direct connection. Its leader key expires and the other node's Patroni promotes that node through
  the gate (fence at E, standby brought to E, promote) while the old primary still runs. Every commit the
  old primary acknowledged must be on the new leader; once the gate fenced it, its sidecar must exit
  (LineageFenced) and acknowledge nothing more: commits the old primary acknowledges after the promotion
  are counted apart (`old_acks`, which must be 0). Only once the new leader's sidecar streams are the old
  node's remains killed.

Either way the old node is then brought back (Patroni rewinds it into a replica) and must stream again;
after each round, and at the end, every acknowledged key must be on the leader.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psycopg  # noqa: E402

from sidecar.embedded_ha import HaDeployment, Node  # noqa: E402
from sidecar.logs import configure, get_logger  # noqa: E402
from sidecar.processes import sidecar_argv  # noqa: E402

KINDS = ("ha", "ha-live")
PROGRESS_WRITES = 50  # acknowledged writes that prove commits flow on a leader
SAFEKEEPERS = ("safekeeper1", "safekeeper2", "safekeeper3")
# What the old primary's sidecar logs when a failover's fence refuses it (proposer/service.py), and how many
# commits waiting in SyncRep it then terminated: their clients get an error, never an acknowledgement.
FENCED = "a failover ended this primary's timeline"
TERMINATED = re.compile(r"terminated (\d+) of \d+ commits waiting in SyncRep on this fenced-out primary")
T = TypeVar("T")


@dataclass
class HaSummary:
    seed: int
    kinds: str = "ha"
    rounds: int = 0
    promotions: int = 0  # the other node promoted by Patroni through its gate (both kinds)
    host_losses: int = 0  # `ha` rounds
    old_alive: int = 0  # `ha-live` promotions while the old primary ran on its timeline, taking writes
    with_safekeeper_down: int = 0
    acknowledged: int = 0
    old_acks: int = 0  # commits the old primary acknowledged after the other node's promotion
    terminated: int = 0  # commits waiting in SyncRep that the fenced old sidecars terminated (an error)
    lost: int = 0
    kill_to_commit: list[float] = field(default_factory=list)  # `ha`: the kill to the new leader's first commit
    cut_to_promotion: list[float] = field(default_factory=list)  # `ha-live`: Patroni lost to the promotion
    lost_keys: list[str] = field(default_factory=list)
    failure: str | None = None
    result: str = "fail"
    data_dir: str = ""

    def line(self) -> str:
        return (f"chaos ha: kinds={self.kinds} rounds={self.rounds} promotions={self.promotions} "
                f"host_losses={self.host_losses} old_alive={self.old_alive} "
                f"with_safekeeper_down={self.with_safekeeper_down} acknowledged={self.acknowledged} "
                f"old_acks={self.old_acks} terminated={self.terminated} lost={self.lost} "
                f"kill_to_first_commit_median={_median(self.kill_to_commit)} max={_max(self.kill_to_commit)} "
                f"cut_to_promotion_median={_median(self.cut_to_promotion)} max={_max(self.cut_to_promotion)} "
                f"seed={self.seed} result={self.result}")


def _median(times: list[float]) -> str:
    return f"{statistics.median(times):.1f}s" if times else "-"


def _max(times: list[float]) -> str:
    return f"{max(times):.1f}s" if times else "-"


class Writer(threading.Thread):
    """Keys (w, i) one commit at a time to the server(s) `dsn` names, read at each connection (a round moves
    it); a key counts once its COMMIT returned, with or without a warning: a client that ignores warnings
    takes a cancelled SyncRep wait for a success, so such a commit must be on the new leader too."""

    def __init__(self, w: int, dsn: str) -> None:
        super().__init__(daemon=True)
        self.w, self.dsn = w, dsn
        self.acked: list[int] = []
        self.acks: list[tuple[float, float, int]] = []  # (sent, returned, port) of each acknowledged commit
        self.port: int | None = None  # the server of the open connection
        self.errors: list[tuple[float, int | None, str]] = []  # (when, port, first line) of each failed commit
        self.stopping = threading.Event()

    def run(self) -> None:
        i, conn = 0, None
        while not self.stopping.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=3)
                    self.port = conn.info.port
                i += 1
                sent = time.monotonic()
                conn.execute("INSERT INTO ledger VALUES (%s, %s)", (self.w, i))
                self.acks.append((sent, time.monotonic(), conn.info.port))
                self.acked.append(i)
            except psycopg.Error as e:
                if self.port is not None:  # a commit's error, not a refused connection
                    self.errors.append((time.monotonic(), self.port, (str(e).strip().splitlines() or ["?"])[0]))
                if conn is not None:
                    conn.close()
                conn, self.port = None, None
                self.stopping.wait(0.1)
        if conn is not None:
            conn.close()
        self.port = None


class ChaosFailure(Exception):
    pass


def wait(predicate: Callable[[], T], timeout: float, what: str, poll: float = 0.2) -> T:
    value = poll_for(predicate, timeout, poll)
    if not value:
        raise ChaosFailure(f"timed out after {timeout:g}s waiting for {what}")
    return value


def poll_for(predicate: Callable[[], T], timeout: float, poll: float = 0.2) -> T | None:
    """predicate()'s first truthy value, or None after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value or None
        time.sleep(poll)


def streaming_replica(node: Node) -> bool:
    st = node.patroni_state()
    return bool(st and st.get("role") == "replica" and st.get("state") == "running"
                and st.get("replication_state") == "streaming")


def is_primary(node: Node) -> bool:
    """The node's PostgreSQL itself says it takes writes (not Patroni: the old leader's may be gone)."""
    try:
        with psycopg.connect(node.dsn(), autocommit=True, connect_timeout=3) as c:
            return not c.execute("SELECT pg_is_in_recovery()").fetchone()[0]
    except psycopg.Error:
        return False


def sidecar_synchronous(node: Node) -> bool:
    """The node's sidecar streams and its primary's commits wait for it: the new lineage acknowledges."""
    try:
        with psycopg.connect(node.dsn(), autocommit=True, connect_timeout=3) as c:
            return c.execute("SELECT count(*) FROM pg_stat_replication WHERE application_name = 'walsidecar' "
                             "AND sync_state = 'sync'").fetchone()[0] > 0
    except psycopg.Error:
        return False


def sidecar_log(node: Node) -> str:
    path = node.dir / "sidecar.log"
    return path.read_text(errors="replace") if path.exists() else ""


class HaChaos:
    """The deployment, the writers, the seeded schedule of rounds and the checks."""

    def __init__(self, ha: HaDeployment, summary: HaSummary, kinds: tuple[str, ...], writers: int,
                 round_timeout: float) -> None:
        self.ha, self.summary, self.kinds = ha, summary, kinds
        self.rng = random.Random(summary.seed)
        self.round_timeout = round_timeout
        self.routed = ha.leader_dsn() + " connect_timeout=3"  # libpq keeps whichever node takes writes
        self.writers = [Writer(w, self.routed) for w in range(writers)]
        self.t0 = time.monotonic()  # t=0 of the times in the lost-write report

    def start(self) -> None:
        ha = self.ha
        ha.start_all()
        leader = ha.wait_leader(120)
        wait(lambda: all(streaming_replica(n) for n in ha.nodes if n is not leader), 180, "the replica to stream")
        with psycopg.connect(leader.dsn(), autocommit=True) as c:
            c.execute("CREATE TABLE ledger (w int, id bigint, PRIMARY KEY (w, id))")
        for t in self.writers:
            t.start()

    def acked(self) -> int:
        return sum(len(t.acked) for t in self.writers)

    def acks_after(self, after: float) -> list[tuple[float, float, int]]:
        """The acknowledgements returned after `after` (monotonic): each writer's list is in that order."""
        out = []
        for t in self.writers:
            n = len(t.acks)
            i = n
            while i > 0 and t.acks[i - 1][1] > after:
                i -= 1
            out += t.acks[i:n]
        return out

    def acks_on(self, port: int, after: float) -> int:
        """Commits acknowledged by the server on `port` after `after`."""
        return sum(1 for _, _, p in self.acks_after(after) if p == port)

    def first_ack(self, port: int, after: float) -> float | None:
        times = [done for _, done, p in self.acks_after(after) if p == port]
        return min(times) if times else None

    def round(self, r: int) -> None:
        ha, rng, s = self.ha, self.rng, self.summary
        kind = rng.choice(self.kinds)
        leader = ha.wait_leader(self.round_timeout)
        other = next(n for n in ha.nodes if n is not leader)
        for t in self.writers:
            # ha-live: straight to the leader's PostgreSQL, not routed, so they stay on it once it is fenced.
            t.dsn = leader.dsn() + " connect_timeout=3" if kind == "ha-live" else self.routed
        before = self.acked()
        wait(lambda: self.acked() >= before + PROGRESS_WRITES, self.round_timeout, f"commits on {leader.name}")
        down = None
        # Every fourth round, and one at random among the others, with a safekeeper down: 2 of 3 remain.
        if r % 4 == 2 or rng.random() < 0.1:
            down = rng.choice(SAFEKEEPERS)
            ha.d.members[down].stop()
        with_down = f" with {down} down" if down else ""
        if kind == "ha":
            said = self.host_loss(r, leader, other, with_down)
        else:
            said = self.live(r, leader, other, with_down)
        s.with_safekeeper_down += down is not None
        s.promotions += 1
        if down is not None:
            ha.d.members[down].start()
        leader.start()
        wait(lambda: streaming_replica(leader), self.round_timeout, f"{leader.name} to rejoin as a streaming replica")
        s.rounds = r
        print(f"round {r}: {said}; acknowledged {self.acked()}", flush=True)

    def host_loss(self, r: int, leader: Node, other: Node, with_down: str) -> str:
        """SIGKILL of the leader's whole node; the other node's first acknowledged commit."""
        s = self.summary
        killed = time.monotonic()
        leader.kill()
        at = wait(lambda: self.first_ack(other.pg_port, killed), self.round_timeout,
                  f"the first commit acknowledged by {other.name} after {leader.name}'s kill (round {r})")
        s.kill_to_commit.append(at - killed)
        s.host_losses += 1
        return f"killed {leader.name}{with_down}; {other.name} acknowledged a commit {at - killed:.1f}s later"

    def live(self, r: int, leader: Node, other: Node, with_down: str) -> str:
        """Only the leader's Patroni lost; the other node promoted through its gate while the old primary and
        its sidecar run on under the writers; the old side killed only once the new leader's sidecar streams."""
        s = self.summary
        old = leader.pg_port
        fenced_before = sidecar_log(leader).count(FENCED)
        terminated_before = sum(map(int, TERMINATED.findall(sidecar_log(leader))))
        sig = self.rng.choice((signal.SIGKILL, signal.SIGSTOP))
        cut = time.monotonic()
        leader.lose_patroni(sig)
        wait(lambda: is_primary(other), self.round_timeout,
             f"{other.name}'s promotion by Patroni through its gate while {leader.name}'s PostgreSQL runs on (round {r})")
        promoted = time.monotonic()
        # Without this the round would be a host loss: the old primary must still take writes.
        if not is_primary(leader) or leader.postmaster_pid() is None:
            raise ChaosFailure(f"round {r}: {leader.name}'s PostgreSQL was no longer a running primary when "
                               f"{other.name} was promoted: the old leader did not stay alive")
        s.old_alive += 1
        s.cut_to_promotion.append(promoted - cut)
        for t in self.writers:
            t.dsn = other.dsn() + " connect_timeout=3"  # at each one's next connection; some still wait on the old
        # The old lineage's chance to have commits acknowledged: until the new leader's sidecar is its
        # synchronous standby (from then on the safekeepers serve the new lineage) or the old primary
        # acknowledged PROGRESS_WRITES more (the hole). Not a failure on its own: the checks below say what it was.
        poll_for(lambda: sidecar_synchronous(other) or self.acks_on(old, promoted) >= PROGRESS_WRITES,
                 self.round_timeout)
        self.dba_sees_the_old_primary_fenced(r, leader)
        leader.kill()  # the remains: the lost Patroni, PostgreSQL with its backends, the follower
        # Commits still in flight on the old primary end (with an error) before anything is counted.
        wait(lambda: all(t.port != old for t in self.writers), self.round_timeout,
             f"every writer to leave the killed {leader.name}")
        late = self.acks_on(old, promoted)
        s.old_acks += late
        self.check_ledger(other, f"round {r} (the old primary acknowledged {late} commits after the promotion)")
        if late:
            raise ChaosFailure(f"round {r}: {leader.name}'s fenced primary acknowledged {late} commits after "
                               f"{other.name}'s promotion")
        log = sidecar_log(leader)
        if log.count(FENCED) <= fenced_before:
            raise ChaosFailure(f"round {r}: {leader.name}'s sidecar did not stop with LineageFenced after "
                               f"{other.name}'s gate fenced its timeline; see {leader.dir / 'sidecar.log'}")
        terminated = sum(map(int, TERMINATED.findall(log))) - terminated_before
        s.terminated += terminated
        errors = sorted({m for t in self.writers for at, p, m in list(t.errors) if p == old and at > cut})
        at = wait(lambda: self.first_ack(other.pg_port, promoted), self.round_timeout,
                  f"the first commit acknowledged by {other.name} (round {r})")
        return (f"{signal.Signals(sig).name} of {leader.name}'s Patroni{with_down}; {other.name} promoted "
                f"{promoted - cut:.1f}s later while {leader.name}'s primary ran on; its sidecar stopped, fenced, "
                f"terminating {terminated} waiting commits; {late} acknowledged there after the promotion; "
                f"{other.name} acknowledged a commit {at - cut:.1f}s after the cut; the writers' errors on "
                f"{leader.name}: {'; '.join(errors) or 'none'}")

    def dba_sees_the_old_primary_fenced(self, r: int, leader: Node) -> None:
        """`walsidecar check` on the old primary, still running, names it as the one a failover fenced out."""
        d = self.ha.d
        out = subprocess.run(sidecar_argv("check", "--pg-dsn", leader.dsn(), "--safekeepers", ",".join(d.addresses),
                                          *d.link_args("check", "client")),
                             capture_output=True, text=True, timeout=self.round_timeout, stdin=subprocess.DEVNULL)
        if not re.search(r"primary lineage: FAILED \(the failover of term \d+ ended this server's timeline", out.stdout):
            raise ChaosFailure(f"round {r}: `walsidecar check` on {leader.name}'s fenced primary does not say a "
                               f"failover ended its timeline (exit {out.returncode}):\n{out.stdout[-3000:]}"
                               f"{out.stderr[-2000:]}")

    def ledger(self, node: Node) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        """(acknowledged, missing on `node`); the acknowledged are taken first: each is visible to the query."""
        acked = {(t.w, i) for t in self.writers for i in list(t.acked)}
        with psycopg.connect(node.dsn(), autocommit=True, connect_timeout=10) as c:
            have = {(w, i) for w, i in c.execute("SELECT w, id FROM ledger")}
        return acked, acked - have

    def check_ledger(self, node: Node, when: str) -> None:
        s = self.summary
        acked, missing = self.ledger(node)
        s.acknowledged, s.lost = len(acked), len(missing)
        if missing:
            s.lost_keys = [self.acknowledgement(k) for k in sorted(missing)[:20]]
            for line in s.lost_keys[:10]:
                print(f"  lost {line}", file=sys.stderr)
            raise ChaosFailure(f"{len(missing)} of {len(acked)} acknowledged writes are missing on {node.name} "
                               f"after {when}")

    def acknowledgement(self, key: tuple[int, int]) -> str:
        """Which server acknowledged `key`, and when, for the lost-write report."""
        t = self.writers[key[0]]
        sent, done, port = t.acks[t.acked.index(key[1])]
        return f"key {key}: acknowledged by port {port} at t={done - self.t0:.2f}s (sent at t={sent - self.t0:.2f}s)"

    def finish(self) -> None:
        for t in self.writers:
            t.stopping.set()
        for t in self.writers:
            t.join(120)
        leader = self.ha.wait_leader(self.round_timeout)
        self.check_ledger(leader, "the last round")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # cleanup stops every process of the deployment


def run(rounds: int, seed: int | None, base_dir: Path | None, writers: int, round_timeout: float, keep: bool,
        json_file: Path | None, kinds: tuple[str, ...] = ("ha",)) -> int:
    configure("plain", "warning")
    seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    base = base_dir.absolute() if base_dir else Path(tempfile.mkdtemp(prefix="walsidecar-chaos-ha-", dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)
    summary = HaSummary(seed=seed, kinds=",".join(kinds), data_dir=str(base))
    print(f"chaos ha: {rounds} rounds of {', '.join(kinds)} under Patroni, seed {seed}, {writers} writers, in {base}",
          flush=True)
    ha = HaDeployment(base, log=get_logger(role="chaos-ha"))
    chaos = HaChaos(ha, summary, kinds, writers, round_timeout)
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        chaos.start()
        for r in range(1, rounds + 1):
            chaos.round(r)
        chaos.finish()
        summary.result = "ok" if summary.lost == 0 and summary.old_acks == 0 else "fail"
    except ChaosFailure as e:
        summary.failure = str(e)
        print(f"CHAOS FAILURE: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        summary.failure = summary.result = "interrupted"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for t in chaos.writers:
            t.stopping.set()
        summary.acknowledged = max(summary.acknowledged, chaos.acked())
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

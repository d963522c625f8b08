"""`walsidecar up` as a user drives it: kill one safekeeper, stop two, bring one back; ctl; ports; no orphans."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sidecar.consensus.messages import PROTOCOL_VERSION, Greeting, GreetingReply, VoteReply, VoteRequest
from support.helpers import consecutive_free_ports, free_port, wait_for, walsidecar
from support.procs import ManagedProcess, ProcessTracker
from support.wire import Peer

pytestmark = pytest.mark.integration

SAFEKEEPERS = ("safekeeper1", "safekeeper2", "safekeeper3")


class Up:
    """One `walsidecar up` subprocess in its own --dir, on free ports, with its stdout and stderr apart."""

    def __init__(self, procs: ProcessTracker, base: Path, *args: str) -> None:
        self.dir = base
        self.pg_port = free_port()
        self.stderr = base.with_name(base.name + "-stderr.log")
        argv = [sys.executable, "-m", "sidecar", "up", "--dir", str(base), "--pg-port", str(self.pg_port),
                "--safekeeper-port", str(consecutive_free_ports(3)), "--metrics-port", "0", *args]
        # exec: the PID tracked is `up`'s own; its stdout goes to the tracked log, its stderr (the log) apart.
        self.proc: ManagedProcess = procs.start(
            ["sh", "-c", 'exec "$@" 2>>"$0"', str(self.stderr), *argv], name="up")
        wait_for(lambda: "Press Ctrl-C to stop." in self.stdout() or not self.proc.running, timeout=180,
                 what="walsidecar up to be ready")
        assert self.proc.running, self.stdout()[-2000:] + self.log()[-3000:]
        self.config = base / "walsidecar.toml"
        self.dsn = (base / "ready").read_text().strip()

    def stdout(self) -> str:
        return self.proc.log_text()

    def log(self) -> str:
        return self.stderr.read_text(errors="replace") if self.stderr.exists() else ""

    def ctl(self, *args: str) -> Any:
        return walsidecar("ctl", "--dir", str(self.dir), *args, timeout=180)

    def members(self) -> dict[str, dict[str, str]]:
        """name -> {pid, state, restarts} as `ctl members` prints them."""
        answer = self.ctl("members")
        assert answer.returncode == 0, answer.stderr
        out_text = answer.stdout
        out = {}
        for line in out_text.splitlines()[1:]:
            name, pid, *state, restarts = line.split()
            out[name] = {"pid": pid, "state": " ".join(state), "restarts": restarts}
        return out

    def status(self) -> dict[str, Any]:
        out = walsidecar("status", "--config", str(self.config), "--format", "json")
        return json.loads(out.stdout)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(timeout=120) == 0, self.log()[-3000:]


def rows(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in doc["safekeepers"]}


def quorum(doc: dict[str, Any]) -> bool | None:
    return (doc.get("proposer") or {}).get("quorum_available")


class Commit:
    """An INSERT committed in a thread: it may wait for the quorum."""

    def __init__(self, dsn: str, value: int) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                with psycopg.connect(dsn, autocommit=True, application_name="test-commit") as c:
                    c.execute("INSERT INTO t VALUES (%s)", (value,))
            except BaseException as e:  # reported by the test
                self.error = e
            self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def finished(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.done.is_set()


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_kill_one_commits_go_on_stop_two_they_wait_bring_one_back(procs: ProcessTracker, test_dir: Path) -> None:
    up = Up(procs, test_dir / "up")
    with psycopg.connect(up.dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (v int)")
        c.execute("INSERT INTO t VALUES (0)")
    wait_for(lambda: quorum(d := up.status()) and all(r["state"] == "streaming" for r in d["safekeepers"]),
             timeout=60, what="all three safekeepers streaming")

    # Kill one: commits go on, status shows it down with the quorum available, `up` restarts it.
    before = up.members()["safekeeper1"]["pid"]
    up.proc.send_signal(signal.SIGSTOP)  # hold the supervisor, so that the moment it is down can be seen
    try:
        os.kill(int(before), signal.SIGKILL)
        commit = Commit(up.dsn, 1)
        wait_for(commit.finished, timeout=60, what="a commit with one safekeeper dead")
        wait_for(lambda: rows(d := up.status())[1]["state"] == "down" and quorum(d), timeout=60,
                 what="status to show safekeeper 1 down and the quorum available")
    finally:
        up.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: up.members()["safekeeper1"]["pid"] not in (before, "-"), timeout=60,
             what="up to restart safekeeper 1")
    assert up.members()["safekeeper1"]["restarts"] == "1"
    exited = next(ln for ln in up.log().splitlines() if "member exited" in ln)
    assert "member=safekeeper1" in exited and "exit_code=-9" in exited and "safekeeper1.log" in exited
    wait_for(lambda: rows(up.status())[1]["state"] == "streaming", timeout=60,
             what="status to show safekeeper 1 back")

    # Stop two: a commit waits, status shows the quorum lost and the WAL waiting in the limbo.
    for name in ("safekeeper2", "safekeeper3"):
        out = up.ctl("stop", name)
        assert out.returncode == 0 and f"stopped {name}" in out.stdout, out.stdout + out.stderr
    commit = Commit(up.dsn, 2)
    with psycopg.connect(up.dsn, autocommit=True) as c:
        wait_for(lambda: c.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'test-commit' "
                                   "AND wait_event = 'SyncRep'").fetchone()[0] == 1,
                 timeout=60, what="the commit to wait for the quorum (SyncRep)")

    def quorum_lost() -> dict[str, Any] | None:
        d = up.status()
        waiting = d["proposer"]["limbo"]["pending_bytes"] > 0 and d["primary"]["commits_waiting"] >= 1
        return d if quorum(d) is False and waiting else None

    doc = wait_for(quorum_lost, timeout=60, what="status to show the quorum lost and the limbo")
    assert rows(doc)[2]["state"] == rows(doc)[3]["state"] == "down"
    assert not commit.finished()
    members = up.members()
    assert members["safekeeper2"]["state"] == members["safekeeper3"]["state"] == "stopped"  # held, not restarted

    # Bring one back: the waiting commit completes and the quorum is available again.
    out = up.ctl("start", "safekeeper2")
    assert out.returncode == 0 and "started safekeeper2 (pid" in out.stdout, out.stdout + out.stderr
    assert "; the proposer streams to it (" in out.stdout, out.stdout
    # As the README types it: `status` right after `ctl start` shows it back and the quorum available, exit 0.
    out = walsidecar("status", "--config", str(up.config), "--format", "json")
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and quorum(doc), out.stdout + out.stderr
    assert rows(doc)[2]["state"] in ("catching up", "streaming"), out.stdout
    wait_for(commit.finished, timeout=60, what="the waiting commit to complete")
    assert up.members()["safekeeper3"]["state"] == "stopped"
    up.stop()


def test_banner_on_stdout_views_installed_and_ctl_errors(procs: ProcessTracker, test_dir: Path) -> None:
    up = Up(procs, test_dir / "up", "--log-format", "json")
    # The banner is for people: plain text on stdout even when the log is JSON; the log has it as well.
    config = test_dir / "up" / "walsidecar.toml"
    for line in (f"walsidecar status --config {config}", f"walsidecar check --config {config}",
                 f"walsidecar ctl --dir {up.dir} members", f'psql "{up.dsn}"', "restarted (with backoff)"):
        assert line in up.stdout(), up.stdout()
    events = [json.loads(ln) for ln in up.log().splitlines() if ln.startswith("{")]
    assert any(e["event"] == "walsidecar is up" and e["psql"] == up.dsn for e in events)
    assert not up.stdout().lstrip().startswith("{")
    out = walsidecar("status", "--config", str(config))
    assert out.returncode == 0 and out.stdout.count("| streaming") == 3, out.stdout + out.stderr
    out = walsidecar("check", "--config", str(config))
    assert out.returncode == 0 and "TLS: OK" in out.stdout, out.stdout
    assert "archive: OK (nothing to archive yet: commit_lsn" in out.stdout, out.stdout  # nothing to warn of yet
    # Given nothing, status points at this `up`'s file (WALSIDECAR_DIR: up's --dir, as for ctl).
    out = walsidecar("status", env={"WALSIDECAR_DIR": str(up.dir)})
    assert out.returncode == 2 and f"no --config given: a running `walsidecar up` has one: walsidecar status " \
                                   f"--config {config}" in out.stderr, out.stderr
    for name in ("safekeeper1", "safekeeper2", "safekeeper3", "proposer", "client"):
        assert (up.dir / "certs" / name / "node.key").stat().st_mode & 0o777 == 0o600

    # sql/install.sql is applied: the walsidecar.* views answer.
    with psycopg.connect(up.dsn, autocommit=True) as c:
        views = {r[0] for r in c.execute(
            "SELECT table_name FROM information_schema.views WHERE table_schema = 'walsidecar'")}
        assert {"status", "replication", "slots", "waiting_commits"} <= views
        assert c.execute("SELECT protecting_commits FROM walsidecar.status").fetchone() == (True,)
        # Committed segments go to the local archive (file://DIR/archive), under <cluster>/<system id>/wal.
        sysid = c.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]
        segment = c.execute("SELECT pg_walfile_name(pg_current_wal_lsn())").fetchone()[0]
        c.execute("SELECT pg_switch_wal()")
        c.execute("CREATE TABLE after_switch ()")
    archived = up.dir / "archive" / str(sysid) / str(sysid) / "wal" / segment
    wait_for(archived.exists, timeout=60, what=f"{archived} to be archived")

    # ctl: the socket is the owner's only; wrong members and a second `up` on the same --dir get clear answers.
    assert (up.dir / "up.sock").stat().st_mode & 0o777 == 0o600
    out = up.ctl("stop", "safekeeper9")
    assert out.returncode == 1 and "no member 'safekeeper9'" in out.stderr and "safekeeper1" in out.stderr
    out = up.ctl("stop")
    assert out.returncode == 2 and "Missing argument 'MEMBER'" in out.stderr
    out = walsidecar("up", "--dir", str(up.dir), "--metrics-port", "0", timeout=60)
    assert out.returncode == 1 and f"another `walsidecar up` (pid {up.proc.pid}) is running in {up.dir}" in out.stderr
    assert "Traceback" not in out.stderr
    members = up.members()
    assert set(members) == {"primary", *SAFEKEEPERS, "proposer"}
    assert all(m["state"] == "running" and m["restarts"] == "0" for m in members.values())
    up.stop()
    assert not (up.dir / "up.sock").exists()
    out = up.ctl("members")
    assert out.returncode == 1 and f"no `walsidecar up` running in {up.dir}" in out.stderr, out.stderr


def test_ctl_without_up(test_dir: Path) -> None:
    out = walsidecar("ctl", "--dir", str(test_dir / "none"), "start", "safekeeper1")
    assert out.returncode == 1 and f"no `walsidecar up` running in {test_dir / 'none'}" in out.stderr
    # A socket file left by an `up` that died answers nothing: the same message.
    test_dir.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(test_dir / "up.sock"))
    out = walsidecar("ctl", "--dir", str(test_dir), "members")
    assert out.returncode == 1 and f"no `walsidecar up` running in {test_dir}" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("taken", ["pg", "safekeeper", "metrics"])
def test_ports_in_use_are_named_before_initdb(test_dir: Path, taken: str) -> None:
    pg, sk, metrics = free_port(), consecutive_free_ports(3), consecutive_free_ports(4)
    port, option = {"pg": (pg, "--pg-port"), "safekeeper": (sk + 1, "--safekeeper-port"),
                    "metrics": (metrics + 3, "--metrics-port")}[taken]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        out = walsidecar("up", "--dir", str(test_dir / "up"), "--pg-port", str(pg), "--safekeeper-port", str(sk),
                         "--metrics-port", str(metrics))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"port {port}" in out.stderr and option in out.stderr and "in use" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not (test_dir / "up").exists()  # the --dir it made is gone: no lock file, nothing initialised


def test_a_refused_up_leaves_a_dir_it_did_not_make_as_it_was(test_dir: Path) -> None:
    base = test_dir / "up"
    (base / "pg").mkdir(parents=True)
    (base / "mine").write_text("kept\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = walsidecar("up", "--dir", str(base), "--pg-port", str(s.getsockname()[1]),
                         "--safekeeper-port", str(consecutive_free_ports(3)), "--metrics-port", "0")
    assert out.returncode == 1 and "in use" in out.stderr, out.stdout + out.stderr
    assert (base / "mine").read_text() == "kept\n" and (base / "pg").is_dir()


def test_killed_up_leaves_no_process_behind(procs: ProcessTracker, test_dir: Path) -> None:
    up = Up(procs, test_dir / "up")
    pids = [int(m["pid"]) for m in up.members().values()]
    assert len(pids) == 5 and all(alive(p) for p in pids)
    up.proc.kill9()
    wait_for(lambda: not any(alive(p) for p in pids), timeout=120,
             what="every process `up` started to exit after it was SIGKILLed")


def test_postgres_exiting_stops_up_with_a_clear_message(procs: ProcessTracker, test_dir: Path) -> None:
    up = Up(procs, test_dir / "up")
    pids = {name: int(m["pid"]) for name, m in up.members().items()}
    os.kill(pids["primary"], signal.SIGQUIT)  # PostgreSQL's immediate shutdown, as if it had crashed
    assert up.proc.wait(timeout=120) == 1
    assert "PostgreSQL (the primary) exited" in up.log() and "postgres.log" in up.log(), up.log()[-2000:]
    assert "Traceback" not in up.log()
    wait_for(lambda: not any(alive(p) for p in pids.values()), timeout=60, what="every member to stop")


def test_up_standby_takes_over_with_failover_after_kill_9_of_the_primary(procs: ProcessTracker,
                                                                         test_dir: Path) -> None:
    up = Up(procs, test_dir / "up", "--standby")
    assert "standby:" in up.stdout() and "walsidecar failover --config" in up.stdout()
    standby_dsn = next(line.split(" = ", 1)[1].strip('"') for line in up.config.read_text().splitlines()
                       if line.startswith("standby_dsn = "))
    with psycopg.connect(up.dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (v int)")
        for v in range(50):
            c.execute("INSERT INTO t VALUES (%s)", (v,))  # each one acknowledged by the quorum

    def standby_rows() -> int:
        with psycopg.connect(standby_dsn, autocommit=True, connect_timeout=5) as c:
            return c.execute("SELECT count(*) FROM t").fetchone()[0]
    wait_for(lambda: standby_rows() == 50, timeout=60, ignore=(psycopg.Error,),
             what="the standby to replay from safekeeper1's reader port")
    status = walsidecar("status", "--config", str(up.config))
    assert " Standby:  streaming from 127.0.0.1:" in status.stdout, status.stdout
    assert "failing" not in up.members()["standby"]["state"]
    postmaster = int((up.dir / "pg" / "postmaster.pid").read_text().split()[0])
    os.kill(postmaster, signal.SIGKILL)
    # `up` keeps the safekeepers and the standby running: the standby can take over.
    wait_for(lambda: up.members()["primary"]["state"] == "stopped", timeout=60, what="up to hold the primary")
    assert up.proc.running and all(up.members()[s]["state"] == "running" for s in SAFEKEEPERS)
    out = walsidecar("failover", "--config", str(up.config), timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5/5 resume" in out.stdout
    with psycopg.connect(standby_dsn, autocommit=True) as c:
        assert c.execute("SELECT pg_is_in_recovery()").fetchone()[0] is False
        assert c.execute("SELECT count(*) FROM t").fetchone()[0] == 50
    up.stop()


def test_a_wiped_safekeeper_under_up_grants_no_term_until_its_wal_holds_a_later_one(procs: ProcessTracker,
                                                                                   test_dir: Path) -> None:
    """Issue 24: `up` creates its safekeepers once, so a wiped one is a lost disk. While too few of its peers
    answer it refuses every vote; having learned its term it still grants none (it may lack a commit it
    acknowledged) until its WAL holds the start of a later term, which the proposer elected by the others
    catches it up to. A test client speaks as a proposer (`up --insecure`: no certificates)."""
    up = Up(procs, test_dir / "up", "--insecure")
    with psycopg.connect(up.dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (v int)")
        c.execute("INSERT INTO t VALUES (1)")
    before = rows(up.status())[2]
    term, port = before["term"], int(before["address"].rpartition(":")[2])
    greeting = Greeting(PROTOCOL_VERSION, "test", int(before["own"]["system_id"]), 1, 16 << 20, 15, 3)
    assert term >= 1 and (up.dir / "safekeeper2.created").exists()
    log = up.dir / "safekeeper2.log"
    assert up.ctl("stop", "safekeeper3").returncode == 0  # one peer of two: not enough to learn from
    assert up.ctl("stop", "safekeeper2").returncode == 0
    shutil.rmtree(up.dir / "safekeeper2")  # its disk is lost
    assert up.ctl("start", "safekeeper2").returncode == 0
    wait_for(lambda: "not voting until enough peers" in log.read_text(), timeout=60,
             what="the wiped safekeeper to wait for its peers")
    peer = Peer(port)
    assert isinstance(peer.ask(greeting), GreetingReply)
    peer.refused(VoteRequest(1), "empty data directory")  # term 1: it granted it when `up` began
    assert rows(up.status())[2]["state"] == "lost disk: learning its term"
    check = walsidecar("check", "--config", str(up.config))
    assert check.returncode == 1 and "an empty data directory (a lost disk) that has not learned its term" \
        in check.stdout, check.stdout
    assert up.ctl("start", "safekeeper3").returncode == 0
    wait_for(lambda: "learned the term from the peers" in log.read_text(), timeout=60,
             what="the wiped safekeeper to learn its term from both peers")
    own = rows(up.status())[2]["own"]
    assert own["amnesic"] is False and own["lost_disk_term"] >= term and own["members"] == 3, own
    peer = Peer(port)
    assert isinstance(peer.ask(greeting), GreetingReply)
    for old in (1, term):
        vote = peer.ask(VoteRequest(old))
        assert isinstance(vote, VoteReply) and not vote.granted, vote
    # A term above all it learned: promised (nothing lower is taken) but not granted, with an empty WAL.
    vote = peer.ask(VoteRequest(term + 10))
    assert isinstance(vote, VoteReply) and not vote.granted and vote.lost_disk_term >= term, vote
    peer.close()
    # That promise ended the proposer's term on safekeeper 2; the others elect it again, it says why safekeeper 2
    # withheld its vote, and catches it up: commits go on.
    proposer_log = up.dir / "proposer.log"
    wait_for(lambda: "vote withheld" in proposer_log.read_text(), timeout=60,
             what="the proposer to log the withheld vote")
    with psycopg.connect(up.dsn, autocommit=True) as c:
        c.execute("INSERT INTO t VALUES (2)")
    wait_for(lambda: (rows(up.status())[2].get("own") or {}).get("lost_disk_term", 1) is None, timeout=60,
             what="safekeeper 2's WAL to hold the start of the term after the one it learned")
    assert rows(up.status())[2]["term"] > term + 10
    up.stop()

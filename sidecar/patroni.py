"""walsidecar under Patroni: the sidecar follows the leader (`walsidecar follow-leader`), and the Patroni
configuration that keeps Patroni's hands off what walsidecar owns (docs/ha.md).

Patroni decides *when* and *which* node is promoted; `walsidecar failover-gate` (its `pre_promote`)
decides *whether*: only after fencing a safekeeper quorum and bringing the node to the quorum's commit
position. The sidecar must run where the primary is, and only there: `follow-leader` asks the local
Patroni's REST API (GET /primary answers 200 only on the running leader) and starts `walsidecar start`
when it becomes the primary, stops it when it is demoted. A watcher rather than Patroni's
on_role_change callback: the callbacks are asynchronous, fire once (a lost one is never repeated), and
Patroni kills a callback still running when the next one starts, so they cannot supervise a long-running
process; the watcher also restarts the sidecar when it exits while the node stays the leader.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sidecar.logs import get_logger
from sidecar.processes import die_with_parent, walsidecar_argv

# On the primary, a sidecar that exits is started again after this (doubling up to RESTART_MAX): a fenced
# old primary's sidecar exits at each try and must not spin.
RESTART_FIRST, RESTART_MAX = 0.5, 10.0
STOP_TIMEOUT = 15.0


def patroni_role(url: str, timeout: float = 2.0) -> str | None:
    """'primary' when the node's Patroni holds the leader key and its PostgreSQL is promoted, 'replica' when
    it answers otherwise, None when it does not answer (Patroni down or starting)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/primary", timeout=timeout) as r:
            # 200 comes with the leader key, before pre_promote and the promotion: the body's role is
            # PostgreSQL's own, and a sidecar started on a standby would only be refused.
            body = json.load(r)
            return "primary" if r.status == 200 and body.get("role") in ("primary", "master") else "replica"
    except urllib.error.HTTPError as e:
        e.close()
        return "replica"  # 503: Patroni answers, and this node is not the leader
    except (OSError, ValueError):
        return None  # ValueError: not JSON, not Patroni


class FollowLeader:
    """Run `walsidecar start --config CONFIG` while the local Patroni is the leader, and only then."""

    def __init__(self, patroni_url: str, sidecar_config: Path, poll: float = 0.5) -> None:
        self.url = patroni_url
        self.argv = walsidecar_argv("start", "--config", str(sidecar_config))
        self.poll = poll
        self.log = get_logger(role="follow-leader", patroni=patroni_url)
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.delay = RESTART_FIRST
        self.due = 0.0

    def run(self) -> None:
        """Until SIGTERM/SIGINT; the sidecar it runs is stopped (SIGTERM) on the way out."""
        def stop(signum: int, frame: Any) -> None:
            self.stopping = True
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self.log.info("following the Patroni leader: the sidecar runs here while this node is the primary",
                      sidecar=" ".join(self.argv))
        role: str | None = "unknown"
        try:
            while not self.stopping:
                now_role = patroni_role(self.url)
                if now_role != role:
                    self.log.info("Patroni role", role=now_role or "unreachable", was=role)
                    role = now_role
                self.step(role)
                time.sleep(self.poll)
        finally:
            self._stop_sidecar("the follower stops")

    def step(self, role: str | None) -> None:
        running = self.child is not None and self.child.poll() is None
        if role == "primary":
            if running:
                return
            if self.child is not None:  # it exited on its own while this node leads
                code = self.child.returncode
                self.child = None
                self.due = time.monotonic() + self.delay
                self.log.error("the sidecar exited on the primary; starting it again", exit_code=code,
                               restart_in=self.delay)
                self.delay = min(self.delay * 2, RESTART_MAX)
                return
            if time.monotonic() >= self.due:
                self.child = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, start_new_session=True,
                                              preexec_fn=die_with_parent(signal.SIGTERM))
                self.log.info("this node is the primary: sidecar started", pid=self.child.pid)
        elif role == "replica":
            self.delay = RESTART_FIRST
            self._stop_sidecar("this node is a replica now")
        # Patroni unreachable: keep what runs. A primary whose Patroni died is fenced by the next leader's
        # failover-gate (its sidecar is then refused and exits); stopping it here would only stall commits
        # that the quorum can still acknowledge while this node holds the leader key.

    def _stop_sidecar(self, why: str) -> None:
        if self.child is None:
            return
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
            try:
                self.child.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
            self.log.info("sidecar stopped", why=why, pid=self.child.pid, exit_code=self.child.returncode)
        self.child = None


def patroni_cluster(urls: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """Patroni's GET /cluster from the first of `urls` that answers: its members, with role, state and timeline."""
    problems = []
    for url in urls:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/cluster", timeout=timeout) as r:
                doc = json.load(r)
        except (OSError, ValueError) as e:
            problems.append(f"{url}: {e}")
            continue
        members = [{"name": m.get("name"), "role": {"master": "primary", "leader": "primary"}.get(m.get("role"),
                                                                                               m.get("role")),
                    "state": m.get("state"), "timeline": m.get("timeline"), "lag": m.get("lag"),
                    "host": m.get("host"), "port": m.get("port")} for m in doc.get("members", [])]
        leader = next((m["name"] for m in members if m["role"] == "primary"), None)
        return {"asked": url, "leader": leader, "members": members}
    raise OSError("no Patroni answered: " + "; ".join(problems))


def patroni_lines(p: dict[str, Any] | None) -> list[str]:
    """`walsidecar status`'s Patroni line: the leader, then each member."""
    if p is None:
        return []
    if p.get("error"):
        return [f" Patroni:  {p['error']}"]
    members = ", ".join(f"{m['name']} {m['role']} {m['state']}" + (f" timeline {m['timeline']}" if m['timeline'] else "")
                        + (f" lag {m['lag']}" if m.get("lag") not in (None, 0, "") else "") for m in p["members"])
    return [f" Patroni:  leader {p['leader'] or 'NONE (no node holds the leader key)'}; {members}"]

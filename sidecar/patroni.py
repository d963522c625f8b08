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

On a replica, the watcher also sees a lost leader's host sooner than Patroni does (`LeaderLoss`): it ends
the dead leader's etcd lease, and Patroni elects at once instead of waiting out `ttl`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sidecar.broker import Broker, BrokerError, TlsFiles, parse_endpoints
from sidecar.logs import get_logger
from sidecar.processes import die_with_parent, walsidecar_argv

# On the primary, a sidecar that exits is started again after this (doubling up to RESTART_MAX): a fenced
# old primary's sidecar exits at each try and must not spin.
RESTART_FIRST, RESTART_MAX = 0.5, 10.0
STOP_TIMEOUT = 15.0
# A connection to the leader's ports gets this long: a lost host drops packets, and a live one under
# load still accepts within it (the kernel answers the handshake, not the busy process).
PROBE_TIMEOUT = 1.0
# etcd is asked about the leader's lease at most this often while the leader answers nothing here.
LEASE_CHECK_INTERVAL = 1.0


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


class LeaderLoss:
    """When a replica may end its leader's etcd lease ahead of its expiry: the leader's host is lost.

    Patroni sees a lost leader only when its key expires, `ttl` seconds (at least 20) after the last
    renewal. Two witnesses must agree for `after` seconds before this replica ends the lease: from here,
    neither the leader's REST API nor its PostgreSQL accepts a connection; and in etcd, the leader has not
    renewed its lease (Patroni renews it every loop_wait) for as long. A leader cut off from this node
    alone still renews its lease and keeps its key: a partition between the nodes fails nothing over, and
    the two cannot take the key from each other in turn. Ending a live leader's lease would still be safe
    (the new leader's failover-gate fences its timeline first); it would only cost a needless failover.

    Pure: the follower probes, reads etcd and owns the clock.
    """

    def __init__(self, after: float) -> None:
        if after <= 0:
            raise ValueError("the time a leader may answer nothing must be above 0")
        self.after = after
        self.leader: str | None = None
        self.silent_since: float | None = None

    def observe(self, now: float, leader: str | None, answered: bool) -> bool:
        """Another look at the leader `leader` (None: none): True once it has answered nothing from here
        for `after` seconds, when etcd should be asked about its lease."""
        if leader != self.leader or answered or leader is None:
            self.leader = leader
            self.silent_since = None if answered or leader is None else now
            return False
        if self.silent_since is None:
            self.silent_since = now
        return now - self.silent_since >= self.after

    def silent_for(self, now: float) -> float:
        return 0.0 if self.silent_since is None else now - self.silent_since

    def lease_lost(self, seconds_left: int, granted: int) -> bool:
        """Whether etcd's view of the leader's lease agrees: not renewed for `after` seconds (or gone)."""
        return seconds_left < 0 or granted - seconds_left >= self.after


@dataclass(frozen=True)
class PatroniDcs:
    """Where a Patroni cluster keeps its leader key: its etcd (API v3) and the key, from its patroni.yml."""

    endpoints: tuple[str, ...]
    leader_key: str
    tls: TlsFiles | None = None


def patroni_dcs(path: Path) -> PatroniDcs:
    """Read `path` as Patroni does (its own loader: defaults, PATRONI_* environment); ValueError saying what
    is missing or not supported."""
    # Importing Patroni sets the process's umask to its data directory's (patroni.file_perm, at import), and
    # its loader may again: the follower's files and the sidecar it starts keep the umask they were given.
    umask = os.umask(0o022)
    os.umask(umask)
    try:
        from patroni.config import Config
        config = Config(str(path), validator=None)
    except ImportError:
        raise ValueError("Patroni is not installed: pip install 'walsidecar[ha]'") from None
    except Exception as e:  # Patroni's loader raises what YAML and its own checks raise
        raise ValueError(f"{path}: Patroni cannot read it: {e}") from None
    finally:
        os.umask(umask)
    scope = config.get("scope")
    if not scope:
        raise ValueError(f"{path}: no scope: Patroni's leader key is named after it")
    etcd = config.get("etcd3")
    if not isinstance(etcd, dict):
        raise ValueError(f"{path}: no etcd3 section: the lost-leader check reads Patroni's leader key from etcd "
                         "(API v3)")
    unsupported = [k for k in ("srv", "srv_suffix", "proxy", "username", "password", "key_password") if etcd.get(k)]
    if unsupported:
        raise ValueError(f"{path}: etcd3 {', '.join(unsupported)}: not supported by the lost-leader check; list "
                         "the endpoints in etcd3.hosts, or turn the check off (no --patroni-config)")
    protocol = etcd.get("protocol", "http")
    if etcd.get("url"):
        urls = [str(etcd["url"])]
    else:
        hosts = etcd.get("hosts") or etcd.get("host")
        if not hosts:
            raise ValueError(f"{path}: etcd3 names no hosts, host or url")
        if isinstance(hosts, str):
            hosts = hosts.split(",")
        urls = [f"{protocol}://{h.strip()}" for h in hosts]
    endpoints = parse_endpoints(urls)
    namespace = config.get("namespace") or "service"
    tls = TlsFiles(etcd.get("cacert"), etcd.get("cert"), etcd.get("key")) \
        if any(u.startswith("https:") for u in endpoints) else None
    return PatroniDcs(endpoints, re.sub("/+", "/", f"/{namespace}/{scope}") + "/leader", tls)


@dataclass(frozen=True)
class LeaderMember:
    """The leader as this node's Patroni lists it: its name and where its REST API and PostgreSQL listen."""

    name: str
    addresses: tuple[tuple[str, int], ...]


def leader_member(cluster: dict[str, Any]) -> LeaderMember | None:
    """The leader of a `patroni_cluster` answer, with the addresses to probe; None without one."""
    for m in cluster["members"]:
        if m["role"] != "primary" or not m.get("name"):
            continue
        addresses = []
        if m.get("host") and m.get("port"):
            addresses.append((str(m["host"]), int(m["port"])))
        api = urlsplit(m.get("api_url") or "")
        if api.hostname:
            addresses.append((api.hostname, api.port or (443 if api.scheme == "https" else 80)))
        return LeaderMember(str(m["name"]), tuple(addresses))
    return None


def accepts(address: tuple[str, int], timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether anything accepts a TCP connection there: the host and its process are up."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


class FollowLeader:
    """Run `walsidecar start --config CONFIG` while the local Patroni is the leader, and only then; on a
    replica, end a lost leader's etcd lease (`LeaderLoss`) when `dcs` is given."""

    def __init__(self, patroni_url: str, sidecar_config: Path, poll: float = 0.5, dcs: PatroniDcs | None = None,
                 leader_lost_after: float = 3.0) -> None:
        self.url = patroni_url
        self.argv = walsidecar_argv("start", "--config", str(sidecar_config))
        self.poll = poll
        self.log = get_logger(role="follow-leader", patroni=patroni_url)
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.delay = RESTART_FIRST
        self.due = 0.0
        self.dcs = dcs
        self.loss = LeaderLoss(leader_lost_after)
        self.lease_asked = 0.0
        self.partition_logged: str | None = None

    def run(self) -> None:
        """Until SIGTERM/SIGINT; the sidecar it runs is stopped (SIGTERM) on the way out."""
        def stop(signum: int, frame: Any) -> None:
            self.stopping = True
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self.log.info("following the Patroni leader: the sidecar runs here while this node is the primary",
                      sidecar=" ".join(self.argv))
        if self.dcs is not None:
            self.log.info("watching the leader from this node: a leader whose host answers nothing here and "
                          "renews nothing in etcd for leader_lost_after loses its lease at once",
                          leader_lost_after=self.loss.after, etcd=",".join(self.dcs.endpoints),
                          leader_key=self.dcs.leader_key)
        role: str | None = "unknown"
        try:
            while not self.stopping:
                now_role = patroni_role(self.url)
                if now_role != role:
                    self.log.info("Patroni role", role=now_role or "unreachable", was=role)
                    role = now_role
                self.step(role)
                if role == "replica" and self.dcs is not None:
                    self.watch_leader(self.dcs)
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

    def watch_leader(self, dcs: PatroniDcs) -> None:
        """On a replica: probe the leader Patroni names; once both witnesses agree, end its lease."""
        try:
            leader = leader_member(patroni_cluster((self.url,), PROBE_TIMEOUT))
        except OSError:
            return  # this node's Patroni is busy or restarting: it has no view of the leader to act on
        now = time.monotonic()
        answered = leader is not None and (not leader.addresses or any(accepts(a) for a in leader.addresses))
        if not self.loss.observe(now, leader.name if leader else None, answered):
            if answered:
                self.partition_logged = None
            return
        if now - self.lease_asked < LEASE_CHECK_INTERVAL:
            return
        self.lease_asked = now
        assert leader is not None
        try:
            asyncio.run(self._end_lost_lease(dcs, leader.name, self.loss.silent_for(now)))
        except BrokerError as e:
            self.log.warning("the leader answers nothing here, and etcd cannot be asked about its lease",
                             leader=leader.name, error=str(e))

    async def _end_lost_lease(self, dcs: PatroniDcs, name: str, silent_for: float) -> None:
        broker = Broker(dcs.endpoints, tls_files=dcs.tls, timeout=PROBE_TIMEOUT)
        try:
            held = await broker.holder(dcs.leader_key)
            if held is None or held[0] != name or not held[1]:
                return  # the key expired, or another node took it: Patroni is already at it
            lease = held[1]
            left, granted = await broker.lease_ttl(lease)
            if not self.loss.lease_lost(left, granted):
                if self.partition_logged != name:
                    self.partition_logged = name
                    self.log.warning("the leader answers nothing here but renews its lease in etcd: a partition "
                                     "between the nodes, not a lost host; its key is left alone",
                                     leader=name, silent_for=round(silent_for, 1), lease_seconds_left=left)
                return
            await broker.revoke(lease)
            self.log.warning("the leader's host is lost: ended its etcd lease, so that Patroni elects a new leader "
                             "now rather than when the lease runs out", leader=name, lease=f"{lease:x}",
                             silent_for=round(silent_for, 1), not_renewed_for=granted - left if left >= 0 else None)
        finally:
            broker.close()

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
                    "host": m.get("host"), "port": m.get("port"), "api_url": m.get("api_url")}
                   for m in doc.get("members", [])]
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

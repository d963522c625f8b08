"""`walsidecar up --ha`: etcd, three safekeepers and two Patroni-managed PostgreSQL 15 nodes on this machine.

Each node is Patroni (as the postgres OS user), the PostgreSQL it manages, and `walsidecar follow-leader`,
which runs the sidecar there while the node is the leader. Patroni's `pre_promote` is `walsidecar
failover-gate`: a node is promoted only once it holds every acknowledged commit. The files each node
runs from are written under DIR/nodeN (patroni.yml, walsidecar.toml), as a recipe for real hosts
(docs/ha.md). `ctl kill node1` SIGKILLs the whole node at once, as a host loss.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sidecar.deployment import (
    APP, LOOPBACK_HOST, DeploymentError, LocalDeployment, Member, ProcessMember, start_tied_child,
)
from sidecar.pgcluster import LocalCluster, find_bin_dir
from sidecar.processes import Child, process_tree, walsidecar_argv

ETCD = "/usr/bin/etcd"
NODES = ("node1", "node2")
SCOPE = "walsidecar"

# Patroni's timing (docs/ha.md "Timing"). A dead leader's key lives `ttl` seconds (Patroni raises anything
# below 20 to 20) unless the replica's follower ends its lease first; the replica looks every `loop_wait` (and
# at once when it sees the key go); a DCS or PostgreSQL call is retried for `retry_timeout`. Patroni's rule
# loop_wait + 2 * retry_timeout <= ttl keeps an etcd hiccup of retry_timeout from costing a healthy leader
# its key; 2 + 2 * 5 = 12 leaves 8 s of margin.
TTL, LOOP_WAIT, RETRY_TIMEOUT = 20, 2, 5
# Ahead of that expiry, the replica's follow-leader ends a lost leader's lease (sidecar/patroni.py
# LeaderLoss): after this many seconds of its ports refusing and its lease unrenewed (a live leader renews
# every LOOP_WAIT, so 3 s is one missed renewal and more).
LEADER_LOST_AFTER = 3.0
# The gate's own bounds: well inside Patroni's patience (it renews the lock while the hook runs).
GATE_TIMEOUT, GATE_CATCHUP_TIMEOUT = 15, 15


def _toml(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _yaml(value: Any) -> str:
    """JSON is YAML: every scalar and list of the Patroni file, quoted safely."""
    return json.dumps(value)


class Etcd(ProcessMember):
    """One etcd member on loopback: Patroni's DCS (and the broker's, for a deployment that uses one)."""

    def __init__(self, d: LocalDeployment, name: str = "etcd") -> None:
        super().__init__(d, name, port=d.pick_port())
        self.peer_port = d.pick_port()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK_HOST}:{self.port}"

    def argv(self) -> list[str]:
        peer = f"http://{LOOPBACK_HOST}:{self.peer_port}"
        return [ETCD, "--name", "etcd", "--data-dir", str(self.data_dir), "--listen-client-urls", self.url,
                "--advertise-client-urls", self.url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
                peer, "--initial-cluster", f"etcd={peer}", "--logger", "zap", "--log-outputs", "stderr"]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return b'"true"' in r.read()
        except OSError:
            return False


class Node(Member):
    """One HA node: Patroni with its PostgreSQL, and the follower running the sidecar while it leads.

    Patroni runs as PostgreSQL's OS user (pg_ctl refuses root). `kill` is a host loss: every process of
    the node gets SIGKILL at once, PostgreSQL's backends included.
    """

    def __init__(self, ha: HaDeployment, name: str, pg_port: int | None = None) -> None:
        self.ha, self.name = ha, name
        self.dir = ha.base / name
        self.pg_port = pg_port or ha.d.pick_port()
        self.api_port, self.metrics_port = ha.d.pick_port(), ha.d.pick_port()
        self.cluster = LocalCluster(self.dir / "data", self.pg_port, log_file=self.dir / "postgres.log")
        self.patroni: Child | None = None
        self.follower: Child | None = None
        self.wanted = False

    # ---- what is where

    @property
    def api(self) -> str:
        return f"http://{LOOPBACK_HOST}:{self.api_port}"

    def dsn(self) -> str:
        return f"host={LOOPBACK_HOST} port={self.pg_port} user=postgres dbname=postgres"

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def log_path(self) -> Path:
        return self.dir / "patroni.log"

    @property
    def process(self) -> Child | None:
        return self.patroni

    @property
    def running(self) -> bool:
        return self.patroni is not None and self.patroni.running

    def patroni_state(self) -> dict[str, Any] | None:
        """Patroni's GET / of this node (role, state, timeline, xlog), None when it does not answer."""
        try:
            with urllib.request.urlopen(self.api + "/", timeout=2) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:  # 503 on a replica or a stopped PostgreSQL: the body says why
            try:
                return json.load(e)
            except ValueError:
                return None
            finally:
                e.close()
        except (OSError, ValueError):
            return None

    # ---- the recipe

    def write_files(self) -> None:
        """DIR/nodeN/patroni.yml and walsidecar.toml, and copies of the credentials the postgres user reads."""
        ha = self.ha
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)
        certs = ha.d.certs_dir(f"{self.name}-sidecar", "proposer")
        passfile = self.dir / "reader.pgpass"
        assert ha.d.reader_passfile is not None
        passfile.write_bytes(ha.d.reader_passfile.read_bytes())
        os.chmod(passfile, 0o600)
        readers = ",".join(map(str, ha.d.reader_addresses))
        config = self.dir / "walsidecar.toml"
        link = "insecure = true\n" if certs is None else f"certs_dir = {_toml(str(certs))}\n"
        if ha.d.link_security != "tls":
            link += f"link_security = {_toml(ha.d.link_security)}\n"
        config.write_text(
            f"# {self.name}'s walsidecar settings, written by `walsidecar up --ha`.\n"
            "# `walsidecar follow-leader` runs `walsidecar start --config THIS_FILE` while this node leads;\n"
            "# Patroni's pre_promote runs `walsidecar failover-gate --config THIS_FILE` before promoting it.\n"
            f"pg_dsn = {_toml(self.dsn())}\n"
            f"safekeepers = {_toml(','.join(ha.d.addresses))}\n"
            f"application_name = {_toml(APP)}\n"
            f"archive = {_toml(ha.archive)}\n" + link
            + f"metrics = {_toml(f'{LOOPBACK_HOST}:{self.metrics_port}')}\n"
            "\n[failover-gate]\n"
            f"standby_dsn = {_toml(self.dsn())}\n"
            f"reader_passfile = {_toml(str(passfile))}\n"
            f"safekeeper_readers = {_toml(readers)}\n"
            f"timeout = {GATE_TIMEOUT}\n"
            f"catchup_timeout = {GATE_CATCHUP_TIMEOUT}\n"
            "\n[follow-leader]\n"
            f"patroni_url = {_toml(self.api)}\n"
            f"sidecar_config = {_toml(str(config))}\n"
            "# On the replica: a leader whose ports accept nothing from here and whose etcd lease is not renewed\n"
            f"# for leader_lost_after seconds loses its lease at once, not ttl ({TTL} s) after its last renewal.\n"
            f"patroni_config = {_toml(str(self.dir / 'patroni.yml'))}\n"
            f"leader_lost_after = {LEADER_LOST_AFTER}\n")
        gate = walsidecar_argv("failover-gate", "--config", str(config), "--log-format", "json")
        (self.dir / "patroni.yml").write_text(self.patroni_yaml(shlex.join(gate)))
        # The postgres OS user runs Patroni, the gate and restore_command: it owns what they read.
        owned = [self.dir, config, passfile, self.dir / "patroni.yml"]
        if certs is not None:
            owned += [certs, *certs.iterdir()]
        for path in owned:
            self.cluster._chown(path)

    def patroni_yaml(self, gate: str) -> str:
        ha, y = self.ha, _yaml
        others = [n for n in ha.nodes if n is not self]
        return f"""# {self.name}'s Patroni configuration, written by `walsidecar up --ha` (docs/ha.md explains each part).
scope: {SCOPE}
name: {self.name}
restapi:
  listen: {y(f'{LOOPBACK_HOST}:{self.api_port}')}
  connect_address: {y(f'{LOOPBACK_HOST}:{self.api_port}')}
etcd3:
  hosts: {y(f'{LOOPBACK_HOST}:{ha.etcd.port}')}
log:
  level: INFO
bootstrap:
  dcs:
    # A dead leader is replaced after at most ttl + loop_wait seconds; loop_wait + 2 * retry_timeout <= ttl.
    ttl: {TTL}
    loop_wait: {LOOP_WAIT}
    retry_timeout: {RETRY_TIMEOUT}
    # Any replica can be brought to the quorum's commit position by failover-gate: lag is no reason to refuse.
    maximum_lag_on_failover: 1099511627776
    # walsidecar, not Patroni, owns synchronous_standby_names: the sidecar is the synchronous standby.
    synchronous_mode: false
    # The sidecar's slot exists on whichever node leads; its horizon slot is the sidecar's own business.
    slots:
      {APP}:
        type: physical
    ignore_slots:
      - name: {APP}_horizon
        type: physical
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        synchronous_standby_names: {APP}
        wal_level: replica
        wal_log_hints: "on"
        max_wal_senders: 10
        max_replication_slots: 10
        max_slot_wal_keep_size: 10GB
        hot_standby: "on"
        # A replica whose leader is gone asks restore_command (the safekeepers) again after this long.
        wal_retrieve_retry_interval: 1s
  initdb:
    - encoding: UTF8
    - data-checksums
postgresql:
  listen: {y(f'{LOOPBACK_HOST}:{self.pg_port}')}
  connect_address: {y(f'{LOOPBACK_HOST}:{self.pg_port}')}
  data_dir: {y(str(self.data_dir))}
  bin_dir: {y(str(find_bin_dir()))}
  pgpass: {y(str(self.dir / 'patroni.pgpass'))}
  authentication:
    superuser:
      username: postgres
      password: {y(ha.password)}
    replication:
      username: postgres
      password: {y(ha.password)}
    rewind:
      username: postgres
      password: {y(ha.password)}
  # Loopback only, on one machine: docs/ha.md has the scram-sha-256 lines for real hosts.
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
  parameters:
    # TCP only: a unix socket path under DIR may pass the 107-byte limit, and /tmp is shared.
    unix_socket_directories: ""
  # Patroni promotes this node only after the gate exits 0: it fenced a safekeeper quorum (the old
  # leader's timeline ends at E for good) and this node replayed E. The WAL it lacks, past what it
  # received from the dead leader, the gate writes into its pg_wal from the safekeepers' reader ports
  # (no restore_command: PostgreSQL would run it over and over while promoting, seconds each time).
  pre_promote: {y(gate)}
tags:
  nofailover: false
  noloadbalance: false
  clonefrom: false
# The other node(s): {', '.join(o.name for o in others)}
"""

    # ---- life

    def _popen_kwargs(self) -> dict[str, Any]:
        kwargs = self.cluster.spawn_kwargs()
        kwargs["env"] = {**kwargs["env"], "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        return kwargs

    def start(self, *extra: str) -> None:
        if self.running:
            return
        self.write_files()
        patroni = str(Path(sys.executable).with_name("patroni"))
        if not os.path.exists(patroni):
            raise DeploymentError("Patroni is not installed: pip install 'walsidecar[ha]' (into the venv "
                                  f"of {sys.executable})")
        self.patroni = Child(f"{self.name}-patroni", [patroni, str(self.dir / "patroni.yml")], self.log_path,
                             parent_death_signal=signal.SIGTERM, **self._popen_kwargs()).start()
        self.follower = start_tied_child(
            f"{self.name}-follower", walsidecar_argv("follow-leader", "--config", str(self.dir / "walsidecar.toml"),
                                                     "--log-format", self.ha.d.log_format),
            self.dir / "sidecar.log")
        self.wanted = True
        self.ha.d.note("node started", node=self.name, patroni_pid=self.patroni.pid, follower_pid=self.follower.pid,
                       pg_port=self.pg_port, api=self.api)

    def stop(self, timeout: float = 60) -> None:
        """Patroni stops its PostgreSQL (fast) on SIGTERM; the follower stops the sidecar."""
        self.wanted = False
        was = self.running
        if self.patroni is not None:
            self.patroni.send_signal(signal.SIGCONT)  # one stopped by lose_patroni(SIGSTOP) must run to stop
        for child in (self.follower, self.patroni):
            if child is not None and child.running:
                child.stop(timeout=timeout)
        self._kill_leftovers()
        if was:
            self.ha.d.note("node stopped", node=self.name)

    def kill(self) -> None:
        """A host loss: SIGKILL to Patroni, PostgreSQL and its backends, the follower and the sidecar, at once."""
        self.wanted = False
        roots = [c.pid for c in (self.patroni, self.follower) if c is not None and c.running and c.pid]
        postmaster = self.postmaster_pid()
        pids = process_tree(roots + ([postmaster] if postmaster else []))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for child in (self.patroni, self.follower):
            if child is not None:
                child.kill()  # reaps it
        self.ha.d.note("node killed", node=self.name, pids=pids)

    def lose_patroni(self, sig: int = signal.SIGKILL) -> None:
        """Only Patroni gets `sig`: SIGKILL as a crashed Patroni, SIGSTOP as a stuck one. Its PostgreSQL (started
        in a session of its own, not Patroni's child), the backends and the follower with its sidecar go on, so a
        leader keeps taking writes while its key expires and the other node's gate fences it (docs/ha.md). `kill`
        then ends what is left, as after a host loss."""
        self.wanted = False  # its Patroni is gone on purpose: wait_leader must not take that for a failure
        if self.patroni is not None and self.patroni.running:
            self.patroni.send_signal(sig)
        self.ha.d.note("node's Patroni lost; its PostgreSQL and sidecar run on", node=self.name,
                       signal=signal.Signals(sig).name, patroni_pid=self.patroni.pid if self.patroni else None,
                       postmaster_pid=self.postmaster_pid())

    def close(self) -> None:
        self.stop(timeout=30)

    def postmaster_pid(self) -> int | None:
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split()[0])
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError, IndexError):
            return None

    def _kill_leftovers(self) -> None:
        """A PostgreSQL still running once Patroni is gone (Patroni was killed before): stopped immediately."""
        pid = self.postmaster_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGQUIT)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + 30
            while self.postmaster_pid() == pid and time.monotonic() < deadline:
                time.sleep(0.1)

    def streaming_problem(self) -> str | None:
        return None


class _NoPrimary:
    """LocalDeployment's primary slot, unused: under Patroni the primary is whichever node leads."""

    port = 0
    data_dir = Path("/nonexistent")

    def start(self, timeout: float = 60) -> None: ...

    def stop(self, mode: str = "fast", timeout: float = 60) -> None: ...

    def crash(self) -> None: ...

    def is_running(self) -> bool:
        return False

    def teardown(self) -> None: ...

    def dsn(self, dbname: str = "postgres", user: str = "postgres", **params: str) -> str:
        return ""


class HaDeployment:
    """etcd, the safekeepers (a LocalDeployment without primary or proposer) and the nodes, by name."""

    def __init__(self, base: Path, *, sk_ports: Sequence[int] | None = None, pg_ports: Sequence[int] | None = None,
                 insecure: bool = False,
                 link_security: str = "tls", log_format: str = "plain", log: Any = None) -> None:
        self.base = base.absolute()
        self.archive = f"file://{self.base}/archive"
        self.d = LocalDeployment(self.base, safekeepers=3, proposer=False, primary=_NoPrimary(),  # type: ignore
                                 sk_ports=sk_ports, insecure=insecure, link_security=link_security,
                                 log_format=log_format, log=log, spawn=start_tied_child, peers=True,
                                 extra={f"safekeeper{i}": ["--archive", self.archive] for i in range(1, 4)})
        del self.d.members["primary"]
        self.password = self._password()
        self.etcd = Etcd(self.d)
        self.nodes = [Node(self, name, pg_ports[i] if pg_ports else None) for i, name in enumerate(NODES)]
        # Started in this order, stopped in the reverse.
        self.members: dict[str, Member] = {"etcd": self.etcd, **{k: v for k, v in self.d.members.items()},
                                           **{n.name: n for n in self.nodes}}

    def _password(self) -> str:
        path = self.base / "postgres.password"
        if not path.exists():
            self.base.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(18) + "\n")
        return path.read_text().strip()

    def leader_dsn(self) -> str:
        """Whichever node leads: libpq tries each and keeps the one that takes writes."""
        return (f"host={','.join(LOOPBACK_HOST for _ in self.nodes)} "
                f"port={','.join(str(n.pg_port) for n in self.nodes)} user=postgres dbname=postgres "
                "target_session_attrs=read-write")

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start_all(self, timeout: float = 120) -> None:
        self.etcd.start()
        deadline = time.monotonic() + timeout
        while not self.etcd.healthy():
            if not self.etcd.running:
                raise DeploymentError(f"etcd exited; see {self.etcd.log_path}")
            if time.monotonic() > deadline:
                raise DeploymentError(f"etcd did not answer within {timeout:g}s; see {self.etcd.log_path}")
            time.sleep(0.1)
        for m in self.d.members.values():
            m.start()
        self.d._wait_terms_learned(timeout)
        # node1 first: it bootstraps the cluster (initdb) and takes the leader key; node2 clones it.
        self.nodes[0].start()
        self.wait_leader(timeout)
        for n in self.nodes[1:]:
            n.start()

    def leader(self) -> Node | None:
        """The node whose Patroni says it is the running primary."""
        for n in self.nodes:
            st = n.patroni_state() if n.running else None
            if st and st.get("role") in ("primary", "master") and st.get("state") == "running":
                return n
        return None

    def wait_leader(self, timeout: float) -> Node:
        deadline = time.monotonic() + timeout
        while (n := self.leader()) is None:
            for node in self.nodes:
                if node.wanted and not node.running:
                    raise DeploymentError(f"{node.name}'s Patroni exited; see {node.log_path}")
            if time.monotonic() > deadline:
                raise DeploymentError(f"no node became the leader within {timeout:g}s; see "
                                      + ", ".join(str(n.log_path) for n in self.nodes))
            time.sleep(0.2)
        return n

    def stop_all(self) -> None:
        for m in reversed(list(self.members.values())):
            try:
                m.close()
            except Exception as e:  # cleanup goes on: the other members must stop too
                if self.d._log is not None:
                    self.d._log.error("stopping a member failed", member=m.name, error=str(e))


class EmbeddedHa:
    """Supervise `up --ha` until SIGINT/SIGTERM, answering `walsidecar ctl` on DIR/up.sock; then stop it all."""

    def __init__(self, base_dir: Path, pg_port: int, sk_port: int, log_format: str = "plain",
                 insecure: bool = False, link_security: str = "tls") -> None:
        from sidecar.logs import get_logger
        self.base = base_dir.absolute()
        self.log = get_logger(role="up")
        self.ports = [(pg_port + i, f"{name}'s PostgreSQL", "--pg-port (node1's; node2 takes the next)")
                      for i, name in enumerate(NODES)]
        self.ports += [(sk_port + i, f"safekeeper{i + 1}", "--safekeeper-port (the first of 3 consecutive ports)")
                       for i in range(3)]
        self.ha = HaDeployment(self.base, sk_ports=[sk_port + i for i in range(3)],
                               pg_ports=[pg_port + i for i in range(len(NODES))], insecure=insecure,
                               link_security=link_security, log_format=log_format, log=self.log)

    def run(self) -> None:
        from sidecar.config import UP_CONFIG
        from sidecar.ctl import ControlSocket, answer
        from sidecar.embedded import _lock_dir, _stop_on_signals, check_free
        from sidecar.supervisor import Supervisor
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)
        lock = _lock_dir(self.base)
        control = None
        try:
            check_free(self.ports)
            (self.base / "ready").unlink(missing_ok=True)
            stop = _stop_on_signals()
            self.ha.start_all()
            leader = self.ha.wait_leader(120)
            config = self.base / UP_CONFIG
            certs = self.ha.d.certs_dir("client", "client")
            config.write_text(
                "# Written by `walsidecar up --ha`: walsidecar status --config THIS_FILE. Each node's own files\n"
                "# (patroni.yml, walsidecar.toml) are in DIR/node1 and DIR/node2.\n"
                f"pg_dsn = {_toml(self.ha.leader_dsn())}\n"
                f"safekeepers = {_toml(','.join(self.ha.d.addresses))}\n"
                f"patroni = {_toml(','.join(n.api for n in self.ha.nodes))}\n"
                + ("insecure = true\n" if certs is None else f"certs_dir = {_toml(str(certs))}\n"))
            supervisor = Supervisor(self.ha, self.log, describe=self._describe)  # type: ignore[arg-type]
            control = ControlSocket(self.base)
            (self.base / "ready").write_text(self.ha.leader_dsn() + "\n")
            self._announce(leader, config)
            while not stop():
                supervisor.tick()
                control.poll(lambda req: answer(supervisor, req), timeout=0.2)
        finally:
            if control is not None:
                control.close()
            self.ha.stop_all()
            lock.close()

    def _describe(self, name: str) -> str | None:
        member = self.ha.members.get(name)
        if not isinstance(member, Node):
            return None
        st = member.patroni_state()
        if st is None:
            return "Patroni not answering"
        role = {"master": "primary"}.get(st.get("role", "?"), st.get("role", "?"))
        return f"{role}, PostgreSQL {st.get('state', '?')}, timeline {st.get('timeline', '?')}, port {member.pg_port}"

    def _announce(self, leader: Node, config: Path) -> None:
        dirs = " ".join(str(n.dir) for n in self.ha.nodes)
        print(f"\nwalsidecar is up under Patroni: {', '.join(n.name for n in self.ha.nodes)}, leader {leader.name}; "
              "commits wait for 2 of 3 safekeepers.\n"
              f"  psql \"{self.ha.leader_dsn()}\"   (whichever node leads; "
              + ", ".join(f"{n.name} on {n.pg_port}" for n in self.ha.nodes) + ")\n"
              f"  members: walsidecar ctl --dir {self.base} members\n"
              f"  status:  walsidecar status --config {config}\n"
              f"  a host loss: walsidecar ctl --dir {self.base} kill {leader.name}   (then `ctl start {leader.name}`)\n"
              f"  recipe: {dirs} (patroni.yml, walsidecar.toml); docs/ha.md\n"
              "Press Ctrl-C to stop.\n", flush=True)
        self.log.info("walsidecar is up under Patroni", leader=leader.name, psql=leader.dsn())

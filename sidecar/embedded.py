"""`walsidecar up`: a local primary, three safekeepers and the proposer, for trying it out."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import psycopg

from sidecar.logs import get_logger
from sidecar.pgcluster import LocalCluster
from sidecar.processes import Child, tls_args

APP = "walsidecar"
SAFEKEEPERS = 3


class ChildDied(RuntimeError):
    pass


class Embedded:
    """Supervise the embedded default until SIGINT/SIGTERM, then stop everything it started."""

    def __init__(self, base_dir: Path, pg_port: int, sk_port: int, log_format: str = "plain",
                 metrics_port: int = 7610, insecure: bool = False, link_security: str = "tls") -> None:
        self.base = base_dir.absolute()
        self.insecure = insecure
        self.link_security = link_security
        self.cluster = LocalCluster(self.base / "pg", pg_port, log_file=self.base / "postgres.log")
        self.sk_addrs = [f"127.0.0.1:{sk_port + i}" for i in range(SAFEKEEPERS)]
        # Proposer first, then one per safekeeper.
        self.metrics = [f"127.0.0.1:{p}" for p in metrics_ports(metrics_port, SAFEKEEPERS + 1)]
        self.log_format = log_format
        self.children: dict[str, Child] = {}
        self.log = get_logger(role="up")

    def run(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)
        (self.base / "ready").unlink(missing_ok=True)
        stop = _stop_on_signals()
        try:
            self._start()
            dsn = self.cluster.dsn()
            config = self._write_config(dsn)
            (self.base / "ready").write_text(dsn + "\n")
            print(f"\nwalsidecar is up: commits on this primary wait for {SAFEKEEPERS // 2 + 1} of "
                  f"{SAFEKEEPERS} safekeepers.\n  psql \"{dsn}\"\n  logs: {self.base}/*.log\n"
                  f"  status:  walsidecar status --config {config}   (add --watch 2 to follow it)\n"
                  f"  check:   walsidecar check --config {config}\n"
                  f"  metrics: http://{self.metrics[0]}/metrics (proposer), "
                  + ", ".join(f"http://{m}/metrics" for m in self.metrics[1:]) + " (safekeepers)\n"
                  + ("  INSECURE: --insecure, the safekeeper links run without TLS\n" if self.insecure else
                     f"  {'auth-only (no encryption)' if self.link_security != 'tls' else 'TLS'}: CA in "
                     f"{self.base}/ca, a certificate per process in {self.base}/certs\n")
                  + "Press Ctrl-C to stop.\n", flush=True)
            while not stop():
                self._check_children()
                time.sleep(0.2)
        except ChildDied as e:
            self.log.error(str(e))
            raise SystemExit(1) from e
        finally:
            self._stop()

    def _start(self) -> None:
        if not (self.cluster.data_dir / "PG_VERSION").exists():
            self.log.info("initdb", data_dir=str(self.cluster.data_dir))
            self.cluster.init({"synchronous_standby_names": APP, "max_slot_wal_keep_size": "10GB"})
        self.cluster.start()
        for i, addr in enumerate(self.sk_addrs, start=1):
            self._spawn(f"safekeeper{i}", "safekeeper", "--id", str(i), "--listen", addr,
                        "--data-dir", str(self.base / f"safekeeper{i}"), "--metrics", self.metrics[i],
                        *self._link_args(f"safekeeper{i}", "safekeeper", i))
        self._spawn("proposer", "start", "--pg-dsn", self.cluster.dsn(), "--safekeepers", ",".join(self.sk_addrs),
                    "--application-name", APP, "--metrics", self.metrics[0], *self._link_args("proposer"))
        self._wait_sync()

    def _link_args(self, name: str, role: str = "proposer", node_id: int | None = None) -> list[str]:
        auth_only = [] if self.link_security == "tls" else ["--link-security", self.link_security]
        return tls_args(self._certs(name, role, node_id)) + auth_only

    def _certs(self, name: str, role: str = "proposer", node_id: int | None = None) -> Path | None:
        """This process's certificates under DIR/certs, signed by DIR/ca (made once, reused); None if insecure."""
        if self.insecure:
            return None
        from sidecar.certs import ensure_node
        return ensure_node(self.base / "ca", self.base / "certs" / name, role, node_id)

    def _spawn(self, name: str, *args: str) -> None:
        # A session of its own: Ctrl-C reaches only `up`, which stops children in the right order.
        child = Child.sidecar(name, args, self.base / f"{name}.log", self.log_format).start()
        self.children[name] = child
        self.log.info("started", process=name, pid=child.pid)

    def _wait_sync(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.cluster.dsn(), autocommit=True) as conn:
            while time.monotonic() < deadline:
                self._check_children()
                row = conn.execute("SELECT sync_state FROM pg_stat_replication WHERE application_name = %s",
                                   (APP,)).fetchone()
                if row and row[0] == "sync":
                    return
                time.sleep(0.2)
        raise ChildDied(f"the proposer did not become the synchronous standby within {timeout:.0f}s; "
                        f"see {self.base}/proposer.log")

    def _check_children(self) -> None:
        for name, child in self.children.items():
            if child.returncode is not None:
                raise ChildDied(f"{name} exited with code {child.returncode}; see {self.base}/{name}.log")

    def _stop(self) -> None:
        # The primary's shutdown checkpoint waits for the sidecar, so stop it while the quorum is up.
        if self.cluster.is_running():
            self.cluster.stop()
        for name in ["proposer"] + [n for n in self.children if n != "proposer"]:
            child = self.children.get(name)
            if child is None or not child.running:
                continue
            child.stop(timeout=15)
            self.log.info("stopped", process=name, pid=child.pid)

    def _write_config(self, dsn: str) -> Path:
        """A --config file for `walsidecar status` and `walsidecar check` against this cluster."""
        path = self.base / "walsidecar.toml"
        path.write_text(
            "# Written by `walsidecar up`: walsidecar status --config THIS_FILE\n"
            f"pg_dsn = {_toml_str(dsn)}\n"
            f"safekeepers = {_toml_str(','.join(self.sk_addrs))}\n"
            f"application_name = {_toml_str(APP)}\n"
            f"proposer_metrics = {_toml_str(self.metrics[0])}\n"
            + ("insecure = true\n" if self.insecure else f"certs_dir = {_toml_str(str(self._certs('client', 'client')))}\n")
            + ("" if self.link_security == "tls" else f"link_security = {_toml_str(self.link_security)}\n"))
        return path


def metrics_ports(first: int, n: int) -> list[int]:
    """`n` consecutive ports from `first`, or `n` free ones when `first` is 0."""
    if first:
        return [first + i for i in range(n)]
    socks = []
    try:
        for _ in range(n):  # all open at once, so the ports are distinct
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _stop_on_signals():
    stopped = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return lambda: stopped

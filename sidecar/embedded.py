"""`walsidecar up`: a local primary, three safekeepers and the proposer, for trying it out."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from sidecar.deployment import APP, DeploymentError, LocalDeployment
from sidecar.logs import get_logger

SAFEKEEPERS = 3


class Embedded:
    """Supervise the embedded default until SIGINT/SIGTERM, then stop everything it started."""

    def __init__(self, base_dir: Path, pg_port: int, sk_port: int, log_format: str = "plain",
                 metrics_port: int = 7610, insecure: bool = False, link_security: str = "tls") -> None:
        self.base = base_dir.absolute()
        self.insecure = insecure
        self.link_security = link_security
        # Proposer first, then one per safekeeper.
        self.metrics = [f"127.0.0.1:{p}" for p in metrics_ports(metrics_port, SAFEKEEPERS + 1)]
        self.log = get_logger(role="up")
        self.d = LocalDeployment(
            self.base, safekeepers=SAFEKEEPERS, pg_port=pg_port, sk_ports=[sk_port + i for i in range(SAFEKEEPERS)],
            insecure=insecure, link_security=link_security, log_format=log_format, log=self.log,
            extra={"proposer": ["--metrics", self.metrics[0]],
                   **{f"safekeeper{i}": ["--metrics", self.metrics[i]] for i in range(1, SAFEKEEPERS + 1)}})

    def run(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)
        (self.base / "ready").unlink(missing_ok=True)
        stop = _stop_on_signals()
        try:
            self._start()
            dsn = self.d.dsn()
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
                self.d.check_running()
                time.sleep(0.2)
        except DeploymentError as e:
            self.log.error(str(e))
            raise SystemExit(1) from e
        finally:
            self.d.stop_all()

    def _start(self) -> None:
        pg = self.d.pg
        if not (pg.data_dir / "PG_VERSION").exists():
            self.log.info("initdb", data_dir=str(pg.data_dir))
            pg.init({"synchronous_standby_names": APP, "max_slot_wal_keep_size": "10GB"})
        self.d.start_all(timeout=120)

    def _write_config(self, dsn: str) -> Path:
        """A --config file for `walsidecar status` and `walsidecar check` against this cluster."""
        path = self.base / "walsidecar.toml"
        path.write_text(
            "# Written by `walsidecar up`: walsidecar status --config THIS_FILE\n"
            f"pg_dsn = {_toml_str(dsn)}\n"
            f"safekeepers = {_toml_str(','.join(self.d.addresses))}\n"
            f"application_name = {_toml_str(APP)}\n"
            f"proposer_metrics = {_toml_str(self.metrics[0])}\n"
            + ("insecure = true\n" if self.insecure else
               f"certs_dir = {_toml_str(str(self.d.certs_dir('client', 'client')))}\n")
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

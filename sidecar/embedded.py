"""`walsidecar up`: a local primary, three safekeepers and the proposer, for trying it out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from sidecar.logs import get_logger
from sidecar.pgcluster import LocalCluster

APP = "walsidecar"
SAFEKEEPERS = 3


class ChildDied(RuntimeError):
    pass


class Embedded:
    """Supervise the embedded default until SIGINT/SIGTERM, then stop everything it started."""

    def __init__(self, base_dir: Path, pg_port: int, sk_port: int, log_format: str = "plain") -> None:
        self.base = base_dir.absolute()
        self.cluster = LocalCluster(self.base / "pg", pg_port, log_file=self.base / "postgres.log")
        self.sk_addrs = [f"127.0.0.1:{sk_port + i}" for i in range(SAFEKEEPERS)]
        self.log_format = log_format
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.log = get_logger(role="up")

    def run(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)
        (self.base / "ready").unlink(missing_ok=True)
        stop = _stop_on_signals()
        try:
            self._start()
            dsn = self.cluster.dsn()
            (self.base / "ready").write_text(dsn + "\n")
            print(f"\nwalsidecar is up: commits on this primary wait for {SAFEKEEPERS // 2 + 1} of "
                  f"{SAFEKEEPERS} safekeepers.\n  psql \"{dsn}\"\n  logs: {self.base}/*.log\n"
                  "Press Ctrl-C to stop.\n", flush=True)
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
            self.cluster.init({"synchronous_standby_names": APP})
        self.cluster.start()
        for i, addr in enumerate(self.sk_addrs, start=1):
            self._spawn(f"safekeeper{i}", "safekeeper", "--id", str(i), "--listen", addr,
                        "--data-dir", str(self.base / f"safekeeper{i}"))
        self._spawn("proposer", "start", "--pg-dsn", self.cluster.dsn(), "--safekeepers", ",".join(self.sk_addrs),
                    "--application-name", APP)
        self._wait_sync()

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.base / f"{name}.log", "ab")
        # A session of its own: Ctrl-C reaches only `up`, which stops children in the right order.
        self.children[name] = subprocess.Popen(
            [sys.executable, "-m", "sidecar", *args, "--log-format", self.log_format],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.log.info("started", process=name, pid=self.children[name].pid)

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
        for name, proc in self.children.items():
            if proc.poll() is not None:
                raise ChildDied(f"{name} exited with code {proc.returncode}; see {self.base}/{name}.log")

    def _stop(self) -> None:
        # The primary's shutdown checkpoint waits for the sidecar, so stop it while the quorum is up.
        if self.cluster.is_running():
            self.cluster.stop()
        for name in ["proposer"] + [n for n in self.children if n != "proposer"]:
            proc = self.children.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.log.info("stopped", process=name, pid=proc.pid)


def _stop_on_signals():
    stopped = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return lambda: stopped

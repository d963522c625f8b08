"""A real etcd (Debian's etcd-server) on 127.0.0.1, free ports and a data directory of its own, stopped by PID."""

from __future__ import annotations

import signal
import ssl
import urllib.request
from pathlib import Path

from sidecar.certs import CA_CERT, NODE_CERT, NODE_KEY
from sidecar.deployment import free_port
from sidecar.processes import Child
from support.helpers import wait_for

ETCD = "/usr/bin/etcd"


class EtcdServer:
    """One etcd member. With `certs_dir` it serves https and, with `client_cert_auth`, wants a client certificate
    from that directory's CA (etcd --client-cert-auth). `restart()` keeps its ports and data."""

    def __init__(self, base: Path, certs_dir: Path | None = None, client_cert_auth: bool = False) -> None:
        self.base = base
        self.data_dir = base / "etcd-data"
        self.certs_dir = certs_dir
        self.client_cert_auth = client_cert_auth
        self.client_port, self.peer_port = free_port(), free_port()
        scheme = "https" if certs_dir is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.client_port}"
        # Dies with the test process even after a SIGKILL of pytest.
        self.child = Child("etcd", self.argv(), base / "etcd.log", parent_death_signal=signal.SIGKILL)

    def argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [ETCD, "--name", "test", "--data-dir", str(self.data_dir), "--listen-client-urls", self.url,
                "--advertise-client-urls", self.url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}", "--logger", "zap", "--log-outputs", "stderr"]
        if self.certs_dir is not None:
            argv += ["--cert-file", str(self.certs_dir / NODE_CERT), "--key-file", str(self.certs_dir / NODE_KEY),
                     "--trusted-ca-file", str(self.certs_dir / CA_CERT)]
            if self.client_cert_auth:
                argv.append("--client-cert-auth")
        return argv

    def start(self, timeout: float = 30) -> EtcdServer:
        self.child.start()
        wait_for(self.healthy, timeout=timeout, what=f"etcd at {self.url} to answer /health")
        return self

    def healthy(self) -> bool:
        if not self.child.running:
            raise RuntimeError(f"etcd exited ({self.child!r}); its log:\n{self.log_tail()}")
        ctx = None
        if self.certs_dir is not None:
            ctx = ssl.create_default_context(cafile=str(self.certs_dir / CA_CERT))
            ctx.load_cert_chain(str(self.certs_dir / NODE_CERT), str(self.certs_dir / NODE_KEY))
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2, context=ctx) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def stop(self) -> None:
        self.child.stop(timeout=10)

    def kill(self) -> None:
        self.child.kill()

    def restart(self) -> EtcdServer:
        self.stop()
        return self.start()

    def log_tail(self, lines: int = 40) -> str:
        return self.child.log_tail(lines)

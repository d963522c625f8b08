#!/usr/bin/env python3
"""A flood on the safekeepers' reader ports: the load of scripts/bench.py's pgbench-1-reader-flood workload.

What an attacker without a password and a greedy reader with one can do, each as fast as the
safekeeper answers:

* per reader port, STRANGERS connections in a loop, each an SSLRequest, the TLS handshake (when the
  port answers `S`), then by turns a garbage startup packet (an unknown protocol version: FATAL and
  the close) or a whole SCRAM exchange with a wrong password (libpq's, so FATAL 28P01);
* per reader port, READERS authenticated physical replication streams, each reading from the start
  of the WAL the safekeeper stores (the LSN bench gives) to its commit position, then again.

It runs as a process of its own, so that bench can measure the CPU it spends apart from the
safekeepers'. It prints `ready` once every stranger has been answered and every reader has made a
pass, and on SIGTERM or SIGINT stops, then prints one JSON line: what each kind did.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import socket
import ssl
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.address import Address  # noqa: E402
from sidecar.config import ReaderCredentials  # noqa: E402
from sidecar.lsn import parse_lsn  # noqa: E402
from sidecar.pgwire import SSL_REQUEST_CODE, SSL_ACCEPT  # noqa: E402
from sidecar.walclient import ReaderError, WalReader  # noqa: E402

STRANGERS = 4  # per port: under the port's 8 places for connections still authenticating, so none is dropped
READERS = 1  # per port
TIMEOUT = 10.0  # seconds for any one socket operation: the port's own authentication deadline
WRONG_PASSWORD = "not-the-password"


class Flood:
    """The strangers' and readers' threads, and what they counted."""

    def __init__(self, ports: list[tuple[Address, int]], user: str, passfile: Path, certs_dir: Path | None,
                 strangers: int, readers: int) -> None:
        self.ports = ports
        self.user, self.passfile, self.certs_dir = user, passfile, certs_dir
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.read_bytes = 0
        self.threads: list[threading.Thread] = []
        self.pending: set[str] = set()  # threads not yet answered or fed once
        # A stranger verifies nothing: it wants the server's work, not its identity.
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.tls.check_hostname = False
        self.tls.verify_mode = ssl.CERT_NONE
        for i, (address, start) in enumerate(ports):
            for j in range(strangers):
                self._thread(f"stranger-{i}-{j}", self._stranger, address, j)
            for j in range(readers):
                self._thread(f"reader-{i}-{j}", self._reader, address, start)

    def _thread(self, name: str, target: Callable[..., str], *args: Any) -> None:
        self.pending.add(name)
        self.threads.append(threading.Thread(target=self._run, args=(name, target, *args), name=name, daemon=True))

    def _run(self, name: str, target: Callable[..., str], *args: Any) -> None:
        """Repeat `target` until stopped, counting what each attempt came to (its return, or its error)."""
        while not self.stop.is_set():
            try:
                kind = target(*args)
            except (OSError, psycopg.Error, ReaderError) as e:
                first_line = (str(e).strip().splitlines() or [""])[0][:120]
                kind = f"unexpected {type(e).__name__}: {first_line}"
                self.stop.wait(0.05)  # a port that is down is not spun on
            with self.lock:
                self.counts[kind] += 1
                if not kind.startswith("unexpected"):
                    self.pending.discard(name)

    @property
    def ready(self) -> bool:
        with self.lock:
            return not self.pending

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(TIMEOUT * 2)

    # ---- strangers

    def _stranger(self, address: Address, j: int) -> str:
        """One connection of a stranger: the garbage startup or the wrong password, by turns."""
        if j % 2:
            return self._wrong_password(address)
        with socket.create_connection((address.host, address.port), timeout=TIMEOUT) as raw:
            raw.sendall(struct.pack(">II", 8, SSL_REQUEST_CODE))
            answer = raw.recv(1)
            sock: socket.socket = raw
            if answer == SSL_ACCEPT:
                sock = self.tls.wrap_socket(raw, server_hostname=address.host)
            body = struct.pack(">I", random.randrange(4 << 16, 1 << 31)) + os.urandom(random.randrange(8, 500))
            sock.sendall(struct.pack(">I", len(body) + 4) + body)
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
            return "garbage startup: FATAL" if reply[:1] == b"E" else "garbage startup: closed without a word"

    def _wrong_password(self, address: Address) -> str:
        dsn = make_conninfo(host=address.host, port=address.port, user=self.user, dbname="replication",
                            replication="true", password=WRONG_PASSWORD, passfile="/dev/null",
                            sslmode="prefer" if self.certs_dir is None else "require", connect_timeout=int(TIMEOUT))
        try:
            psycopg.connect(dsn).close()
        except psycopg.OperationalError as e:
            if "password authentication failed" in str(e):
                return "wrong password: refused"
            raise
        return "wrong password: logged in"

    # ---- readers

    def _reader(self, address: Address, start: int) -> str:
        """One pass: log in, read from `start` to the commit position, leave."""
        creds = ReaderCredentials(reader_user=self.user, reader_passfile=self.passfile, certs_dir=self.certs_dir,
                                  insecure=self.certs_dir is None, reader_timeout=TIMEOUT)
        with WalReader(address, creds, application_name="bench-flood-reader") as r:
            _, _, commit = r.identify()
            for _, data in r.stream(start, stop_at=commit):
                with self.lock:
                    self.read_bytes += len(data)
                if self.stop.is_set():
                    break
        return "reader pass"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    p.add_argument("--port", action="append", required=True, metavar="HOST:PORT@LSN",
                   help="a reader port and the start of the WAL it stores (repeat per safekeeper)")
    p.add_argument("--user", default="walsidecar")
    p.add_argument("--passfile", type=Path, required=True, help="the reader's libpq password file")
    p.add_argument("--certs-dir", type=Path, help="ca.crt for the readers' verify-full (none: no TLS)")
    p.add_argument("--strangers", type=int, default=STRANGERS, help="stranger connections per port")
    p.add_argument("--readers", type=int, default=READERS, help="reading streams per port")
    a = p.parse_args(argv)
    ports = []
    for spec in a.port:
        where, _, lsn = spec.partition("@")
        ports.append((Address.parse(where), parse_lsn(lsn)))
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    flood = Flood(ports, a.user, a.passfile, a.certs_dir, a.strangers, a.readers)
    t0 = time.monotonic()
    flood.start()
    said_ready = False
    while not stopping.wait(0.05):
        if not said_ready and flood.ready:
            print("ready", flush=True)
            said_ready = True
    seconds = time.monotonic() - t0
    flood.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": round(seconds, 3), "counts": dict(flood.counts), "read_bytes": flood.read_bytes,
                      "cpu_s": round(usage.ru_utime + usage.ru_stime, 3), "ports": len(ports),
                      "strangers_per_port": a.strangers, "readers_per_port": a.readers}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Mutually authenticated TLS against real `walsidecar safekeeper` processes, and the certificates behind it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.deployment import Deployment, commit_lsn_of, wait_replayed
from support.helpers import created, data_files, free_port, wait_for, walsidecar
from support.pki import TestPKI
from support.procs import ManagedProcess, ProcessTracker
from sidecar.certs import create_ca, create_node
from sidecar.consensus import codec
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Elected, Greeting, InfoReply, InfoRequest, Message, Refusal, TermEntry, VoteRequest,
)
from sidecar.tls import client_context
from support.pki import foreign_ca
from support.wire import read_frame


def start_safekeeper(procs: ProcessTracker, data_dir: Path, certs: Path, node_id: int = 1,
                     *extra: str) -> tuple[ManagedProcess, int]:
    port = free_port()
    proc = procs.start([sys.executable, "-m", "sidecar", "safekeeper", "--id", str(node_id), "--listen",
                        f"127.0.0.1:{port}", "--data-dir", str(created(data_dir, node_id)), "--certs-dir", str(certs), *extra],
                       name=f"safekeeper{node_id}")
    wait_for(lambda: "tls=True" in proc.log_text() or not proc.is_running(), timeout=30, what="the safekeeper")
    assert proc.is_running(), proc.log_text()
    return proc, port


def exchange(port: int, ctx: ssl.SSLContext | None, *msgs: Message | bytes) -> list[Message | BaseException]:
    """Send `msgs` (or hand-packed frames) one at a time on one connection; what came back for each."""
    out: list[Message | BaseException] = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            s = ctx.wrap_socket(raw, server_hostname="127.0.0.1") if ctx is not None else raw
            for m in msgs:
                s.sendall(m if isinstance(m, bytes) else codec.encode(m))
                reply = read_frame(s)
                if reply is None:
                    out.append(EOFError("closed without an answer"))
                    break
                out.append(reply)
        except (OSError, ssl.SSLError) as e:
            out.append(e)
    return out


def no_client_cert(pki: TestPKI) -> ssl.SSLContext:
    """Trusts the deployment's CA but shows no certificate of its own."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.ca_dir / "ca.crt")
    return ctx


def test_without_a_certificate_from_the_ca_nothing_is_answered(procs: ProcessTracker, test_dir: Path,
                                                               pki: TestPKI) -> None:
    sk, port = start_safekeeper(procs, test_dir / "sk", pki.certs("safekeeper", 1))
    # Plain TCP: the bytes are no TLS handshake, so no frame is ever parsed or answered.
    [plain] = exchange(port, None, InfoRequest())
    assert not isinstance(plain, Message), plain
    # TLS without a client certificate, and with one from another CA: the handshake fails.
    foreign = client_context(foreign_ca(test_dir, "proposer"))
    foreign.load_verify_locations(pki.ca_dir / "ca.crt")  # it trusts the safekeeper; the safekeeper must not trust it
    for ctx in (no_client_cert(pki), foreign):
        [got] = exchange(port, ctx, InfoRequest())
        assert isinstance(got, (ssl.SSLError, OSError, EOFError)) and not isinstance(got, Message), got
    # The deployment's own client certificate is answered.
    [info] = exchange(port, client_context(pki.certs("client")), InfoRequest())
    assert isinstance(info, InfoReply) and info.node_id == 1
    assert sk.is_running()
    assert "InfoRequest" not in sk.log_text() and "greeting" not in sk.log_text()


def test_a_proposer_refuses_a_safekeeper_it_cannot_trust(procs: ProcessTracker, test_dir: Path, pki: TestPKI) -> None:
    from sidecar.skclient import ProbeError, probe_safekeeper
    from support.helpers import run
    client = client_context(pki.certs("client"))
    cases = {
        "another CA": foreign_ca(test_dir, "safekeeper", 1),
        "not a safekeeper": pki.certs("client"),
    }
    wrong_host = test_dir / "wrong-host"
    create_node(pki.ca_dir, wrong_host, "safekeeper", 1, hosts=("sk1.example.invalid",))
    cases["address mismatch"] = wrong_host
    ports = {}
    for i, (why, certs) in enumerate(cases.items(), start=1):
        sk, ports[why] = start_safekeeper(procs, test_dir / f"sk{i}", certs)
        with pytest.raises(ProbeError, match=why if why != "another CA" else "certificate was refused"):
            run(probe_safekeeper(f"127.0.0.1:{ports[why]}", 5, client))

    # The proposer's own link: a process holding a client certificate is never used as a safekeeper.
    from support.helpers import until
    from sidecar.proposer.peers import PeerLink
    impostor = procs.started[1]
    ups: list[str] = []

    async def main() -> None:
        link = PeerLink(f"127.0.0.1:{ports['not a safekeeper']}", ups.append, lambda *_: None, lambda _: None,
                        client_context(pki.certs("proposer")))
        task = asyncio.ensure_future(link.run())
        try:
            await until(lambda: impostor.log_text().count("peer_cert=proposer") >= 2, "the link to try twice")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    run(main())
    assert ups == [], "the proposer used a peer whose certificate is not a safekeeper's"


@pytest.fixture
def streamed(deployment: Deployment) -> Iterator[Deployment]:
    """A deployment that streamed WAL, with its proposer stopped so the safekeepers' files hold still."""
    with deployment.sql() as c:
        c.execute("INSERT INTO load SELECT g, 'x' FROM generate_series(1, 100) g")
    deployment.proposer.kill9()
    yield deployment


def test_a_client_certificate_reads_but_changes_nothing(streamed: Deployment) -> None:
    d = streamed
    port = d.ports[0]
    before = data_files(d.sk_dir(1))
    assert any(name.startswith("wal/") for name in before)
    greeting = Greeting(PROTOCOL_VERSION, "intruder", 1, 1, 16 << 20, 15)
    for role, node_id in (("client", None), ("safekeeper", 2)):
        ctx = client_context(d.pki.certs(role, node_id))
        info, refused = exchange(port, ctx, InfoRequest(), greeting)
        assert isinstance(info, InfoReply) and info.term >= 1 and info.system_id != 0
        assert isinstance(refused, Refusal) and "may only ask for information" in refused.reason, refused
        # Skipping the greeting changes nothing either; each refusal closes the connection.
        for attack in (VoteRequest(info.term + 1), struct.pack(">IBQ", 9, ord("v"), 2**64 - 1),  # the codec refuses to encode it
                       Elected(info.term + 1, 0, (TermEntry(info.term + 1, 0),))):
            [got] = exchange(port, ctx, attack)
            # A term no peer may send is refused by the decoder, before the role is even asked.
            assert isinstance(got, Refusal) and ("may only ask for information" in got.reason
                                                 or "is outside" in got.reason), (attack, got)
    assert data_files(d.sk_dir(1)) == before, "a read-only certificate changed the safekeeper's files"
    assert "message refused" in d.safekeepers[1].log_text()
    # The safekeeper still serves the real proposer.
    d.start_proposer()
    d.wait_sync()
    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (101, 'after the attempts')")


def thread_names(pid: int) -> set[str]:
    names = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            names.add(Path(f"/proc/{pid}/task/{task}/comm").read_text().strip())
    return names


def test_over_tls_the_proposer_connection_is_served_by_a_thread_of_its_own(deployment: Deployment) -> None:
    d = deployment
    pid = d.safekeepers[1].pid
    assert pid is not None
    with d.sql() as c:
        commit_lsn_of(c, "INSERT INTO load VALUES (1, 'over TLS')")
    # The connection's thread (proposerport.py) does the handshake, decrypts the Appends and
    # encrypts the replies with the stdlib's blocking SSLSocket.
    wait_for(lambda: any(n.startswith("conn-1-") for n in thread_names(pid)), timeout=30,
             what="safekeeper 1's connection thread")
    with d.sql() as c:
        lsn = commit_lsn_of(c, "INSERT INTO load SELECT g, repeat('t', 200) FROM generate_series(2, 20000) g")
    wait_replayed(d, lsn, "every safekeeper to acknowledge the WAL it received in its connection thread")


def test_commands_refuse_to_start_without_certificates_or_insecure(tmp_path: Path) -> None:
    for args in (["safekeeper", "--id", "1", "--data-dir", str(tmp_path / "sk")],
                 ["start", "--pg-dsn", "host=127.0.0.1", "--safekeepers", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"],
                 ["check", "--pg-dsn", "host=127.0.0.1", "--safekeepers", "127.0.0.1:1"],
                 ["status", "--safekeepers", "127.0.0.1:1"]):
        out = walsidecar(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "walsidecar certs create-ca --ca-dir CA" in out.stderr and "--insecure" in out.stderr, out.stderr
        both = walsidecar(*args, "--insecure", "--certs-dir", str(tmp_path))
        assert both.returncode == 2 and "not both" in both.stderr, both.stderr
    assert not (tmp_path / "sk").exists()
    out = walsidecar("safekeeper", "--id", "1", "--data-dir", str(tmp_path / "sk"), "--certs-dir", str(tmp_path))
    assert out.returncode == 1 and "lacks ca.crt, node.crt, node.key" in out.stderr, out.stderr


def test_insecure_is_said_aloud(procs: ProcessTracker, test_dir: Path) -> None:
    port, metrics = free_port(), free_port()
    sk = procs.start([sys.executable, "-m", "sidecar", "safekeeper", "--id", "1", "--listen", f"127.0.0.1:{port}",
                      "--data-dir", str(test_dir / "sk"), "--metrics", f"127.0.0.1:{metrics}"],
                     env={"WALSIDECAR_INSECURE": "1"}, name="insecure")
    wait_for(lambda: "tls=False" in sk.log_text(), timeout=30, what="the safekeeper to listen")
    assert "--insecure" in sk.log_text() and "warning" in sk.log_text()
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/status", timeout=10) as resp:
        assert json.loads(resp.read())["insecure"] is True
    out = walsidecar("status", "--safekeepers", f"127.0.0.1:{port}", "--insecure")
    assert out.returncode == 0 and "INSECURE" in out.stdout, out.stdout


def test_keys_are_0600_and_nothing_is_overwritten(tmp_path: Path) -> None:
    ca, node = tmp_path / "ca", tmp_path / "node"
    old_umask = os.umask(0)  # the mode comes from os.open, not from a permissive umask
    try:
        assert walsidecar("certs", "create-ca", "--ca-dir", str(ca)).returncode == 0
        out = walsidecar("certs", "create-node", "--ca-dir", str(ca), "--certs-dir", str(node), "--role", "safekeeper",
                         "--id", "3", "--host", "sk3.internal", "--host", "10.0.0.3")
        assert out.returncode == 0, out.stderr
    finally:
        os.umask(old_umask)
    assert (ca / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (node / "node.key").stat().st_mode & 0o777 == 0o600
    cert = ssl._ssl._test_decode_cert(str(node / "node.crt"))  # type: ignore[attr-defined]
    assert (("organizationalUnitName", "safekeeper"),) in cert["subject"]
    assert (("commonName", "safekeeper-3"),) in cert["subject"]
    assert set(cert["subjectAltName"]) == {("DNS", "sk3.internal"), ("IP Address", "10.0.0.3")}
    saved = {p: p.read_bytes() for p in (ca / "ca.key", ca / "ca.crt", node / "node.key", node / "node.crt")}
    again = walsidecar("certs", "create-ca", "--ca-dir", str(ca))
    assert again.returncode == 1 and "already exist" in again.stderr and "--overwrite" in again.stderr
    again = walsidecar("certs", "create-node", "--ca-dir", str(ca), "--certs-dir", str(node), "--role", "client")
    assert again.returncode == 1 and "already exist" in again.stderr
    assert {p: p.read_bytes() for p in saved} == saved
    out = walsidecar("certs", "create-node", "--ca-dir", str(ca), "--certs-dir", str(node), "--role", "safekeeper")
    assert out.returncode == 1 and "give --id N" in out.stderr
    out = walsidecar("certs", "create-node", "--ca-dir", str(tmp_path / "none"), "--certs-dir", str(node),
                     "--role", "client")
    assert out.returncode == 1 and "walsidecar certs create-ca --ca-dir" in out.stderr
    # Reissued with --overwrite: a new key, still 0600.
    out = walsidecar("certs", "create-node", "--ca-dir", str(ca), "--certs-dir", str(node), "--role", "client",
                     "--overwrite")
    assert out.returncode == 0, out.stderr
    assert (node / "node.key").read_bytes() != saved[node / "node.key"]
    assert (node / "node.key").stat().st_mode & 0o777 == 0o600


def test_rotation_with_a_bundle_of_both_cas(procs: ProcessTracker, test_dir: Path, pki: TestPKI) -> None:
    """New CA alongside the old: bundle both, reissue, and old and new certificates both work meanwhile."""
    new_ca = test_dir / "new-ca"
    create_ca(new_ca)
    bundle = (pki.ca_dir / "ca.crt").read_bytes() + (new_ca / "ca.crt").read_bytes()
    sk_certs = test_dir / "sk-certs"
    create_node(pki.ca_dir, sk_certs, "safekeeper", 1)
    (sk_certs / "ca.crt").write_bytes(bundle)
    create_node(new_ca, sk_certs, "safekeeper", 1, overwrite=True)  # reissued by the new CA
    assert (sk_certs / "ca.crt").read_bytes() == bundle, "the bundle must survive the reissue"
    _, port = start_safekeeper(procs, test_dir / "sk", sk_certs)
    old_client = test_dir / "old-client"
    create_node(pki.ca_dir, old_client, "client")
    (old_client / "ca.crt").write_bytes(bundle)
    new_client = test_dir / "new-client"
    create_node(new_ca, new_client, "client")
    for certs in (old_client, new_client):
        [info] = exchange(port, client_context(certs), InfoRequest())
        assert isinstance(info, InfoReply), (certs, info)


@pytest.fixture
def netns() -> Iterator[str]:
    """A network namespace of its own with a non-loopback address, 10.254.0.1."""
    if os.geteuid() != 0:
        pytest.skip("needs root for ip netns")
    name = f"wsctls-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        # A veth pair with both ends inside: an address that is not loopback, reachable from nowhere else.
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                    ["ip", "addr", "add", "10.254.0.1/24", "dev", "v0"], ["ip", "link", "set", "v0", "up"],
                    ["ip", "link", "set", "v1", "up"]):
            subprocess.run(["ip", "netns", "exec", name, *cmd], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_metrics_off_loopback_are_served_over_https(procs: ProcessTracker, test_dir: Path, pki: TestPKI,
                                                    netns: str) -> None:
    certs = test_dir / "sk-certs"
    create_node(pki.ca_dir, certs, "safekeeper", 1, hosts=("10.254.0.1",))
    sk = procs.start(["ip", "netns", "exec", netns, sys.executable, "-m", "sidecar", "safekeeper", "--id", "1",
                      "--listen", "10.254.0.1:7601", "--data-dir", str(test_dir / "sk"), "--certs-dir", str(certs),
                      "--metrics", "10.254.0.1:9187"], name="safekeeper-netns")
    wait_for(lambda: "serving metrics" in sk.log_text() or not sk.is_running(), timeout=30, what="the endpoint")
    assert "url=https://10.254.0.1:9187/metrics" in sk.log_text(), sk.log_text()
    client = pki.certs("client")
    probe = ("import asyncio, json, sys, urllib.request\n"
             "from pathlib import Path\n"
             "from sidecar.ops.probe import fetch_status\n"
             "from sidecar.tls import client_context\n"
             f"doc = asyncio.run(fetch_status('10.254.0.1:9187', 10, client_context(Path('{client}'))))\n"
             "print(json.dumps(doc))\n"
             "try:\n"
             "    urllib.request.urlopen('http://10.254.0.1:9187/status', timeout=10).read()\n"
             "    print('PLAIN-HTTP-ANSWERED')\n"
             "except Exception as e:\n"
             "    print('plain http refused:', type(e).__name__)\n")
    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    doc = json.loads(lines[0])
    assert doc["id"] == 1 and doc["insecure"] is False and "data_dir" not in doc
    assert "PLAIN-HTTP-ANSWERED" not in out.stdout and "plain http refused" in out.stdout

"""`--link-security auth-only` against real `walsidecar safekeeper` processes: who gets in, and who gets nothing."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from support.deployment import APP, Deployment
from support.helpers import created, data_files, free_port, run, until, wait_for, walsidecar
from support.pki import TestPKI
from support.procs import ManagedProcess, ProcessTracker
from sidecar.certs import create_node
from sidecar.consensus import codec
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, AuthChallenge, AuthConfirm, AuthResponse, Elected, Greeting, InfoReply, InfoRequest, Message,
    Refusal, TermEntry, VoteRequest,
)
from sidecar.linkauth import dial as linkauth_dial
from sidecar.linkauth import CLIENT_CONTEXT, SERVER_CONTEXT, LinkAuth, _SIGNATURE, transcript
from sidecar.skclient import ProbeError, probe_safekeeper
from support.pki import foreign_ca
from support.wire import read_frame

AUTH_ONLY = ("--link-security", "auth-only")


def start_safekeeper(procs: ProcessTracker, data_dir: Path, certs: Path,
                     node_id: int = 1) -> tuple[ManagedProcess, int]:
    port = free_port()
    proc = procs.start([sys.executable, "-m", "sidecar", "safekeeper", "--id", str(node_id), "--listen",
                        f"127.0.0.1:{port}", "--data-dir", str(created(data_dir, node_id)), "--certs-dir", str(certs), *AUTH_ONLY],
                       name=f"safekeeper{node_id}")
    wait_for(lambda: "link_security=auth-only" in proc.log_text() or not proc.is_running(), timeout=30,
             what="the safekeeper")
    assert proc.is_running(), proc.log_text()
    return proc, port


def attempt(port: int, auth: LinkAuth | None, *msgs: Message | bytes, host: str = "127.0.0.1",
            sign: Callable[[bytes], bytes] | None = None, first: bytes | None = None) -> list[Message | None]:
    """Authenticate as `auth` (the signature made by `sign` if given; `first` bytes instead of an
    answer), then send `msgs` one at a time; what came back: the AuthConfirm, then a reply per message."""
    out: list[Message | None] = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        challenge = read_frame(s)
        assert isinstance(challenge, AuthChallenge), challenge
        try:
            if first is not None:
                s.sendall(first)
            else:
                assert auth is not None
                nonce = bytes(range(32))
                signed = CLIENT_CONTEXT + transcript(challenge.certificate, auth.cert_der, challenge.nonce, nonce,
                                                     host, port)
                sig = sign(signed) if sign else auth.key.sign(signed, _SIGNATURE)
                s.sendall(codec.encode(AuthResponse(auth.cert_der, nonce, host, sig, port)))
            out.append(read_frame(s))
            for m in msgs:
                if out[-1] is None:
                    break
                s.sendall(m if isinstance(m, bytes) else codec.encode(m))
                out.append(read_frame(s))
        except ConnectionError:
            out.append(None)
    return out


@pytest.fixture
def auth_deployment(pg_factory, procs: ProcessTracker, test_dir: Path) -> Deployment:  # type: ignore[no-untyped-def]
    """Three safekeepers and the proposer, all with --link-security auth-only, streaming."""
    pg = pg_factory(settings={"synchronous_standby_names": APP})
    d = Deployment(pg, procs, test_dir, link_security="auth-only")
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
    return d


def test_auth_only_streams_commits_and_refuses_strangers(auth_deployment: Deployment, test_dir: Path) -> None:
    d = auth_deployment
    with d.sql() as c:
        c.execute("INSERT INTO load SELECT g, 'x' FROM generate_series(1, 100) g")
    assert all("link_security=auth-only" in sk.log_text() for sk in d.safekeepers.values())
    assert "auth-only" in d.proposer.log_text() and "peer_cert=proposer" in d.safekeepers[1].log_text()
    # The tools speak it too, the mode from the environment this time.
    out = walsidecar("status", "--safekeepers", ",".join(d.addresses), "--format", "json",
                     *d.pki.args("client"), env={"WALSIDECAR_LINK_SECURITY": "auth-only"})
    assert out.returncode == 0 and out.stdout.count('"error"') == 0, (out.stdout, out.stderr)
    d.proposer.kill9()  # so that the files hold still
    port, before = d.ports[0], data_files(d.sk_dir(1))
    assert any(name.startswith("wal/") for name in before)

    greeting = Greeting(PROTOCOL_VERSION, "intruder", 1, 1, 16 << 20, 15)
    erase = Elected(2**40, 0, (TermEntry(2**40, 0),))
    proposer = LinkAuth(d.pki.certs("proposer"))
    stranger = ec.generate_private_key(ec.SECP256R1())
    hostile = {
        "a certificate from another CA": dict(auth=LinkAuth(foreign_ca(test_dir, "proposer"))),
        "a proposer certificate, signed by another key": dict(
            auth=proposer, sign=lambda t: stranger.sign(t, _SIGNATURE)),
        "a proposer certificate, signature for another host": dict(
            auth=proposer, sign=lambda t: proposer.key.sign(t.replace(b"127.0.0.1", b"10.9.9.9"), _SIGNATURE)),
        "a proposer certificate, dialled as a host the safekeeper is not": dict(auth=proposer, host="10.9.9.9"),
        "garbage": dict(auth=None, first=b"\x16\x03\x01\x02\x00" + bytes(600)),
        "an InfoRequest instead of an answer": dict(auth=None, first=codec.encode(InfoRequest())),
        "a greeting instead of an answer": dict(auth=None, first=codec.encode(greeting)),
        "a 16 MiB frame": dict(auth=None, first=struct.pack(">IB", 16 << 20, ord("a")) + bytes(60_000)),
    }
    for why, how in hostile.items():
        got = attempt(port, how.pop("auth"), InfoRequest(), greeting, VoteRequest(2**40), erase, **how)
        assert got == [None], (why, got)  # not even an AuthConfirm: nothing answered, nothing read
    assert d.safekeepers[1].log_text().count("authentication failed") >= len(hostile)

    # A read-only client certificate: information, never a vote or an Elected.
    client = LinkAuth(d.pki.certs("client"))
    confirm, info, refused = attempt(port, client, InfoRequest(), greeting)
    assert isinstance(confirm, AuthConfirm) and isinstance(info, InfoReply) and info.term >= 1
    assert isinstance(refused, Refusal) and "may only ask for information" in refused.reason, refused
    for attack in (VoteRequest(info.term + 1), Elected(info.term + 1, 0, (TermEntry(info.term + 1, 0),))):
        confirm, got = attempt(port, client, attack)
        assert isinstance(got, Refusal) and "may only ask for information" in got.reason, (attack, got)

    assert data_files(d.sk_dir(1)) == before, "an unauthenticated or read-only peer changed the safekeeper's files"
    assert d.safekeepers[1].is_running()
    d.start_proposer()
    d.wait_sync()
    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (101, 'after the attempts')")


class Impostor:
    """A listener that answers the challenge-response with `certs` and a signature made by `sign`."""

    def __init__(self, certs: Path, sign: Callable[[LinkAuth, bytes], bytes] | None = None) -> None:
        self.auth = LinkAuth(certs)
        self.sign = sign or (lambda a, t: a.key.sign(t, _SIGNATURE))
        self.port = free_port()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonce = bytes(32)
        writer.write(codec.encode(AuthChallenge(nonce, self.auth.cert_der)))
        with contextlib.suppress(Exception):
            head = await reader.readexactly(4)
            body = await reader.readexactly(struct.unpack(">I", head)[0])
            resp = codec.decode(body[0], body[1:])
            assert isinstance(resp, AuthResponse)
            proof = self.sign(self.auth, SERVER_CONTEXT + transcript(self.auth.cert_der, resp.certificate, nonce,
                                                                     resp.nonce, resp.host, resp.port))
            writer.write(codec.encode(AuthConfirm(self.auth.cert_der, proof)))
            await reader.read()  # whatever the dialler sends next
        writer.close()

    @contextlib.asynccontextmanager
    async def running(self):  # type: ignore[no-untyped-def]
        server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        async with server:
            yield self


def test_the_dialler_refuses_a_peer_that_is_not_the_safekeeper_it_dialled(procs: ProcessTracker, test_dir: Path,
                                                                         pki: TestPKI) -> None:
    client = LinkAuth(pki.certs("client"))
    wrong_host = test_dir / "wrong-host"
    create_node(pki.ca_dir, wrong_host, "safekeeper", 1, hosts=("sk1.example.invalid",))
    other = ec.generate_private_key(ec.SECP256R1())
    impostors = {
        "does not name 127.0.0.1": Impostor(wrong_host),
        "signature does not match": Impostor(pki.certs("safekeeper", 1), lambda a, t: other.sign(t, _SIGNATURE)),
        "not signed by a CA": Impostor(foreign_ca(test_dir, "safekeeper", 1)),
        "not a safekeeper's": Impostor(pki.certs("client")),
    }

    async def probes() -> None:
        for why, impostor in impostors.items():
            async with impostor.running():
                with pytest.raises(ProbeError, match=why):
                    await probe_safekeeper(f"127.0.0.1:{impostor.port}", 5, client)
    run(probes())
    # And a real safekeeper process whose certificate is a client's.
    sk, port = start_safekeeper(procs, test_dir / "sk", pki.certs("client"))
    with pytest.raises(ProbeError, match="not a safekeeper's"):
        run(probe_safekeeper(f"127.0.0.1:{port}", 5, client))

    # The proposer's own link never comes up to any of them.
    from sidecar.proposer.peers import PeerLink
    ups: list[str] = []

    async def links() -> None:
        for why, impostor in list(impostors.items())[:2]:
            async with impostor.running():
                link = PeerLink(f"127.0.0.1:{impostor.port}", ups.append, lambda *_: None, lambda _: None,
                                LinkAuth(pki.certs("proposer")))
                task = asyncio.ensure_future(link.run())
                try:
                    await until(lambda: link._last_tls_error is not None and why in link._last_tls_error,
                                f"the link to refuse: {why}")
                finally:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        link = PeerLink(f"127.0.0.1:{port}", ups.append, lambda *_: None, lambda _: None,
                        LinkAuth(pki.certs("proposer")))
        task = asyncio.ensure_future(link.run())
        try:
            await until(lambda: sk.log_text().count("peer_cert=proposer") >= 2, "the link to try twice")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    run(links())
    assert ups == [], "the proposer used a peer it could not trust"


def test_auth_only_needs_certificates(tmp_path: Path) -> None:
    out = walsidecar("safekeeper", "--id", "1", "--data-dir", str(tmp_path / "sk"), "--insecure", *AUTH_ONLY)
    assert out.returncode == 2 and "cannot be combined with --insecure" in out.stderr, out.stderr
    out = walsidecar("check", "--pg-dsn", "host=127.0.0.1", "--safekeepers", "127.0.0.1:1", "--insecure",
                     env={"WALSIDECAR_LINK_SECURITY": "auth-only"})
    assert out.returncode == 2 and "WALSIDECAR_LINK_SECURITY" in out.stderr, out.stderr
    out = walsidecar("safekeeper", "--id", "1", "--data-dir", str(tmp_path / "sk"), "--certs-dir", str(tmp_path),
                     *AUTH_ONLY)
    assert out.returncode == 1 and "lacks ca.crt, node.crt, node.key" in out.stderr, out.stderr


def test_the_mode_comes_from_toml_too(tmp_path: Path) -> None:
    from sidecar.config import CheckSettings, ConfigError, StartSettings, load
    conf = tmp_path / "w.toml"
    conf.write_text(f'certs_dir = "{tmp_path}"\nlink_security = "auth-only"\n[check]\nlink_security = "tls"\n')
    start = load(StartSettings, {"pg_dsn": "host=x", "safekeepers": "a:1"}, conf)
    check = load(CheckSettings, {"pg_dsn": "host=x", "safekeepers": "a:1"}, conf)
    assert (start.link_security, check.link_security) == ("auth-only", "tls")  # type: ignore[attr-defined]
    conf.write_text('insecure = true\nlink_security = "auth-only"\n')
    with pytest.raises(ConfigError, match=f"link_security in {conf}.*cannot be combined with insecure in {conf}"):
        load(StartSettings, {"pg_dsn": "host=x", "safekeepers": "a:1"}, conf)
    conf.write_text(f'certs_dir = "{tmp_path}"\nlink_security = "plaintext"\n')
    with pytest.raises(ConfigError, match="link_security"):
        load(StartSettings, {"pg_dsn": "host=x", "safekeepers": "a:1"}, conf)


def test_a_relay_holding_no_key_gets_nothing(procs: ProcessTracker, test_dir: Path, pki: TestPKI) -> None:
    """The audit's E8: whoever answers at one safekeeper's address passes the proposer's proof on to
    another safekeeper whose certificate names the same host, and keeps that connection for itself."""
    sk2, port2 = start_safekeeper(procs, test_dir / "sk2", pki.certs("safekeeper", 2), node_id=2)
    relay_port = free_port()
    seen: dict[str, Message | None] = {}

    async def frame(r: asyncio.StreamReader) -> bytes:
        head = await r.readexactly(4)
        return head + await r.readexactly(struct.unpack(">I", head)[0])

    async def relay(pr: asyncio.StreamReader, pw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", port2)
        try:
            pw.write(await frame(sr))  # safekeeper 2's challenge
            sw.write(await frame(pr))  # the proposer's proof, made for the relay's address
            confirm = await frame(sr)
            seen["confirm"] = codec.decode(confirm[4], confirm[5:])
            pw.write(confirm)
            sw.write(codec.encode(VoteRequest(1000)))  # the link, now the relay's own
            reply = await frame(sr)
            seen["vote"] = codec.decode(reply[4], reply[5:])
        except (asyncio.IncompleteReadError, ConnectionError):
            seen.setdefault("confirm", None)
        finally:
            sw.close()
            pw.close()

    async def dial() -> BaseException | None:
        server = await asyncio.start_server(relay, "127.0.0.1", relay_port)
        async with server:
            try:
                _, w, _ = await linkauth_dial("127.0.0.1", relay_port, LinkAuth(pki.certs("proposer")))
            except OSError as e:
                return e
            w.close()
            return None

    refused = run(dial())
    assert seen.get("confirm") is None and "vote" not in seen, seen
    assert isinstance(refused, OSError), "the proposer believed the relay was a safekeeper"
    wait_for(lambda: "authentication failed" in sk2.log_text(), timeout=10, what="safekeeper 2's refusal")
    assert f"dialled port {relay_port}" in sk2.log_text(), sk2.log_text()
    assert "granted=" not in sk2.log_text() and "peer_cert=proposer" not in sk2.log_text()

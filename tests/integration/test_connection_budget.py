"""The consensus port's places against real `walsidecar safekeeper` processes (audit M-1, E9; audit-2 M-5,
E21): connections count from accept, silent ones cannot keep the proposer out or exhaust descriptors, the
descriptor limit is raised at start or the safekeeper refuses to start, and read-only clients cannot take
the proposer's places."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import sys
from pathlib import Path

import pytest

from sidecar import tls
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, Greeting, GreetingReply, InfoReply, InfoRequest, Message,
    TermEntry, VoteReply, VoteRequest,
)
from sidecar.consensus import codec
from sidecar.linkauth import LinkAuth, dial
from sidecar.safekeeper.budget import MAX_CONNECTIONS
from sidecar.safekeeper.server import IDLE_TIMEOUT
from support.deployment import Deployment, start_commit
from support.helpers import created, free_port, run, wait_for
from support.pki import TestPKI
from support.procs import ManagedProcess, ProcessTracker
from support.walbuilder import WalBuilder
from support.wire import read_frame

SEG, SYSID = 1 << 20, 7300000000000000001
SILENT = 128


def start(procs: ProcessTracker, test_dir: Path, pki: TestPKI, nofile: str) -> tuple[ManagedProcess, int]:
    """An auth-only safekeeper under `prlimit --nofile=<nofile>` (soft:hard)."""
    port = free_port()
    proc = procs.start(["prlimit", f"--nofile={nofile}", "--", sys.executable, "-m", "sidecar", "safekeeper",
                        "--id", "1", "--listen", f"127.0.0.1:{port}", "--data-dir", str(created(test_dir / "sk", 1)),
                        "--certs-dir", str(pki.certs("safekeeper", 1)), "--link-security", "auth-only"],
                       name="safekeeper1")
    wait_for(lambda: "link_security=auth-only" in proc.log_text() or not proc.is_running(), timeout=30,
             what="the safekeeper to listen or exit")
    return proc, port


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.usefixtures("needs_prlimit")
def test_silent_connections_neither_keep_the_proposer_out_nor_stop_the_safekeeper(
        procs: ProcessTracker, test_dir: Path, pki: TestPKI) -> None:
    # E9: a soft limit of 64, as a shell or container may give; the hard limit allows more.
    sk, port = start(procs, test_dir, pki, "64:4096")
    assert sk.is_running(), sk.log_text()
    proposer = LinkAuth(pki.certs("proposer"))
    wal = WalBuilder(SEG, seg_size=SEG, sysid=SYSID)
    wal.fill_to(2 * SEG + 100_000)
    data = wal.bytes()
    first_segment_end = SEG + (SEG - 64 * 1024)  # stays within the first segment

    async def scenario() -> tuple[Message, Message]:
        r, w, _ = await dial("127.0.0.1", port, proposer)

        async def ask(m: Message, reader=r, writer=w) -> Message:  # type: ignore[no-untyped-def]
            writer.write(codec.encode(m))
            return await asyncio.wait_for(reader.read_message(), 30)

        assert isinstance(await ask(Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15)), GreetingReply)
        assert isinstance(await ask(VoteRequest(1)), VoteReply)
        await ask(Elected(1, SEG, (TermEntry(1, SEG),)))
        pos = SEG
        while pos < first_segment_end:
            piece = data[pos - SEG:min(pos - SEG + 128 * 1024, first_segment_end - SEG)]
            await ask(Append(1, pos, 0, 0, piece))
            pos += len(piece)

        # Whoever reaches the port opens connections and says nothing.
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(SILENT)]
        try:
            # Each accepted: either it holds a descriptor (up to the limit) or it was dropped for a newer one.
            wait_for(lambda: _descriptors(sk.pid) >= 64
                     or sk.log_text().count("dropping the oldest") >= SILENT - 16,
                     timeout=60, what="the safekeeper to accept the silent connections")
            # An Append that begins the next segment needs a descriptor of its own.
            reply = await ask(Append(1, pos, 0, 0, data[pos - SEG:2 * SEG + 64 * 1024 - SEG]))
            # And the proposer, reconnecting as after a blip, gets its place.
            r2, w2, _ = await dial("127.0.0.1", port, proposer)
            again = await ask(Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15), r2, w2)
            w2.close()
        finally:
            for s in silent:
                s.close()
        w.close()
        return reply, again

    reply, again = run(scenario())
    assert isinstance(reply, AppendReply), reply
    assert isinstance(again, GreetingReply), again
    assert sk.is_running(), sk.log_text()
    log = sk.log_text()
    assert "file descriptor limit raised" in log and "soft_limit_was=64" in log, log
    assert "fatal error" not in log and "Too many open files" not in log, log
    marker = test_dir / "sk" / "wal.in-doubt"  # zeros unless WAL was marked in doubt
    assert not marker.exists() or not marker.read_bytes().strip(b"\0"), marker.read_bytes()


@pytest.mark.usefixtures("needs_prlimit")
def test_a_hard_descriptor_limit_below_the_connection_limits_refuses_to_start(
        procs: ProcessTracker, test_dir: Path, pki: TestPKI) -> None:
    sk, _ = start(procs, test_dir, pki, "64")
    wait_for(lambda: not sk.is_running(), timeout=30, what="the safekeeper to exit")
    assert sk.returncode != 0
    assert "file descriptor limit (RLIMIT_NOFILE) is 64" in sk.log_text(), sk.log_text()


@pytest.fixture
def needs_prlimit() -> None:
    if not Path("/usr/bin/prlimit").exists():
        pytest.skip("util-linux prlimit is not installed")


# ---- audit-2 M-5: read-only clients leave the proposer its places --------------------------------------


def info_client(port: int, context: ssl.SSLContext) -> ssl.SSLSocket | None:
    """A connection with the client certificate that got its InfoRequest answered; None if the safekeeper
    refused or closed it instead."""
    s = None
    try:
        s = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30),
                                server_hostname=tls.server_hostname("127.0.0.1"))
        if answers(s):
            return s
    except OSError:  # ssl.SSLError included: refused during or right after the handshake
        pass
    if s is not None:
        s.close()
    return None


def answers(s: ssl.SSLSocket) -> bool:
    try:
        s.sendall(codec.encode(InfoRequest()))
        return isinstance(read_frame(s), InfoReply)
    except OSError:
        return False


def proposer_closes(d: Deployment, i: int) -> int:
    """How many times safekeeper i logged a proposer's connection ending."""
    return sum(1 for line in d.log_path(f"safekeeper{i}").read_text().splitlines()
               if "connection closed" in line and "role=proposer" in line)


def test_client_certificates_holding_every_place_they_may_leave_the_proposer_its_own(
        deployment: Deployment, pki: TestPKI) -> None:
    d = deployment
    client = tls.client_context(pki.certs("client"))
    quorum = (1, 2)  # without these two, no commit is acknowledged
    terms = {i: d.term(i) for i in quorum}
    closes = {i: proposer_closes(d, i) for i in quorum}
    # The sidecar restarts, as after a blip; its places on the safekeepers are free once they saw it go.
    d.stop("proposer")
    wait_for(lambda: all(proposer_closes(d, i) > closes[i] for i in quorum), timeout=30,
             what="safekeepers 1 and 2 to see the proposer's connection end")
    held: dict[int, list[ssl.SSLSocket]] = {i: [] for i in quorum}
    turned_away = dict.fromkeys(quorum, 0)
    try:
        for i in quorum:
            # A stolen client key takes every place the safekeeper lets it have, and tries for more.
            for _ in range(MAX_CONNECTIONS + 8):
                s = info_client(d.ports[i - 1], client)
                if s is None:
                    turned_away[i] += 1
                else:
                    held[i].append(s)
        d.start("proposer")
        _, result = start_commit(d.pg.dsn(), "INSERT INTO load VALUES (1, 'past the crowd')")
        # Within IDLE_TIMEOUT of the clients' InfoRequests, so their places cannot have been freed by
        # their idleness: only places kept for the proposer can let it in.
        wait_for(lambda: result, timeout=IDLE_TIMEOUT - 15,
                 what="a commit acknowledged while client certificates hold every place they may have")
        still = {i: sum(answers(s) for s in held[i]) for i in quorum}
    finally:
        for i in quorum:
            for s in held[i]:
                s.close()
    assert result.get("done"), result
    for i in quorum:
        assert d.term(i) > terms[i], f"safekeeper {i} voted in no new term"
        assert held[i] and turned_away[i] > 0, (len(held[i]), turned_away[i])
        assert still[i] == len(held[i]), f"safekeeper {i} closed {len(held[i]) - still[i]} clients' connections"
        assert "connection limit for this role reached" in d.log_path(f"safekeeper{i}").read_text()

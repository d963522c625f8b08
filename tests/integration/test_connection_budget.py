"""The consensus port's places against a real `walsidecar safekeeper` process (audit M-1, E9): connections
count from accept, silent ones cannot keep the proposer out or exhaust descriptors, and the descriptor
limit is raised at start or the safekeeper refuses to start."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest

from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, Greeting, GreetingReply, Message, TermEntry, VoteReply, VoteRequest,
)
from sidecar.consensus import codec
from sidecar.linkauth import LinkAuth, dial
from support.helpers import created, free_port, run, wait_for
from support.pki import TestPKI
from support.procs import ManagedProcess, ProcessTracker
from support.walbuilder import WalBuilder

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


def test_a_hard_descriptor_limit_below_the_connection_limits_refuses_to_start(
        procs: ProcessTracker, test_dir: Path, pki: TestPKI) -> None:
    sk, _ = start(procs, test_dir, pki, "64")
    wait_for(lambda: not sk.is_running(), timeout=30, what="the safekeeper to exit")
    assert sk.returncode != 0
    assert "file descriptor limit (RLIMIT_NOFILE) is 64" in sk.log_text(), sk.log_text()


@pytest.fixture(autouse=True)
def _needs_prlimit() -> None:
    if not Path("/usr/bin/prlimit").exists():
        pytest.skip("util-linux prlimit is not installed")

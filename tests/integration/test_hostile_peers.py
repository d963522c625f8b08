"""The audit's hostile sequences against a real `walsidecar safekeeper` process.

Each attack is refused, leaves the control file and every segment file byte for byte as they
were, and the legitimate proposer keeps working. The peers here speak the wire protocol over
plain blocking sockets; hostile frames are packed by hand, since the codec refuses to encode them.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.helpers import created, data_files, free_port, peak_rss, wait_for
from support.procs import ManagedProcess, ProcessTracker
from sidecar.consensus import codec, limits
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, ElectedReply, Greeting, GreetingReply, InfoReply,
    InfoRequest, TermEntry, VoteReply, VoteRequest,
)
from support.walbuilder import DEFAULT_SYSID, WalBuilder
from support.wire import Peer

SEG = 1 << 20
START = SEG
GREETING = Greeting(PROTOCOL_VERSION, "legit", DEFAULT_SYSID, 1, SEG, 15)
ROGUE_GREETING = Greeting(PROTOCOL_VERSION, "rogue", DEFAULT_SYSID, 1, SEG, 15)


def _extra_flags() -> list[str]:
    """`--insecure` where the CLI asks for an explicit choice about certificates."""
    out = subprocess.run([sys.executable, "-m", "sidecar", "safekeeper", "--help"], capture_output=True,
                         text=True, timeout=60).stdout
    return ["--insecure"] if "--insecure" in out else []


def frame(tag: str, body: bytes) -> bytes:
    return struct.pack(">IB", len(body) + 1, ord(tag)) + body


def raw_vote(term: int) -> bytes:
    return frame("v", struct.pack(">Q", term))


def raw_elected(term: int, start: int, history: list[tuple[int, int]]) -> bytes:
    # term, start, timeline 1, the term history, an empty timeline history, then no fence (as since protocol version 3)
    return frame("e", struct.pack(">QQII", term, start, 1, len(history))
                 + b"".join(struct.pack(">QQ", *e) for e in history) + struct.pack(">I", 0)
                 + struct.pack(">QIQ", 0, 0, 0))


@dataclass
class Target:
    proc: ManagedProcess
    port: int
    data_dir: Path
    legit: Peer
    wal: WalBuilder
    term: int = 1
    end: int = START  # WAL sent and acknowledged


    def stream(self, records: int) -> None:
        """The legitimate proposer sends more WAL and a heartbeat; all of it is acknowledged."""
        begin = self.end
        for _ in range(records):
            self.wal.add(3000)
        data = bytes(self.wal.buf[begin - START:])
        for off in range(0, len(data), 200_000):
            self.legit.send(Append(self.term, begin + off, begin, 0, data[off:off + 200_000]))
        self.end = self.wal.end
        self.heartbeat()

    def heartbeat(self) -> None:
        """A heartbeat carrying commit = end: replies in our term, until one says flush = commit = end."""
        self.legit.send(Append(self.term, self.end, self.end, 0, b""))
        while True:
            got = self.legit.recv()
            assert isinstance(got, AppendReply) and got.term == self.term, got
            assert got.flush_lsn <= self.end
            if got.commit_lsn == got.flush_lsn == self.end:
                return

    def elect(self, term: int) -> None:
        """A legitimate proposer takes `term` on a new connection, continuing the WAL it has."""
        history = [(1, START)] if term == 1 else [(1, START), (term, self.end)]
        self.legit.close()
        self.legit = Peer(self.port)
        assert isinstance(self.legit.ask(GREETING), GreetingReply)
        vote = self.legit.ask(VoteRequest(term))
        assert isinstance(vote, VoteReply) and vote.granted and vote.flush_lsn == (self.end if term > 1 else 0)
        start = history[-1][1]
        got = self.legit.ask(Elected(term, start, tuple(TermEntry(*e) for e in history)))
        assert got == ElectedReply(term, self.end if term > 1 else START), got
        self.term = term


@pytest.fixture
def target(procs: ProcessTracker, test_dir: Path) -> Iterator[Target]:
    """A safekeeper holding 1.3 segments of WAL, committed, with the elected proposer connected."""
    port, data_dir = free_port(), test_dir / "sk1"
    proc = procs.start([sys.executable, "-m", "sidecar", "safekeeper", "--id", "1", "--listen", f"127.0.0.1:{port}",
                        "--data-dir", str(created(data_dir, 1)), *_extra_flags()], name="safekeeper1")
    wait_for(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() or True,
             what="the safekeeper to listen", ignore=(OSError,))
    t = Target(proc, port, data_dir, Peer(port), WalBuilder(START, seg_size=SEG))
    t.elect(1)
    t.stream(450)
    assert t.end > START + SEG
    yield t
    t.legit.close()
    assert proc.is_running(), "the safekeeper died"
    log = proc.log_text()
    assert "Traceback" not in log and "never retrieved" not in log


def test_erasing_wal_with_an_elected_below_commit_is_refused(target: Target) -> None:
    # DL-1: InfoRequest, Greeting, VoteRequest(term+1), Elected(term+1, 0, [(term+1, 0)]).
    rogue = Peer(target.port)
    info = rogue.ask(InfoRequest())
    assert isinstance(info, InfoReply) and info.system_id == DEFAULT_SYSID and info.commit_lsn == target.end
    assert isinstance(rogue.ask(ROGUE_GREETING), GreetingReply)
    vote = rogue.ask(VoteRequest(info.term + 1))  # a vote cannot be told from a real one without a certificate
    assert isinstance(vote, VoteReply) and vote.granted
    before = data_files(target.data_dir)
    reason = rogue.refused(raw_elected(info.term + 1, 0, [(info.term + 1, 0)]), "below the commit position")
    assert "0/0" in reason and f"{target.end >> 32:X}/{target.end & 0xFFFFFFFF:X}" in reason
    assert data_files(target.data_dir) == before
    # The real proposer was fenced by the vote; it is elected again and goes on from its WAL.
    target.elect(info.term + 2)
    target.stream(20)


def test_appending_in_the_elected_term_from_another_connection_is_refused(target: Target) -> None:
    # DL-2: the hijacker's bytes are not written, and the proposer gets no acknowledgement for them.
    before = data_files(target.data_dir)
    rogue = Peer(target.port)
    assert isinstance(rogue.ask(ROGUE_GREETING), GreetingReply)
    rogue.refused(Append(1, target.end, 0, 0, b"\xAA" * 4096), "does not hold the term")
    rogue = Peer(target.port)
    assert isinstance(rogue.ask(ROGUE_GREETING), GreetingReply)
    rogue.refused(Elected(1, START, (TermEntry(1, START),)), "did not ask for a vote")
    assert data_files(target.data_dir) == before
    target.heartbeat()  # the first reply it sees is its own, at its own flush position
    target.stream(20)


@pytest.mark.parametrize("term", [2**64 - 1, limits.MAX_TERM + 1])
def test_a_term_beyond_the_bound_is_refused(target: Target, term: int) -> None:
    # DOS-1: one VoteRequest(2^64-1) used to stop every commit for good.
    before = data_files(target.data_dir)
    rogue = Peer(target.port)
    assert isinstance(rogue.ask(ROGUE_GREETING), GreetingReply)
    rogue.refused(raw_vote(term), "VoteRequest term")
    assert data_files(target.data_dir) == before
    target.stream(20)


@pytest.mark.parametrize(("history", "words"), [
    ([(2**62, 0), (7, 0), (1, START)], "not ascending"),
    ([(2**63 + i, 0) for i in range(30_000)] + [(1, START)], "term history of 30001 entries"),
])
def test_a_poisoned_history_is_refused(target: Target, history: list[tuple[int, int]], words: str) -> None:
    # DOS-1b: a history that would make the control file huge and every later vote unencodable.
    before = data_files(target.data_dir)
    rogue = Peer(target.port)
    assert isinstance(rogue.ask(ROGUE_GREETING), GreetingReply)
    vote = rogue.ask(VoteRequest(1))  # the current term: not granted, but it may claim the term
    assert isinstance(vote, VoteReply) and not vote.granted
    rogue.refused(raw_elected(1, START, history), words)
    assert data_files(target.data_dir) == before
    target.stream(20)


def _info(port: int) -> bool:
    p = Peer(port)
    try:
        return isinstance(p.ask(InfoRequest()), InfoReply)
    finally:
        p.close()


def test_huge_frame_headers_and_idle_sockets_cost_little(target: Target) -> None:
    # DOS-2: 16 MiB announced in 5 bytes used to allocate 16 MiB on each of any number of sockets.
    before, peak = data_files(target.data_dir), peak_rss(target.proc.pid)
    socks = [socket.create_connection(("127.0.0.1", target.port), timeout=30) for _ in range(200)]
    for s in socks:
        s.sendall(struct.pack(">IB", 16 << 20, ord("g")))
    for s in socks:  # each is closed: by the frame cap or, past the connection limit, at once
        with s:
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
    assert peak_rss(target.proc.pid) - peak < 64 << 20
    # Idle connections count against the limit; the elected proposer holds one.
    idle, answered = [], 0
    while True:
        p = Peer(target.port)
        idle.append(p)
        if p.ask(InfoRequest()) is None:
            break
        answered += 1
    assert answered == 63
    for p in idle:
        p.close()
    wait_for(lambda: _info(target.port), what="a free connection slot")
    assert data_files(target.data_dir) == before
    target.stream(20)


def test_a_fatal_error_is_reported_once_without_an_unretrieved_task(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # K-2: the connection task used to re-raise into nobody's hands ("Task exception was never
    # retrieved" and a second traceback). A control file that cannot be saved is the fault here.
    import asyncio
    import errno
    import gc

    from support.helpers import run
    from sidecar import framing
    from sidecar.safekeeper import server as server_mod

    def failing_save(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(server_mod, "save_control", failing_save)
    sk = server_mod.Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", free_port())
    unhandled: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unhandled.append(ctx))
        serving = asyncio.create_task(sk.serve())
        reader = None
        while reader is None:
            try:
                reader, writer = await framing.open_connection("127.0.0.1", sk.port)
            except OSError:
                await asyncio.sleep(0.02)
        writer.write(codec.encode(GREETING))  # a fresh safekeeper saves the cluster's identity
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await reader.read_message()
        writer.close()
        with pytest.raises(asyncio.CancelledError):
            await serving  # closing the listener ends serve(), as the CLI expects
        gc.collect()
        await asyncio.sleep(0)

    run(main())
    assert isinstance(sk.fatal, OSError)
    assert unhandled == []


def test_a_peer_without_an_address_is_named_unknown() -> None:
    # K-3: the address is the one accept() returned; anything else is named, never an exception.
    from sidecar.safekeeper.proposerport import peer_name

    assert peer_name(("127.0.0.1", 5432)) == "127.0.0.1:5432"
    assert peer_name(None) == "unknown" and peer_name(()) == "unknown"


def test_the_new_owner_is_acknowledged_while_the_old_connection_stays_open(target: Target) -> None:
    # The old owner's stream (served in a thread on this plain TCP link) must neither keep the new
    # owner from being synced and acknowledged nor get its own Appends accepted in the new term.
    old = target.legit
    target.legit = Peer(target.port)  # elected on a new connection; the old one is not closed
    assert isinstance(target.legit.ask(GREETING), GreetingReply)
    vote = target.legit.ask(VoteRequest(2))
    assert isinstance(vote, VoteReply) and vote.granted and vote.flush_lsn == target.end
    history = (TermEntry(1, START), TermEntry(2, target.end))
    assert target.legit.ask(Elected(2, target.end, history)) == ElectedReply(2, target.end)
    target.term = 2
    target.stream(20)
    before = data_files(target.data_dir)
    got = old.ask(Append(1, target.end, target.end, 0, b"\xAA" * 4096))  # the deposed proposer goes on
    while isinstance(got, AppendReply) and got.term == 1:  # replies of term 1 may still be queued before it
        got = old.recv()
    assert isinstance(got, AppendReply) and got.term == 2 and got.flush_lsn == target.end, got
    assert data_files(target.data_dir) == before
    old.close()
    target.stream(20)

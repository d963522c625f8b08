"""The fence term of `failover` driven through the real core: Proposer, AcceptorSession and Acceptor."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from sidecar.consensus.acceptor import Acceptor, AcceptorError, Persist, RecordEnd, Reply, Truncate, Write
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Greeting, Message, Refusal, TermEntry, VoteRequest,
)
from sidecar.consensus.proposer import ProposerConfig, VerifyPrimary
from sidecar.consensus.session import AcceptorSession
from sidecar.consensus.state import AcceptorState
from sidecar.proposer.fence import Fence, FenceError

SYSTEM_ID, SEG = 7_000_000_000_000_000_001, 16 * 1024 * 1024
S = 0x3000000  # where the first term started


def wal(n: int, salt: int = 0) -> bytes:
    return bytes((i * 7 + salt) % 251 for i in range(n))


class MemorySafekeeper:
    """A real Acceptor with its WAL in memory: what server.py does around it, without sockets or disks."""

    def __init__(self, node_id: int, data: bytes, history: tuple[TermEntry, ...], term: int, commit: int = 0) -> None:
        self.start, self.data = (S if history else 0), bytearray(data)
        state = AcceptorState(system_id=SYSTEM_ID, wal_seg_size=SEG, pg_version=15, timeline=1, term=term,
                              term_history=history, timeline_history=(), commit_lsn=commit, backup_lsn=0,
                              peer_horizon_lsn=0)
        self.acceptor = Acceptor(node_id, state, self.end)
        self.acceptor.reader_port = 9000 + node_id
        self.up = True

    @property
    def end(self) -> int:
        return self.start + len(self.data)

    def read(self, start: int, end: int) -> bytes:
        return bytes(self.data[start - self.start:end - self.start])

    def execute(self, actions: list) -> list[Message]:  # type: ignore[type-arg]
        replies: list[Message] = []
        for a in actions:
            match a:
                case Truncate():
                    del self.data[a.lsn - self.start:]
                case Write():
                    assert a.lsn == self.end
                    self.data += a.data
                case Persist():
                    pass
                case Reply():
                    replies.append(a.message)
        if any(isinstance(a, Write) for a in actions):  # fsynced at once
            replies += [a.message for a in self.acceptor.on_flushed(self.end) if isinstance(a, Reply)]
        return replies


class MemoryLink:
    """A proposer link straight into a MemorySafekeeper's AcceptorSession; replies come back on the loop."""

    def __init__(self, sk: MemorySafekeeper, name: str, on_up: Callable[[str], None],
                 on_message: Callable[[str, Message], None], on_down: Callable[[str], None]) -> None:
        self.sk, self.name = sk, name
        self.on_up, self.on_message, self.on_down = on_up, on_message, on_down
        self.session: AcceptorSession | None = None
        self.reconnects = 0

    @property
    def connected(self) -> bool:
        return self.session is not None

    def send(self, msg: Message) -> None:
        session = self.session
        if session is None:
            return
        try:
            end = RecordEnd(self.sk.end) if session.needs_record_end(msg) else None
            replies = self.sk.execute(session.receive(msg, end))
        except AcceptorError as e:
            replies = [Refusal(str(e))]
        loop = asyncio.get_running_loop()
        for r in replies:
            loop.call_soon(self._deliver, session, r)

    def _deliver(self, session: AcceptorSession, msg: Message) -> None:
        if session is self.session:
            self.on_message(self.name, msg)

    def drop(self, faulted: bool = False) -> None:
        if self.session is not None:
            self.session.closed()
            self.session = None
            self.on_down(self.name)

    def buffered(self) -> int:
        return 0

    async def drain(self) -> None:
        pass

    async def run(self) -> None:
        if self.sk.up:
            self.session = AcceptorSession(self.sk.acceptor)
            self.on_up(self.name)
        await asyncio.Event().wait()


class Cluster:
    def __init__(self, *sks: MemorySafekeeper) -> None:
        self.sks = {f"127.0.0.1:{7600 + sk.acceptor.node_id}": sk for sk in sks}
        self.by_reader = {f"127.0.0.1:{sk.acceptor.reader_port}": sk for sk in sks}
        self.prechecked: list[VerifyPrimary] = []
        self.copies: list[tuple[str, int, int, int]] = []

    def link(self, name: str, on_up, on_message, on_down, security) -> MemoryLink:  # type: ignore[no-untyped-def]
        return MemoryLink(self.sks[name], name, on_up, on_message, on_down)

    async def copy(self, address: str, start: int, end: int, term: int, sink, link) -> None:  # type: ignore[no-untyped-def]
        """The donor's reader port: a reader naming the current term reads up to its flush."""
        donor = self.by_reader[address]
        assert donor.acceptor.state.term == term, "the donor's term moved on"
        assert end <= donor.acceptor.flush_lsn
        self.copies.append((address, start, end, term))
        for lsn in range(start, end, 1000):
            sink(lsn, donor.read(lsn, min(end, lsn + 1000)))

    def fence(self, precheck=None) -> Fence:  # type: ignore[no-untyped-def]
        async def ok(a: VerifyPrimary) -> str | None:
            self.prechecked.append(a)
            return None
        cfg = ProposerConfig(proposer_id="failover", peers=tuple(self.sks), quorum=len(self.sks) // 2 + 1,
                             system_id=SYSTEM_ID, timeline=1, wal_seg_size=SEG, pg_version=15, bootstrap_lsn=0)
        return Fence(cfg, None, precheck=precheck or ok, copy=self.copy, say=lambda line: None,
                     link_factory=self.link)


async def fenced(cluster: Cluster, timeout: float = 10, **kwargs):  # type: ignore[no-untyped-def]
    fence = cluster.fence(**kwargs)
    try:
        return await fence.run(timeout), fence
    finally:
        await fence.close()


def test_the_fence_wins_a_term_recovers_the_voters_below_e_and_commits_e() -> None:
    full = wal(3000)
    sk1 = MemorySafekeeper(1, full, ((TermEntry(1, S)),), term=1, commit=S + 1000)
    sk2 = MemorySafekeeper(2, full[:1000], ((TermEntry(1, S)),), term=1, commit=S + 1000)
    sk3 = MemorySafekeeper(3, full[:2000], ((TermEntry(1, S)),), term=1, commit=S + 1000)
    cluster = Cluster(sk1, sk2, sk3)
    result, fence = asyncio.run(fenced(cluster))
    e = S + 3000
    assert (result.term, result.start_lsn, result.donor) == (2, e, "127.0.0.1:7601")
    assert cluster.prechecked[0].start_lsn == e
    # Recovery read the donor in the new term, from each laggard's own flush.
    assert sorted(c[1] for c in cluster.copies) == [S + 1000, S + 2000]
    assert {c[3] for c in cluster.copies} == {2} and {c[0] for c in cluster.copies} == {"127.0.0.1:9001"}
    for sk in (sk1, sk2, sk3):
        assert bytes(sk.data) == full
        assert sk.acceptor.state.term == 2
        assert sk.acceptor.state.term_history[-1] == TermEntry(2, e)
    # E is committed: a quorum was told, so their readers may have it.
    assert len(fence.committed_on()) >= 2
    assert sum(sk.acceptor.state.commit_lsn >= e for sk in (sk1, sk2, sk3)) >= 2
    # The old sidecar (term 1) is fenced: its next Append is answered with term 2, and nothing is written.
    reply = sk1.acceptor.on_append(Append(1, e, e, 0, b"late"))
    assert reply == [Reply(AppendReply(2, e, sk1.acceptor.state.commit_lsn))]
    assert sk1.end == e


def test_a_diverged_tail_of_an_older_term_is_cut_and_replaced_by_the_donors_wal() -> None:
    full = wal(3000)
    # sk1 and sk2 hold term 2's WAL from S+2000; sk3 kept term 1's unacknowledged tail beyond it.
    history2 = (TermEntry(1, S), TermEntry(2, S + 2000))
    sk1 = MemorySafekeeper(1, full, history2, term=2)
    sk2 = MemorySafekeeper(2, full[:2500], history2, term=2)
    sk3 = MemorySafekeeper(3, full[:2000] + wal(900, salt=5), (TermEntry(1, S),), term=1)
    sk2.up = False
    cluster = Cluster(sk1, sk2, sk3)
    result, _ = asyncio.run(fenced(cluster))
    assert (result.term, result.start_lsn) == (3, S + 3000)
    assert bytes(sk3.data) == full  # cut at S+2000, then fed the donor's bytes
    assert sk3.acceptor.state.term_history == (*history2, TermEntry(3, S + 3000))
    assert sk2.acceptor.state.term == 2 and bytes(sk2.data) == full[:2500]  # down: untouched


def test_a_refused_precheck_votes_nothing_and_changes_nothing() -> None:
    full = wal(3000)
    sks = [MemorySafekeeper(i, full, (TermEntry(1, S),), term=1) for i in (1, 2, 3)]

    async def refuse(a: VerifyPrimary) -> str | None:
        return "the standby follows another primary"
    with pytest.raises(FenceError, match="another primary"):
        asyncio.run(fenced(Cluster(*sks), precheck=refuse))
    assert all(sk.acceptor.state.term == 1 and sk.end == S + 3000 for sk in sks)


def test_without_a_quorum_the_fence_says_who_answered_and_changes_nothing() -> None:
    sks = [MemorySafekeeper(i, wal(100), (TermEntry(1, S),), term=1) for i in (1, 2, 3)]
    sks[1].up = sks[2].up = False
    with pytest.raises(FenceError, match="only 1 of 3 safekeepers answered"):
        asyncio.run(fenced(Cluster(*sks), timeout=0.5))
    assert sks[0].acceptor.state.term == 1


def test_empty_safekeepers_have_nothing_to_fail_over_to() -> None:
    sks = [MemorySafekeeper(i, b"", (), term=0) for i in (1, 2, 3)]
    with pytest.raises(FenceError, match="hold no WAL"):
        asyncio.run(fenced(Cluster(*sks)))


def test_a_term_taken_from_the_fence_afterwards_is_reported_by_check() -> None:
    """The old primary's sidecar, alive after all, wins a newer term: failover must not promote then."""
    full = wal(3000)
    sks = [MemorySafekeeper(i, full, (TermEntry(1, S),), term=1) for i in (1, 2, 3)]
    cluster = Cluster(*sks)

    async def scenario() -> str:
        fence = cluster.fence()
        try:
            result = await fence.run(10)
            fence.check()  # held
            for sk in sks[:2]:  # another proposer greets and asks a quorum for a higher term
                other = AcceptorSession(sk.acceptor)
                other.receive(Greeting(PROTOCOL_VERSION, "old", SYSTEM_ID, 1, SEG, 15))
                end = RecordEnd(sk.end) if other.needs_record_end(VoteRequest(result.term + 1)) else None
                sk.execute(other.receive(VoteRequest(result.term + 1), end))
            for _ in range(100):  # the fence's next heartbeat learns it
                try:
                    fence.check()
                except FenceError as e:
                    return str(e)
                await asyncio.sleep(0.05)
            return "still held"
        finally:
            await fence.close()
    assert "another proposer took term 3" in asyncio.run(scenario())

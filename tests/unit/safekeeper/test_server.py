"""The safekeeper service: built complete by `Safekeeper.open()` (or refused with a StartupError),
and publishing its positions as it serves a proposer over a real connection."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from sidecar import framing
from sidecar.consensus import codec
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, ElectedReply, Greeting, GreetingReply, InfoReply, InfoRequest,
    TermEntry, VoteReply, VoteRequest,
)
from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.control import ControlData, ControlFileError, control_path, save_control
from sidecar.safekeeper.positions import Positions
from sidecar.safekeeper.server import Safekeeper
from sidecar.safekeeper.storage import NoWal, WalStorage
from sidecar.safekeeper.walcheck import StartupError
from sidecar.linkauth import client_security, dial, server_security
from support.helpers import created, run, until
from support.serving import serving, talking_to
from support.pki import TestPKI
from support.walbuilder import WalBuilder

SEG = 1 << 20
SYSID = 7_300_000_000_000_000_012


# ---- one constructor: ready to serve, or a StartupError --------------------------------------------

def test_a_fresh_data_dir_opens_ready_to_serve_without_a_wal_store(tmp_path: Path) -> None:
    sk = Safekeeper.open(3, created(tmp_path, 3), "127.0.0.1", 0)
    assert isinstance(sk.storage, NoWal) and not (tmp_path / "wal").exists()
    assert sk.acceptor.state == AcceptorState(members=3) and sk.positions.value == Positions()
    assert not sk.acceptor.amnesic
    v = sk.view()
    assert (v.node_id, v.listen, v.link_security, v.stopped, v.proposer_connected) == \
        (3, "127.0.0.1:0", None, False, False)


def test_a_state_built_before_a_newer_promise_is_never_saved_over_it(tmp_path: Path) -> None:
    """A state of term 3 to be saved after a vote saved term 4 (transitions are saved in order; this is the guard)."""
    from sidecar.safekeeper.control import load_control
    sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
    old = AcceptorState(SYSID, SEG, 15, 1, 3, commit_lsn=5 * SEG)
    new = AcceptorState(SYSID, SEG, 15, 1, 4, commit_lsn=5 * SEG)
    sk._save(new)
    sk._save(old)
    assert load_control(tmp_path).state.term == 4
    reopened = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
    assert reopened.acceptor.state.term == 4


def test_another_nodes_data_dir_is_a_startup_error_not_an_exit(tmp_path: Path) -> None:
    save_control(tmp_path, ControlData(2, AcceptorState()))
    with pytest.raises(StartupError, match="belongs to safekeeper 2, not 1"):
        Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)


def test_a_corrupt_control_file_is_refused(tmp_path: Path) -> None:
    save_control(tmp_path, ControlData(1, AcceptorState()))
    path = control_path(tmp_path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ControlFileError):
        Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)


def test_an_invalid_segment_size_is_a_startup_error(tmp_path: Path) -> None:
    save_control(tmp_path, ControlData(1, AcceptorState(SYSID, 12345, 15, 1)))
    with pytest.raises(StartupError, match="holds an invalid value"):
        Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)


def test_an_unusable_data_dir_is_a_startup_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StartupError, match="safekeeper 1 cannot start from"):
        Safekeeper.open(1, tmp_path / "file" / "sk", "127.0.0.1", 0)


def test_stored_wal_opens_at_the_end_of_its_last_record(tmp_path: Path) -> None:
    b = WalBuilder(SEG, seg_size=SEG, sysid=SYSID)
    b.fill_to(SEG + 50_000, 300)
    with WalStorage(tmp_path / "wal", SEG, 1) as st:
        st.open_at(SEG)
        st.write(SEG, b.bytes())
        st.flush()
    end = b.records[-1].end_lsn
    save_control(tmp_path, ControlData(1, AcceptorState(SYSID, SEG, 15, 1, term=2, term_history=(TermEntry(2, SEG),),
                                                        commit_lsn=end + 1000)))
    sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
    try:
        assert isinstance(sk.storage, WalStorage) and sk.acceptor.write_lsn == end
        # commit_lsn is "acknowledged and present here": lowered to the WAL that survived
        assert sk.positions.value == Positions(term=2, flush_lsn=end, commit_lsn=end)
    finally:
        sk.storage.close()


# ---- positions published as the server carries out the acceptor's actions -------------------------

def test_positions_are_published_after_fsync_commit_and_cut(tmp_path: Path) -> None:
    b = WalBuilder(SEG, seg_size=SEG, sysid=SYSID)
    b.fill_to(SEG + 20_000, 200)
    wal, ends = b.bytes(), [r.end_lsn for r in b.records]

    async def main() -> None:
        sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
        flushed = asyncio.ensure_future(sk.positions.wait(lambda p: p.flush_lsn >= ends[-1]))
        committed = asyncio.ensure_future(sk.positions.wait(lambda p: p.commit_lsn >= ends[5]))
        async with talking_to(sk) as send:
            assert isinstance(await send(Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15)), GreetingReply)
            assert isinstance(await send(VoteRequest(1)), VoteReply)
            assert sk.positions.value == Positions(term=1)
            assert isinstance(await send(Elected(1, SEG, (TermEntry(1, SEG),))), ElectedReply)
            assert sk.positions.value == Positions(term=1, flush_lsn=SEG, generation=1)
            reply = await send(Append(1, SEG, 0, 0, wal))
            assert isinstance(reply, AppendReply) and reply.flush_lsn == ends[-1]
            assert (await flushed).flush_lsn == ends[-1] and not committed.done()
            await send(Append(1, ends[-1], ends[5], 0, b""))  # a heartbeat carrying the commit position
            assert await committed == Positions(1, ends[-1], ends[5], generation=1)
            # A new term cuts above the commit position: flush moves back, the generation says so.
            assert isinstance(await send(VoteRequest(2)), VoteReply)
            assert isinstance(await send(Elected(2, ends[7], (TermEntry(1, SEG), TermEntry(2, ends[7])))),
                              ElectedReply)
            assert sk.positions.value == Positions(2, ends[7], ends[5], generation=2)

    run(main())


def test_a_promoted_primary_s_timeline_is_persisted_and_laid_out_as_its_pg_wal(tmp_path: Path) -> None:
    """Elected names timeline 2 switching at the term start: the control file keeps it, the WAL
    directory gets 00000002.history and the segment holding the switch takes timeline 2's name."""
    from sidecar.timelines import TimelineEntry
    from sidecar.lsn import segment_file_name

    b = WalBuilder(SEG, seg_size=SEG, sysid=SYSID)
    b.fill_to(SEG + 20_000, 200)
    wal, end = b.bytes(), b.records[-1].end_lsn
    switch = (TimelineEntry(1, end),)

    async def main() -> None:
        sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
        async with talking_to(sk) as send:
            await send(Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15))
            await send(VoteRequest(1))
            await send(Elected(1, SEG, (TermEntry(1, SEG),), 1))
            assert (await send(Append(1, SEG, 0, 0, wal))).flush_lsn == end  # type: ignore[attr-defined]
            await send(VoteRequest(2))
            reply = await send(Elected(2, end, (TermEntry(1, SEG), TermEntry(2, end)), 2, switch))
            assert isinstance(reply, ElectedReply) and reply.flush_lsn == end
            s = sk.reader_state()
            assert (s.timeline, s.history) == (2, switch)

    run(main())
    wal_dir = tmp_path / "wal"
    assert sorted(p.name for p in wal_dir.iterdir()) == ["00000002.history",
                                                         segment_file_name(2, 1, SEG) + ".partial"]
    again = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
    try:
        assert (again.reader_state().timeline, again.reader_state().history) == (2, switch)
        assert again.reader_state().flush_lsn == end
    finally:
        again.storage.close()


def test_a_stop_while_a_proposer_streams_ends_its_thread_before_the_storage_closes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelling serve() (SIGTERM) ends the connection threads first: nothing fails in them, nothing is fatal,
    and what was acknowledged is on disk."""
    failures: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    b = WalBuilder(SEG, seg_size=SEG, sysid=SYSID)
    b.fill_to(SEG + 20_000, 200)
    end = b.records[-1].end_lsn

    async def main() -> None:
        sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
        server, port = await serving(sk)
        reader, writer = await framing.open_connection("127.0.0.1", port)
        for msg in (Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15), VoteRequest(1),
                    Elected(1, SEG, (TermEntry(1, SEG),)), Append(1, SEG, 0, 0, b.bytes())):
            framing.write(writer, codec.encode(msg))
            reply = await asyncio.wait_for(reader.read_message(), 10)
        assert isinstance(reply, AppendReply) and reply.flush_lsn == end
        assert sk.view().proposer_connected
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        assert not [t for t in threading.enumerate() if t.name.startswith(("conn-1-", "accept-1"))]
        assert sk.fatal is None and sk.stopped is None and not sk.view().proposer_connected
        writer.close()

    run(main())
    assert failures == []
    again = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
    try:
        assert again.acceptor.write_lsn == end
    finally:
        again.storage.close()


# ---- the consensus port's places (budget.py) ------------------------------------------------------

def test_read_only_clients_cannot_take_the_proposers_places(tmp_path: Path, pki: TestPKI) -> None:
    """Audit M-5 (E21): clients holding every place they may have leave the proposer its own."""
    from sidecar.safekeeper.budget import MAX_CONNECTIONS

    async def main() -> None:
        sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0, server_security(pki.certs("safekeeper", 1), "tls"))
        server, port = await serving(sk)
        client = client_security(pki.certs("client"), "tls")
        held, answered = [], 0
        try:
            for _ in range(MAX_CONNECTIONS):  # as many as the safekeeper serves at all
                r, w, _ = await dial("127.0.0.1", port, client)
                held.append(w)
                framing.write(w, codec.encode(InfoRequest()))
                try:
                    if isinstance(await asyncio.wait_for(r.read_message(), 10), InfoReply):
                        answered += 1
                except (asyncio.IncompleteReadError, ConnectionError):
                    pass
            r, w, _ = await dial("127.0.0.1", port, client_security(pki.certs("proposer"), "tls"))
            held.append(w)
            framing.write(w, codec.encode(Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15)))
            reply = await asyncio.wait_for(r.read_message(), 10)
        finally:
            for w in held:
                w.close()
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
        assert isinstance(reply, GreetingReply), reply
        assert 0 < answered < MAX_CONNECTIONS

    run(main())


def test_no_descriptor_for_a_connection_marks_nothing_in_doubt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit M-1/I-1: EMFILE on accept is a connection not had, not a storage failure that stops the
    safekeeper and marks its WAL in doubt; the port accepts again."""
    import errno
    import socket

    b = WalBuilder(SEG, seg_size=SEG, sysid=SYSID)
    b.fill_to(SEG + 20_000, 200)
    real_accept = socket.socket.accept
    failed = threading.Event()

    def no_descriptor_once(self: socket.socket):  # type: ignore[no-untyped-def]
        if not failed.is_set():
            failed.set()
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(self)

    async def main() -> None:
        sk = Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)
        async with talking_to(sk) as send:
            for msg in (Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15), VoteRequest(1),
                        Elected(1, SEG, (TermEntry(1, SEG),)), Append(1, SEG, 0, 0, b.bytes())):
                await send(msg)
            monkeypatch.setattr(socket.socket, "accept", no_descriptor_once)
            # The accept thread is already inside the real accept(): one connection gets it out, and its
            # next accept() is the one without a descriptor.
            _, first = await framing.open_connection("127.0.0.1", sk.listening_port)  # type: ignore[arg-type]
            await until(failed.is_set, "an accept() without a descriptor")
            first.close()
            reader, writer = await framing.open_connection("127.0.0.1", sk.listening_port)  # type: ignore[arg-type]
            try:
                framing.write(writer, codec.encode(Greeting(PROTOCOL_VERSION, "q", SYSID, 1, SEG, 15)))
                assert isinstance(await asyncio.wait_for(reader.read_message(), 10), GreetingReply)
            finally:
                writer.close()
            assert sk.fatal is None and sk.stopped is None, sk.stopped
            assert isinstance(sk.storage, WalStorage) and sk.storage.in_doubt() is None

    run(main())


def test_only_storage_io_failures_leave_wal_in_doubt() -> None:
    import errno

    from sidecar.safekeeper.server import _leaves_wal_in_doubt
    from sidecar.safekeeper.storage import StorageError

    def caused(outer: Exception, inner: Exception) -> Exception:
        outer.__cause__ = inner
        return outer

    assert _leaves_wal_in_doubt(OSError(errno.EIO, "Input/output error"))
    assert _leaves_wal_in_doubt(caused(StorageError("fdatasync failed"), OSError(errno.EIO, "I/O")))
    assert not _leaves_wal_in_doubt(caused(StorageError("writing WAL failed"), OSError(errno.EMFILE, "Too many")))
    assert not _leaves_wal_in_doubt(OSError(errno.ENFILE, "File table overflow"))
    assert not _leaves_wal_in_doubt(AssertionError("a bug"))

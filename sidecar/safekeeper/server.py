"""The safekeeper service: TCP connections from proposers around the acceptor core and storage."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import struct
import termios
import time
from pathlib import Path

import google_crc32c

from sidecar import framing
from sidecar.consensus import codec
from sidecar.consensus.acceptor import (
    Acceptor, AcceptorAction, AcceptorError, Persist, RecordEnd, Reply, Truncate, Write,
)
from sidecar.consensus.messages import Append, Elected, Greeting, InfoRequest, Message, Refusal, VoteRequest
from sidecar.consensus.state import AcceptorState
from sidecar.lsn import format_lsn
from sidecar.logs import get_logger
from sidecar.metrics import SafekeeperMetrics
from sidecar.safekeeper.control import ControlData, load_control, remove_leftovers, save_control
from sidecar.safekeeper.monitor import info_reply
from sidecar.safekeeper.storage import WalStorage
from sidecar.wal.reader import find_end_of_wal

TAIL_FINGERPRINT = 1024 * 1024  # bytes before flush_lsn whose CRC a vote reports
# Unsynced WAL up to this much is fdatasync'ed on the event loop once the proposer's socket is
# drained (group commit, as pg_receivewal does it): the hop to a thread and back costs more CPU
# and latency than the sync itself. More than this is synced in a thread while reading goes on.
INLINE_FLUSH_MAX = 256 * 1024
_FIONREAD = struct.Struct("i")
_STATEFUL = (Persist, Truncate)


class Safekeeper:
    """One acceptor process: owns the data directory, serves proposers on one port."""

    def __init__(self, node_id: int, data_dir: Path, host: str, port: int) -> None:
        self.node_id = node_id
        self.data_dir = data_dir
        self.host, self.port = host, port
        self.log = get_logger(node=node_id)
        self.storage: WalStorage | None = None
        self.acceptor: Acceptor | None = None
        self._server: asyncio.Server | None = None
        self._flush_lock = asyncio.Lock()
        self._persist_lock = asyncio.Lock()  # see _execute_stateful
        self._flush_wanted = asyncio.Event()
        self._stream: asyncio.StreamWriter | None = None  # connection of the elected proposer
        self._tasks: set[asyncio.Task[None]] = set()
        self.fatal: BaseException | None = None
        self.stats = SafekeeperMetrics(node_id)

    def proposer_address(self) -> str | None:
        """HOST:PORT of the elected proposer streaming to this safekeeper, if any."""
        if self._stream is None:
            return None
        peer = self._stream.get_extra_info("peername")
        return "%s:%s" % peer[:2] if peer else "unknown"

    # ---- start-up ---------------------------------------------------------------------------

    def open(self) -> None:
        """Load the control file and find the end of valid WAL (ControlFileError if corrupt)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.data_dir)
        control = load_control(self.data_dir)
        if control is not None and control.node_id != self.node_id:
            raise SystemExit(
                f"{self.data_dir} belongs to safekeeper {control.node_id}, not {self.node_id}")
        state = control.state if control else AcceptorState()
        write_lsn = 0
        if state.wal_seg_size:
            self.storage = WalStorage(self.data_dir / "wal", state.wal_seg_size, state.timeline)
            end = self._scan(state).flush_lsn
            if end:
                self.storage.open_at(end)
            write_lsn = end
        self.acceptor = Acceptor(self.node_id, state, write_lsn)
        self.log.info("safekeeper opened", term=state.term, flush_lsn=format_lsn(write_lsn),
                      commit_lsn=format_lsn(state.commit_lsn), data_dir=str(self.data_dir))

    def _scan(self, state: AcceptorState) -> RecordEnd:
        """End of the last complete record with a valid CRC, and a fingerprint of its bytes."""
        st = self.storage
        if st is None or not st.segments():
            return RecordEnd(0)
        seg = state.wal_seg_size
        segments = st.segments()
        first = segments[0][1] * seg
        # Only a completed segment is known durable (fsynced before its rename), so the walk
        # starts in the last one. A term start is no such anchor: a safekeeper that crashed
        # while catching up below it may hold torn bytes on both sides of it.
        durable = [segno for _, segno, partial in segments if not partial]
        start = durable[-1] * seg if durable else first
        while True:
            end, last = find_end_of_wal(st, start, seg_size=seg, system_id=state.system_id or None)
            if last is not None or start <= first:
                break
            start = max(start - seg, first)  # no record begins here: one spans the whole segment
        if last is None:
            return RecordEnd(first)
        # Fingerprint the last record wherever it lies, even before the last term's start:
        # after a term that wrote nothing it is still what a stale primary must match.
        tail = max(last, end - TAIL_FINGERPRINT)
        return RecordEnd(end, tail, google_crc32c.value(st.read(tail, end - tail)))

    # ---- serving ----------------------------------------------------------------------------

    async def serve(self) -> None:
        """Listen and serve until cancelled."""
        self._server = await framing.start_server(self._connection, self.host, self.port)
        self.log.info("listening", address=f"{self.host}:{self.port}")
        flusher = asyncio.create_task(self._flusher())
        try:
            async with self._server:
                await self._server.serve_forever()
        finally:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            if self.storage is not None:
                self.storage.close()

    async def _connection(self, reader: framing.FrameReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%s" % writer.get_extra_info("peername")[:2]
        log = self.log.bind(peer=peer)
        greeted = False
        self.stats.connections.inc()
        try:
            while True:
                msg = await reader.read_message()
                if isinstance(msg, InfoRequest):  # operator tooling: read-only, no Greeting needed
                    framing.write(writer, codec.encode(info_reply(self)))
                    await writer.drain()
                    continue
                if not greeted and not isinstance(msg, Greeting):
                    raise AcceptorError(f"the first message must be a Greeting, not {type(msg).__name__}")
                greeted = True
                reader.max_frame = codec.MAX_FRAME
                if type(msg) is Append:  # the hot path: no coroutine hops for a plain append
                    actions = self.acceptor.on_append(msg)  # type: ignore[union-attr]
                else:
                    actions = await self._dispatch(msg, writer, log)
                if any(type(a) in _STATEFUL for a in actions):
                    await self._execute_stateful(actions, writer)
                else:
                    self._apply(actions, writer)
                self._sync_when_drained(reader, writer)
                if writer.transport.get_write_buffer_size() > 1 << 20:
                    await writer.drain()  # a proposer that stops reading stops being read
        except (asyncio.IncompleteReadError, ConnectionError):
            log.info("connection closed")
        except codec.ProtocolError as e:
            log.warning("malformed message; closing the connection", reason=str(e))
        except AcceptorError as e:
            log.warning("message refused; closing the connection", reason=str(e))
            with contextlib.suppress(ConnectionError):
                framing.write(writer, codec.encode(Refusal(str(e))))
                await writer.drain()
        except Exception as e:  # a storage or control-file failure: state may be half-applied
            log.critical("fatal error; stopping the safekeeper", error=repr(e))
            self.fatal = e
            if self._server is not None:
                self._server.close()
            raise
        finally:
            if self._stream is writer:
                self._stream = None
            writer.close()

    async def _dispatch(self, msg: Message, writer: asyncio.StreamWriter, log) -> list[AcceptorAction]:
        acc = self.acceptor
        assert acc is not None
        match msg:
            case Append():
                return acc.on_append(msg)
            case Greeting():
                log.info("greeting", proposer=msg.proposer_id, term=acc.state.term)
                return acc.on_greeting(msg)
            case VoteRequest():
                end = await self._flushed_record_end()
                actions = acc.on_vote(msg, end)
                granted = acc.state.term == msg.term and isinstance(actions[0], Persist)
                log.info("vote", term=msg.term, granted=granted, flush_lsn=format_lsn(end.flush_lsn))
                if msg.term:  # term 0 is the proposer's pre-vote probe, not a vote
                    (self.stats.votes_granted if granted else self.stats.votes_refused).inc()
                return actions
            case Elected():
                end = await self._flushed_record_end()
                actions = acc.on_elected(msg, end)
                if acc.elected_term == msg.term:
                    self._stream = writer
                    self.stats.elections.inc()
                    log.info("elected", term=msg.term, start_lsn=format_lsn(msg.start_lsn),
                             truncate_lsn=format_lsn(acc.write_lsn))
                return actions
        raise AcceptorError(f"unexpected {type(msg).__name__} from a proposer")

    async def _execute_stateful(self, actions: list[AcceptorAction], writer: asyncio.StreamWriter) -> None:
        # A batch that saves state or cuts WAL runs whole under the persist lock, queued in the
        # order the acceptor produced the batches (nothing yields in between). So when two
        # proposers' connections interleave, an older state is never saved over a newer one, saves
        # never share the temp file, and an Elected's cut precedes any save of its history.
        async with self._persist_lock:
            for a in actions:
                match a:
                    case Persist():
                        await asyncio.to_thread(save_control, self.data_dir, ControlData(self.node_id, a.state))
                    case Truncate():
                        async with self._flush_lock:
                            st = self._storage_for_write()
                            await asyncio.to_thread(st.truncate if st.segments() else st.open_at, a.lsn)
                    case _:
                        self._apply((a,), writer)

    def _apply(self, actions: list[AcceptorAction] | tuple[AcceptorAction, ...], writer: asyncio.StreamWriter) -> None:
        """Carry out Write and Reply actions, which need no lock and never wait."""
        for a in actions:
            if type(a) is Write:
                self._storage_for_write().write(a.lsn, a.data)
                self.stats.wal_written.inc(len(a.data))
            else:
                framing.write(writer, codec.encode(a.message))  # type: ignore[union-attr]

    def _storage_for_write(self) -> WalStorage:
        if self.storage is None:
            s = self.acceptor.state  # type: ignore[union-attr]
            self.storage = WalStorage(self.data_dir / "wal", s.wal_seg_size, s.timeline)
        return self.storage

    async def _flushed_record_end(self) -> RecordEnd:
        async with self._flush_lock:
            if self.storage is None:
                return RecordEnd(0)
            await asyncio.to_thread(self.storage.flush)
            return await asyncio.to_thread(self._scan, self.acceptor.state)  # type: ignore[union-attr]

    def _sync_when_drained(self, reader: framing.FrameReader, writer: asyncio.StreamWriter) -> None:
        """Group commit: sync once the socket is drained, so one fdatasync covers all WAL received."""
        st, acc = self.storage, self.acceptor
        if st is None or acc is None or st.flush_lsn >= acc.write_lsn:
            return
        unsynced = acc.write_lsn - st.flush_lsn
        if unsynced > INLINE_FLUSH_MAX or self._flush_lock.locked():
            self._flush_wanted.set()
        elif not reader.has_messages() and not _bytes_waiting(writer):
            # Blocking the loop for one small sync is cheaper than any hand-off; WAL arriving
            # meanwhile waits in the socket and the next sync covers it.
            began = time.perf_counter()
            self._synced(st.flush(), began)
        # Otherwise the next message is already here: the sync after it covers this one too.

    def _synced(self, flushed: int, began: float) -> None:
        """Record the sync's duration and acknowledge what it made durable."""
        self.stats.fsync.observe(time.perf_counter() - began)
        if self._stream is not None:
            for a in self.acceptor.on_flushed(flushed):  # type: ignore[union-attr]
                if isinstance(a, Reply):
                    framing.write(self._stream, codec.encode(a.message))

    async def _flusher(self) -> None:
        """Syncs batches too large to sync on the loop in a thread, while reading goes on."""
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            async with self._flush_lock:
                st, acc = self.storage, self.acceptor
                if st is None or acc is None or st.flush_lsn >= acc.write_lsn:
                    continue
                began = time.perf_counter()
                flushed = await asyncio.to_thread(st.flush)
            self._synced(flushed, began)


def _bytes_waiting(writer: asyncio.StreamWriter) -> bool:
    """True if the connection's socket holds bytes not read yet."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return False
    try:
        return _FIONREAD.unpack(fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(_FIONREAD.size)))[0] > 0
    except OSError:
        return False

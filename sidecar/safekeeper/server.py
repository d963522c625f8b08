"""The safekeeper service: TCP connections from proposers around the acceptor core and storage."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import google_crc32c

from sidecar.consensus import codec
from sidecar.consensus.acceptor import (
    Acceptor, AcceptorAction, AcceptorError, Persist, RecordEnd, Reply, Truncate, Write,
)
from sidecar.consensus.messages import Append, Elected, Greeting, Message, Refusal, VoteRequest
from sidecar.consensus.state import AcceptorState
from sidecar.lsn import format_lsn, segment_start
from sidecar.logs import get_logger
from sidecar.safekeeper.control import ControlData, load_control, save_control
from sidecar.safekeeper.storage import WalStorage
from sidecar.wal.reader import find_end_of_wal

TAIL_FINGERPRINT = 1024 * 1024  # bytes before flush_lsn whose CRC a vote reports


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
        self._flush_wanted = asyncio.Event()
        self._stream: asyncio.StreamWriter | None = None  # connection of the elected proposer
        self._tasks: set[asyncio.Task[None]] = set()
        self.fatal: BaseException | None = None

    # ---- start-up ---------------------------------------------------------------------------

    def open(self) -> None:
        """Load the control file and find the end of valid WAL (ControlFileError if corrupt)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
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
        """End of the last complete record with a valid CRC, and a fingerprint of its tail."""
        st = self.storage
        if st is None or not st.segments():
            return RecordEnd(0)
        seg = state.wal_seg_size
        first = st.segments()[0][1] * seg
        known = [e.start_lsn for e in state.term_history if e.start_lsn <= st.write_lsn]
        term_start = known[-1] if known else first
        # Completed segments were fsynced before their rename, so starting a segment or two
        # back from the tail bounds the scan without trusting unsynced bytes.
        back = segment_start(max(st.write_lsn - 1, 0), seg) - seg
        start = max(term_start, first, back)
        while True:
            end, last = find_end_of_wal(st, start, seg_size=seg, system_id=state.system_id or None)
            if last is not None or start <= max(term_start, first):
                break
            start = max(start - seg, term_start, first)
        if last is None:
            return RecordEnd(start if start == term_start else 0)
        tail = max(last, end - TAIL_FINGERPRINT)
        return RecordEnd(end, tail, google_crc32c.value(st.read(tail, end - tail)))

    # ---- serving ----------------------------------------------------------------------------

    async def serve(self) -> None:
        """Listen and serve until cancelled."""
        self._server = await asyncio.start_server(self._connection, self.host, self.port)
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

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%s" % writer.get_extra_info("peername")[:2]
        log = self.log.bind(peer=peer)
        greeted = False
        try:
            while True:
                msg = await codec.read_message(reader)
                if not greeted and not isinstance(msg, Greeting):
                    raise AcceptorError(f"the first message must be a Greeting, not {type(msg).__name__}")
                greeted = True
                await self._execute(await self._dispatch(msg, writer, log), writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            log.info("connection closed")
        except codec.ProtocolError as e:
            log.warning("malformed message; closing the connection", reason=str(e))
        except AcceptorError as e:
            log.warning("message refused; closing the connection", reason=str(e))
            with contextlib.suppress(ConnectionError):
                writer.write(codec.encode(Refusal(str(e))))
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
                log.info("vote", term=msg.term, granted=acc.state.term == msg.term and isinstance(actions[0], Persist),
                         flush_lsn=format_lsn(end.flush_lsn))
                return actions
            case Elected():
                end = await self._flushed_record_end()
                actions = acc.on_elected(msg, end)
                if acc.elected_term == msg.term:
                    self._stream = writer
                    log.info("elected", term=msg.term, start_lsn=format_lsn(msg.start_lsn),
                             truncate_lsn=format_lsn(acc.write_lsn))
                return actions
        raise AcceptorError(f"unexpected {type(msg).__name__} from a proposer")

    async def _execute(self, actions: list[AcceptorAction], writer: asyncio.StreamWriter) -> None:
        for a in actions:
            match a:
                case Write():
                    self._storage_for_write().write(a.lsn, a.data)
                    self._flush_wanted.set()
                case Persist():
                    await asyncio.to_thread(save_control, self.data_dir, ControlData(self.node_id, a.state))
                case Truncate():
                    async with self._flush_lock:
                        st = self._storage_for_write()
                        await asyncio.to_thread(st.truncate if st.segments() else st.open_at, a.lsn)
                case Reply():
                    writer.write(codec.encode(a.message))
        if writer.transport.get_write_buffer_size() > 1 << 20:
            await writer.drain()

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

    async def _flusher(self) -> None:
        """Group commit: one fdatasync covers everything written while the previous one ran."""
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            async with self._flush_lock:
                st, acc = self.storage, self.acceptor
                if st is None or acc is None or st.flush_lsn >= acc.write_lsn:
                    continue
                flushed = await asyncio.to_thread(st.flush)
            if self._stream is not None:
                for a in acc.on_flushed(flushed):
                    if isinstance(a, Reply):
                        self._stream.write(codec.encode(a.message))

"""The safekeeper service: TCP connections from proposers around the acceptor core and storage."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from sidecar import linkauth, tls
from sidecar.address import cannot_listen
from sidecar.consensus import codec
from sidecar.consensus.groupcommit import Decision, GroupCommit
from sidecar.consensus.acceptor import (
    Acceptor, AcceptorAction, AcceptorError, AdoptTimeline, Persist, RecordEnd, Reply, Truncate, Write,
)
from sidecar.consensus.messages import (
    Append, Elected, Greeting, InfoReply, InfoRequest, Message, Refusal, VoteReply, VoteRequest,
)
from sidecar.consensus.reading import ServerState
from sidecar.consensus.session import AcceptorSession, Role
from sidecar.logs import get_logger, set_context_provider
from sidecar.lsn import format_lsn, segment_file_name
from sidecar.metrics import SafekeeperMetrics
from sidecar.safekeeper.amnesia import TermLearner
from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.backup import ArchiveOptions, PartialSegment, uploader_for
from sidecar.safekeeper.control import ControlData, save_control
from sidecar.safekeeper.diskguard import DiskGuard
from sidecar.safekeeper.pgserver import MAX_READERS, ReaderPort
from sidecar.safekeeper.readerhost import ReaderProcess
from sidecar.safekeeper.positions import Positions, PositionWatch
from sidecar.safekeeper.publish import Publisher
from sidecar.safekeeper.remove import Remover
from sidecar.readerauth import MOCK_SECRET_FILE, mock_secret
from sidecar.safekeeper.slots import SlotLimits, Slots
from sidecar.safekeeper.budget import (
    MAX_CONNECTIONS, ConnectionBudget, Place, TooFewDescriptors, descriptors_needed, raise_descriptor_limit,
)
from sidecar.safekeeper import streamloop
from sidecar.safekeeper.proposerport import IdleTimeout, Link, ProposerPort
from sidecar.safekeeper.startup import open_data_dir
from sidecar.safekeeper.storage import DiskFull, NoWal, StorageError, WalInDoubt, WalPin, WalStorage, is_disk_full
from sidecar.safekeeper.view import SafekeeperView, SlotView
from sidecar.safekeeper.walcheck import StartupError, record_end
from sidecar.sizes import DiskLimit

# A connection that does not hold the term and sends nothing for this long is closed; the
# elected proposer sends a heartbeat every second and is exempt.
IDLE_TIMEOUT = 60.0
# While the disk guard holds the elected proposer's WAL back, look at a stop this often.
_GUARD_POLL = 1.0
# Out of descriptors: what an open, dup or accept found, never a write's or a sync's.
_NO_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)

__all__ = ["Safekeeper", "StartupError"]


class Safekeeper:
    """One acceptor process: owns the data directory, serves proposers on one port.

    Built ready to serve by `Safekeeper.open()`. Observers read `view()` and wait on `positions`.

    Thread contract. The proposer port's threads (proposerport.py: one per connection, each the
    only one to read and write its socket) run `converse`, concurrently with each other and with
    the event loop. Every acceptor transition holds `acceptor_lock` from the event to the end of
    `_carry_out`, which carries out its actions but the replies (writes, saves of the control file,
    cuts) and publishes the positions: a connection's message (`_receive`, with the flush and scan
    a vote or Elected needs), a connection's acknowledgement (`_acknowledge`, whose fdatasync runs
    before it takes the lock), and the loop's events (`transition`, in a worker: `backed_up`, the
    term learned from the peers). So transitions, saves and cuts happen in one order. Without the
    lock, from any thread: `view`, `reader_state`, `pin_wal`, `read_partial` (a
    sequence lock on the cut generation) and the properties, which read values the lock's holder
    replaces whole; `_stop`, under its own lock; and the reader process's cut generation
    (`_carry_out` writes it). Everything else runs on the event loop: `serve`, the reader process's
    host (readerhost.py), the remover, the uploader, the publisher and the learner, which wait on
    `positions`. The reader port's connections are another process's (readerprocess.py).
    """

    def __init__(self, node_id: int, data_dir: Path, host: str, port: int, security: linkauth.Security,
                 acceptor: Acceptor, storage: WalStorage | NoWal, stats: SafekeeperMetrics,
                 reader_port: ReaderPort | None = None, keep_wal: int | None = None,
                 max_disk_usage: DiskLimit | None = None, archive: ArchiveOptions | None = None,
                 slot_limits: SlotLimits = SlotLimits()) -> None:
        self.node_id = node_id
        # Neither: --insecure, every connection may act as a proposer.
        self.ssl_context = security if isinstance(security, ssl.SSLContext) else None
        self.link_auth = security if isinstance(security, linkauth.LinkAuth) else None
        self.data_dir = data_dir
        self.host, self.port = host, port
        self.log = get_logger(node=node_id)
        self.acceptor = acceptor
        self.storage = storage  # a NoWal until the first proposer's greeting gives the segment size
        self.stats = stats
        self.positions = PositionWatch(self._positions())
        self.slots = Slots(data_dir, slot_limits)
        # Removal (the archive's backup_lsn, or --keep-wal) and the disk guard (--max-disk-usage).
        self.guard = DiskGuard(max_disk_usage, data_dir)
        self.remover = Remover(self, self.guard, keep_wal, backup_lsn=lambda: self.acceptor.state.backup_lsn
                               if self.uploader is not None else None)
        self.slots.on_change = self.remover.wake
        # The reader port (--pg-listen): proposers learn it from the greeting (0: none).
        # Served from a process of its own (readerprocess.py), so that no reader takes the stream's GIL or CPU.
        self.readers = ReaderProcess(self, reader_port, data_dir / "wal", mock_secret(data_dir / MOCK_SECRET_FILE)) \
            if reader_port is not None else None
        self.acceptor.reader_port = reader_port.port if reader_port is not None else 0
        self.uploader = uploader_for(self, archive.url, archive.s3_endpoint, archive.cluster, archive.takeover,
                                     stats.archived.inc) if archive is not None else None
        self.budget = ConnectionBudget()  # the consensus port's places, from accept on
        self._port = ProposerPort(node_id, host, port, security, self.budget, self.converse, self.log)
        # Who serves the term holder's Appends: the compiled loop, or None for converse's own (streamloop.py).
        self.stream_loop = streamloop.chosen()
        self._loop: asyncio.AbstractEventLoop | None = None  # while serve() runs
        self._serving: asyncio.Task[None] | None = None
        self._saved_term = self.acceptor.state.term  # the term on disk: see _save
        # Every acceptor transition, with what it flushes, scans, writes, saves and cuts (`_carry_out`).
        self.acceptor_lock = threading.Lock()
        self._stop_lock = threading.Lock()  # one thread says why the safekeeper stopped
        self.fatal: BaseException | None = None  # the error that stops the process
        self.stopped: str | None = None  # why nothing is accepted any more (a full disk, or fatal)
        self.publisher: Publisher | None = None  # with --broker: runs while serving
        self.learner: TermLearner | None = None  # an empty data directory with --peers: runs while serving
        # Lines logged by this safekeeper (bound with node=) also carry its term and flush LSN.
        set_context_provider("node", self._log_context)

    @classmethod
    def open(cls, node_id: int, data_dir: Path, host: str, port: int,
             security: linkauth.Security = None, reader_port: ReaderPort | None = None,
             keep_wal: int | None = None, max_disk_usage: DiskLimit | None = None,
             archive: ArchiveOptions | None = None, slot_limits: SlotLimits = SlotLimits(),
             peers: tuple[str, ...] = (), peer_security: linkauth.Security = None) -> Safekeeper:
        """Load the control file, check the stored WAL and find its end: a safekeeper ready to serve.

        With `peers` (the others' proposer ports), an empty data directory learns its term from them
        before it votes (amnesia.py). Raises ControlFileError, StartupError or SlotsFileError, with a
        message for the operator, when it must not start.
        """
        stats = SafekeeperMetrics(node_id)
        log = get_logger(node=node_id)
        acceptor, storage = open_data_dir(node_id, data_dir, _disk_full_reporter(stats, log), log, len(peers))
        try:
            sk = cls(node_id, data_dir, host, port, security, acceptor, storage, stats, reader_port,
                     keep_wal, max_disk_usage, archive, slot_limits)
        except streamloop.ImplError as e:
            raise StartupError(str(e)) from None
        needed = descriptors_needed(MAX_CONNECTIONS, MAX_READERS if sk.readers is not None else 0)
        try:
            before, soft = raise_descriptor_limit(needed)
        except TooFewDescriptors as e:
            raise StartupError(str(e)) from None
        if soft != before:
            log.info("file descriptor limit raised to the hard limit", soft_limit_was=before, soft_limit=soft,
                     needed=needed)
        if acceptor.amnesic and peers:
            sk.learner = TermLearner(acceptor, peers, peer_security, sk._persist_learned)
        return sk

    @property
    def listening_port(self) -> int | None:
        """The proposer port's number once it listens (a --listen port 0 picks one)."""
        return self._port.port

    @property
    def _stream(self) -> Link | None:
        """The connection of the elected proposer."""
        owner = self.acceptor.owner
        return cast(Link, owner.conn) if isinstance(owner, AcceptorSession) else None

    @property
    def link_security(self) -> str | None:
        """How connections are secured: "tls", "auth-only", or None under --insecure."""
        return "tls" if self.ssl_context else "auth-only" if self.link_auth else None

    @property
    def disk_full(self) -> bool:
        """True once a full disk fenced this safekeeper (it stays up, refusing everything)."""
        return self.stopped is not None and self.fatal is None

    def view(self) -> SafekeeperView:
        """What observers (the monitor) see of this safekeeper now."""
        acc = self.acceptor
        return SafekeeperView(
            node_id=self.node_id, listen=f"{self.host}:{self.port}", link_security=self.link_security,
            state=acc.state, positions=self.positions.value, elected_term=acc.elected_term,
            write_lsn=acc.write_lsn, proposer_connected=self._stream is not None, disk_full=self.disk_full,
            fatal=type(self.fatal).__name__ if self.fatal is not None else None, stopped=self.stopped is not None,
            reader_listen=f"{self.readers.options.host}:{self.readers.port}" if self.readers is not None else None,
            readers=self.readers.connections if self.readers is not None else 0,
            streaming_readers=self.readers.streaming if self.readers is not None else 0,
            slots=tuple(SlotView(s.name, s.restart_lsn, s.timeline, s.temporary, s.active) for s in self.slots),
            broker=self.publisher.view() if self.publisher is not None else None,
            removal_horizon=self.remover.horizon, removal_stopped_by=self.remover.stopped_by,
            disk_guard=self.guard.reason, disk_usage=self.guard.usage,
            archive=(self.uploader.store or self.uploader.root).location if self.uploader is not None else None,
            archive_error=self.uploader.error if self.uploader is not None else None,
            archive_mismatch=self.acceptor.archive_mismatch or None,
            learning_term_from=acc.amnesic_peers, members=acc.members, lost_disk_term=acc.recovering_from)

    # ---- what the reader process is told (readerhost.py) ---------------------------------------

    @property
    def system_id(self) -> int:
        return self.acceptor.state.system_id

    @property
    def wal_seg_size(self) -> int:
        return self.acceptor.state.wal_seg_size

    def reader_state(self) -> ServerState:
        """The published positions, timeline and stored WAL as a reader's cursor sees them."""
        acc, p, st = self.acceptor, self.positions.value, self.storage
        s = acc.state
        # The cuts up to the published generation (the acceptor may be a batch ahead of it).
        cuts = acc.cuts[:max(0, len(acc.cuts) - (acc.cut_generation - p.generation))]
        return ServerState(p.term, p.flush_lsn, p.commit_lsn, p.generation, s.timeline or 1, s.timeline_history,
                           st.first_lsn() if isinstance(st, WalStorage) else None, cuts)

    def pin_wal(self, lsn: int, holder: str) -> WalPin:
        """Keep the stored WAL from `lsn` on from removal until the pin is released (readers, the uploader)."""
        return self.storage.pin(lsn, holder, self.remover.wake)

    # ---- what the uploader (backup.py) reads and changes

    def archive_state(self) -> AcceptorState:
        return self.acceptor.state

    def complete_segment(self, segno: int) -> Path | None:
        st = self.storage
        return st.complete_segment(segno) if isinstance(st, WalStorage) else None

    async def read_partial(self) -> PartialSegment | None:
        """The segment being written, up to flush_lsn, and the term that wrote its last byte; None at a
        segment boundary.

        Bytes below flush_lsn change only by a cut, and every cut comes after an Elected bumped the
        cut generation: so the bytes read are kept only if the generation is the same after the read
        as before it (a sequence lock; the connection threads are never held up by the upload).
        """
        acc, st = self.acceptor, self.storage
        for _ in range(3):  # an Elected in between: take the new flush_lsn
            if not isinstance(st, WalStorage) or not acc.state.term_history:
                return None
            generation, history, end = acc.cut_generation, acc.state.term_history, acc.flush_lsn
            seg = st.seg_size
            start = end - end % seg
            if end == start:
                return None
            data = await asyncio.to_thread(st.read, start, end - start)
            if acc.cut_generation != generation:
                continue
            term = next((e.term for e in reversed(history) if e.start_lsn < end), history[0].term)
            return PartialSegment(segment_file_name(acc.state.timeline, start // seg, seg), term, end,
                                  data + bytes(seg - len(data)))
        return None

    async def backed_up(self, lsn: int) -> None:
        """The archive holds every segment below `lsn`: persist it as backup_lsn."""
        actions = await self.transition(lambda: self.acceptor.on_backed_up(lsn))
        if actions:
            self.remover.wake()  # the horizon may move with backup_lsn

    def archive_mismatch(self, name: str | None) -> None:
        """The uploader found the archived object `name` not to be this safekeeper's WAL (None: no longer)."""
        if name is not None:
            self.stats.archive_mismatches.inc()
        self.acceptor.archive_mismatch = name or ""  # `check` reads it in InfoReply

    def _positions(self) -> Positions:
        acc = self.acceptor
        return Positions(acc.state.term, acc.flush_lsn, acc.state.commit_lsn, acc.cut_generation)

    def positions_moved(self) -> bool:
        """True if the acceptor's positions differ from the published ones (without building a Positions)."""
        acc, p = self.acceptor, self.positions.value
        return acc.flush_lsn != p.flush_lsn or acc.state.commit_lsn != p.commit_lsn or acc.state.term != p.term \
            or acc.cut_generation != p.generation

    def _publish(self) -> None:
        """Publish the acceptor's positions once its actions are carried out, if they moved (under the lock)."""
        if self.positions_moved():
            self.positions.publish(self._positions())

    def _log_context(self, node: object) -> dict[str, object]:
        if node != self.node_id:
            return {}
        return {"term": self.acceptor.state.term, "flush_lsn": format_lsn(self.acceptor.flush_lsn)}

    # ---- serving ----------------------------------------------------------------------------

    async def serve(self) -> None:
        """Listen and serve until cancelled (a signal) or stopped by a fatal error."""
        self._loop = asyncio.get_running_loop()  # before the first connection: _stop may need it
        self._serving = asyncio.current_task()
        try:
            self._port.start()
        except OSError as e:
            raise cannot_listen(self.host, self.port, "the safekeeper (--listen)", e) from e
        self.log.info("listening", address=f"{self.host}:{self._port.port}", tls=self.ssl_context is not None,
                      stream_loop=streamloop.name(self.stream_loop),
                      link_security=self.link_security or "insecure")
        slot_saver = self._background(self.slots.run(), "slot saving")
        publisher = self._background(self.publisher.run(), "publishing") if self.publisher is not None else None
        remover = self._background(self.remover.run(), "WAL removal")
        learner = self._background(self.learner.run(), "term learning") if self.learner is not None else None
        uploader = self._background(self.uploader.run(), "archiving") if self.uploader is not None else None
        try:
            if self.readers is not None:
                await self.readers.start()
                self.acceptor.reader_port = self.readers.port
            if self.fatal is None:
                await asyncio.Event().wait()  # the connections are the port's threads'
        finally:
            # The connection threads end before the storage closes: each may be writing or syncing it.
            # Waited for in a worker, shielded: a second signal must not leave them running.
            closing = asyncio.ensure_future(asyncio.to_thread(self._port.close))
            while not closing.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(closing)
            if self.readers is not None:
                await self.readers.close()
            for task in (slot_saver, remover, *(t for t in (publisher, uploader, learner) if t is not None)):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self.uploader is not None and self.fatal is None:
                await self.uploader.close()
            self.storage.close()
            self.log.info("stopped")  # with the term and the flush acknowledged last (the log context)

    def _background(self, coro: Any, what: str) -> asyncio.Task[None]:
        """A task of the loop's that runs until the safekeeper stops: if it ever ends otherwise, say so."""
        def ended(task: asyncio.Task[None]) -> None:
            if task.cancelled():
                return
            e = task.exception()
            self.log.critical(f"{what} stopped: a bug; restart the safekeeper", error=repr(e),
                              exc_info=(type(e), e, e.__traceback__) if e is not None else None)
        task = asyncio.create_task(coro)
        task.add_done_callback(ended)
        return task

    def _role_of(self, ident: tls.Identity | None) -> Role:
        """What a connection may do: a proposer under --insecure; otherwise what its certificate says."""
        if self.ssl_context is None and self.link_auth is None:
            return Role.PROPOSER
        return Role(ident.role) if ident is not None else Role.CLIENT

    def converse(self, link: Link, ident: tls.Identity | None, place: Place | None, log: Any) -> None:
        """One authenticated connection, in its own thread until it ends: messages in, replies out, and
        for the elected proposer's Appends, group commit (consensus/groupcommit.py)."""
        acc = self.acceptor
        try:
            role = self._role_of(ident)
            session = AcceptorSession(acc, role, conn=link)
        except Exception as e:  # a certificate the hook cannot map: this connection only
            log.warning("connection refused", reason=str(e))
            return
        if place is not None and not place.authenticated(role.value):
            log.warning("connection limit for this role reached; the remaining places are the proposer's",
                        role=role.value, limit=self.budget.others_max)
            return
        self.stats.connections.inc()
        commit = GroupCommit()
        try:
            while True:
                if session.holds_term and self.guard.active:
                    # Not read, not refused: the proposer sees a slow safekeeper and commits go on with
                    # the others; what was received before is still flushed and acknowledged.
                    self._acknowledge(session, link, commit)
                    while not self.guard.wait_resumed(_GUARD_POLL):
                        if self._port.closing or self.stopped is not None:
                            return
                # The elected proposer sends at least a heartbeat a second; anyone else may idle this long.
                link.timeout = None if session.holds_term else IDLE_TIMEOUT
                if self.stream_loop is not None and streamloop.streams(self, session, link):
                    if streamloop.run(self.stream_loop, self, session, link, commit) == streamloop.CONDITION:
                        continue  # the term moved, a stop or the disk guard: looked at above
                msg = link.read()
                if self.fatal is not None:  # exiting: the failure was reported once, where it happened
                    break
                if self.stopped is not None:  # a full disk: say why to whoever asks, change nothing
                    raise AcceptorError(self.stopped)
                if type(msg) is InfoRequest and self.guard.reason is not None:  # `check` and `status` say why
                    raise AcceptorError(self.guard.reason)
                began_segment = acc.write_lsn // seg if (seg := acc.state.wal_seg_size) else 0
                replies = self._receive(session, msg, log)
                if type(msg) is not Append:
                    link.max_frame = session.max_frame
                    seg = acc.state.wal_seg_size  # a greeting may have just set it
                if replies:
                    link.send(replies)
                if seg and acc.write_lsn // seg != began_segment and self.guard.limit is not None:
                    # A new segment file: measured before the next message is read, so the guard
                    # stops within one segment of its limit, not whenever the remover runs next.
                    self.remover.guard_check(self.positions.value)
                if session.holds_term and commit.decide(acc.write_lsn, acc.flush_lsn, link.more_waiting(), False,
                                                        time.monotonic()) is Decision.SYNC_NOW:
                    self._acknowledge(session, link, commit)
        except IdleTimeout:
            log.info("idle connection closed", idle_seconds=IDLE_TIMEOUT)
        except ConnectionError as e:
            log.info("connection closed", reason=str(e) or type(e).__name__, role=session.role.value)
        except (AcceptorError, codec.FieldError) as e:  # a FieldError is well-formed: the peer is told why
            log.warning("message refused; closing the connection", reason=str(e), term=acc.state.term)
            with contextlib.suppress(ConnectionError):
                link.send(codec.encode(Refusal(str(e)[:1000])))
        except codec.ProtocolError as e:
            log.warning("malformed message; closing the connection", reason=str(e))
        except _OwnEncodeError as e:
            log.error("cannot encode this safekeeper's reply; closing the connection", reason=str(e))
        except Exception as e:  # a storage or control-file failure: state may be half-applied
            self._stop(e, log)
        finally:
            with self.acceptor_lock:
                session.closed()

    def _receive(self, session: AcceptorSession, msg: Message, log: Any) -> bytes:
        """One message as one transition; its replies, encoded, to send once the lock is let go."""
        if type(msg) is Append:  # the hot path: nothing to log or count
            with self.acceptor_lock:
                return self._carry_out(session.receive(msg))
        acc = session.acceptor
        with self.acceptor_lock:
            # A vote or Elected is one step with its flush and scan (docs/protocol.md, invariant 3):
            # writes and acknowledgements take the same lock, so nothing is acknowledged in the old
            # term between the scan and the promise or the cut, and a safekeeper never reports less
            # than it acknowledged, which quorum intersection needs.
            end = self._flushed_record_end() if session.needs_record_end(msg) else None
            actions = session.receive(msg, end)
            replies = self._carry_out(actions)
            elected = type(msg) is Elected and session.holds_term and acc.elected_term == msg.term
        match msg:
            case Greeting():
                log.info("greeting", proposer=msg.proposer_id, term=acc.state.term)
            case VoteRequest():
                granted = any(type(a) is Persist for a in actions)
                flush = next((a.message.flush_lsn for a in actions
                              if isinstance(a, Reply) and isinstance(a.message, VoteReply)), 0)
                log.info("vote", term=msg.term, granted=granted, flush_lsn=format_lsn(flush))
                if msg.term:  # term 0 is the proposer's pre-vote probe, not a vote
                    (self.stats.votes_granted if granted else self.stats.votes_refused).inc()
            case Elected() if elected:
                self.stats.elections.inc()
                log.info("elected", term=msg.term, start_lsn=format_lsn(msg.start_lsn),
                         truncate_lsn=format_lsn(acc.write_lsn))
        return replies

    def _wrote_in_place(self, lsn: int, end: int, commit_lsn: int, horizon_lsn: int) -> None:
        """The compiled stream loop wrote an Append's data from `lsn` to `end` itself, under the acceptor
        lock, having checked what `Acceptor.on_append` checks: the rest of that Append's transition."""
        st = self.storage
        assert isinstance(st, WalStorage)
        st.wrote(lsn, end)
        self.stats.wal_written.inc(end - lsn)
        actions = self.acceptor.appended(end, commit_lsn, horizon_lsn)
        if actions:  # commit_lsn persisted, once a segment
            self._carry_out(actions)
        else:
            self._publish()

    def _acknowledge(self, session: AcceptorSession, link: Link, commit: GroupCommit) -> None:
        """fdatasync what was written, then acknowledge it, if this connection still holds the term."""
        st = self.storage
        if not isinstance(st, WalStorage) or self.acceptor.flush_lsn >= self.acceptor.write_lsn:
            return
        began = time.perf_counter()
        flushed = st.flush()  # outside the lock: a vote's scan waits for the decision below, not the sync
        commit.synced()
        self.stats.fsync.observe(time.perf_counter() - began)
        with self.acceptor_lock:
            # Decided under the lock a vote or Elected holds through its scan: once another
            # connection took the term nothing is sent, and once a higher term was promised the
            # reply carries it, which the old proposer does not count (the vote may have reported less).
            if not session.holds_term:
                return
            replies = self._carry_out(self.acceptor.on_flushed(flushed))
        link.send(replies)

    async def transition(self, event: Callable[[], list[AcceptorAction]]) -> list[AcceptorAction]:
        """An acceptor transition from the event loop (no connection's): `event()` and its actions under
        the acceptor lock, in a worker so that the loop never waits for a connection's write or sync."""
        def step() -> list[AcceptorAction]:
            with self.acceptor_lock:
                actions = event()
                self._carry_out(actions)
                return actions
        return await asyncio.to_thread(step)

    def _carry_out(self, actions: list[AcceptorAction]) -> bytes:
        """Carry out a transition's actions in order (under the acceptor lock, so that saves and cuts
        follow the transitions' order), publish the positions they moved; the replies, encoded."""
        if self.readers is not None:  # before a cut is made: a read that races it is thrown away
            self.readers.cut_coming(self.acceptor.cut_generation)
        replies = []
        for a in actions:
            match a:
                case Write():
                    self._storage_for_write().write(a.lsn, a.data)
                    self.stats.wal_written.inc(len(a.data))
                case Reply():
                    message = a.message
                    if type(message) is InfoReply:  # the core knows no slots: `check` reads them here
                        message = replace(message, slot_wal_limit=self.slots.limits.max_wal_keep or 0,
                                          slots=self.slots.holding(self.positions.value.flush_lsn))
                    replies.append(_encode_own(message))
                case Persist():
                    self._save(a.state)
                case Truncate():
                    st = self._storage_for_write()
                    (st.truncate if st.segments() else st.open_at)(a.lsn)
                case AdoptTimeline():
                    self._storage_for_write().adopt_timeline(a.timeline, a.history)
                    self.log.info("following the primary's timeline", timeline=a.timeline,
                                  switches=[f"{e.timeline}@{format_lsn(e.switch_lsn)}" for e in a.history])
                case _:
                    raise AssertionError(f"the safekeeper does not know the action {a!r}")
        self._publish()
        return b"".join(replies)

    def _save(self, state: AcceptorState) -> None:
        """Save `state` (under the acceptor lock), unless a higher term is on disk already.

        Transitions are saved in their order, so an older state should never come after a newer
        one; were one to, saving it would put the disk's term below a promise made, and a restart
        could promise that term again. Each state holds all of the ones before it.
        """
        if state.term < self._saved_term:
            self.log.info("not saving a state older than a promise on disk", term=state.term,
                          saved_term=self._saved_term)
            return
        save_control(self.data_dir, ControlData(self.node_id, state))
        self._saved_term = state.term

    async def _persist_learned(self, event: Callable[[], list[AcceptorAction]]) -> list[AcceptorAction]:
        """The term learned from the peers: a transition like any other."""
        try:
            return await self.transition(event)
        except AcceptorError:  # a peer's impossible term: the learner asks again
            raise
        except Exception as e:  # the acceptor may already vote on a term the disk does not hold
            self._stop(e, self.log)
            return []

    def _storage_for_write(self) -> WalStorage:
        st = self.storage
        if isinstance(st, NoWal):  # the first Write or Truncate: the greeting gave the segment size
            s = self.acceptor.state
            st = self.storage = WalStorage(self.data_dir / "wal", s.wal_seg_size, s.timeline,
                                           _disk_full_reporter(self.stats, self.log), s.timeline_history)
        return st

    def _flushed_record_end(self) -> RecordEnd:
        """Sync the WAL and find the end of its last complete record (under the acceptor lock)."""
        st = self.storage
        if isinstance(st, NoWal):
            return RecordEnd(0)
        st.flush()
        # The scan may step back over segments the remover would otherwise take from under it.
        with st.pin(st.first_lsn() or 0, "the end-of-WAL scan of a vote"):
            return record_end(st, self.acceptor.state)

    def _stop(self, e: BaseException, log: Any) -> None:
        """Stop for good after a storage or control-file failure, saying why once (from any thread).

        A full disk leaves the process up but refusing everything, so `check`, /health and the
        metrics say why; any other failure (an fdatasync above all, as PostgreSQL PANICs)
        stops the process.
        """
        with self._stop_lock:
            if self.stopped is not None:
                return
            st = self.storage
            if is_disk_full(e) and not isinstance(e, WalInDoubt):
                if not isinstance(e, DiskFull):  # a WAL write's was counted where it happened
                    self.stats.disk_full.inc()
                self.stopped = str(e) if str(e).startswith("disk full") else f"disk full: {e}"
                log.critical("disk full: no longer acknowledging WAL; free space, then restart the safekeeper",
                             error=self.stopped,
                             flush_lsn=format_lsn(st.flush_lsn) if isinstance(st, WalStorage) else None)
                return
            self.stopped = f"stopped after a fatal error: {e}"
            self.fatal = e
            doubt = {}
            if isinstance(st, WalStorage) and _leaves_wal_in_doubt(e):
                # Whatever failed (a control-file fsync as much as the WAL's), this process's view of
                # the WAL above its last good flush is not to be trusted at the next start either.
                st.mark_in_doubt(str(e))
                doubt = {"in_doubt_from": format_lsn(st.flush_lsn), "in_doubt_to": format_lsn(st.write_lsn)}
            log.critical("fatal error; stopping the safekeeper", error=str(e), **doubt)
        loop, serving = self._loop, self._serving
        if loop is not None and serving is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended: serve() is over already
                loop.call_soon_threadsafe(serving.cancel)


def _leaves_wal_in_doubt(e: BaseException) -> bool:
    """True for an I/O failure of the storage or the control file, after which the page cache may
    have dropped WAL written but not synced; False for running out of descriptors (an open or a
    dup failed, nothing written was lost) and for anything that is not I/O (a bug), which a restart
    recovers from as from a crash, by scanning the WAL."""
    chain: list[BaseException] = []
    cause: BaseException | None = e
    while cause is not None and len(chain) < 16:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(isinstance(c, OSError) and c.errno in _NO_DESCRIPTORS for c in chain):
        return False
    return any(isinstance(c, (StorageError, OSError)) for c in chain)


def _disk_full_reporter(stats: SafekeeperMetrics, log: Any) -> Callable[[str], None]:
    """What storage calls when a write found the disk full (the WAL, the spare segment), or the spare failed."""
    def report(what: str) -> None:
        if what.startswith("disk full"):
            stats.disk_full.inc()
        if "spare" in what:  # not fatal by itself: the WAL's own write says whether it is
            log.warning(what + "; the next segment may fail too")
    return report


def _encode_own(msg: Message) -> bytes:
    """Encode a message of ours; a failure is this safekeeper's fault, not the peer's."""
    try:
        return codec.encode(msg)
    except codec.ProtocolError as e:
        raise _OwnEncodeError(str(e)) from None


class _OwnEncodeError(Exception):
    """A reply this safekeeper built cannot be encoded (a bug or a limit missed on the way in)."""

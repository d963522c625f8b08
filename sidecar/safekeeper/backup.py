"""The uploader: committed, completed WAL segments and timeline history files to the archive.

Layout under the `--archive` URL: `<cluster>/<system id>/wal/<PostgreSQL's file name>`, so restore_command
tooling, `walsidecar analyze` and `verify-archive` read it as they read pg_wal. Only segments wholly below
commit_lsn are uploaded: one above it may still be cut by a later term. backup_lsn (persisted through the
acceptor) is the end of the archived prefix; it moves segment by segment, in order, also when another
safekeeper did the upload, but only over objects known to hold this safekeeper's WAL: its own copy passes
the WAL checks (wal/verify.py) before it goes up, the store verifies what it wrote, and an object found
there is compared with that copy. WAL is removed below backup_lsn, so the archive is trusted for nothing
it cannot prove. The segment being written goes up as `<name>.term-T.end-X-Y.partial` when a
term ends and at shutdown, a name no complete segment has.

One uploader at a time, chosen by an `UploadElection`: with --broker the holder of the broker's upload
lease (broker.LeaseElection), without one by rank (RankElection). A race is harmless (puts of the same bytes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sidecar.archivedwal import default_cluster, partial_name, wal_prefix
from sidecar.consensus.state import AcceptorState
from sidecar.logs import get_logger
from sidecar.lsn import format_lsn, segment_file_name
from sidecar.objectstore import ObjectConflict, Storage, sha256
from sidecar.pgrepl import format_timeline_history, history_file_name, history_up_to, timeline_of
from sidecar.safekeeper.positions import PositionWatch
from sidecar.wal.format import LONG_PAGE_HEADER, XLOG_PAGE_MAGIC, XLP_LONG_HEADER, WalFormatError
from sidecar.wal.verify import check_segment_wal

RETRY = 1.0  # seconds between looks at the archive while another safekeeper should upload
MAX_BACKOFF = 30.0  # seconds, after repeated failures of the archive
SHUTDOWN_UPLOAD = 15.0  # seconds the partial segment's upload may hold up a shutdown


class ArchiveMismatch(Exception):
    """The object under a committed segment's name is not the WAL this safekeeper holds for it: it is not
    counted as archived (so nothing from it on is removed here), and it is left as it is for an operator."""

    def __init__(self, name: str, lsn: int, ours: str | None, theirs: str, why: str) -> None:
        super().__init__(f"the archived {name} is not this safekeeper's WAL of it: {why}")
        self.name, self.lsn, self.ours, self.theirs = name, lsn, ours, theirs


class SegmentDamaged(Exception):
    """This safekeeper's own copy of a committed segment fails the WAL checks: never uploaded, never removed."""

    def __init__(self, name: str, lsn: int, why: str) -> None:
        super().__init__(f"this safekeeper's {name} fails the WAL checks: {why}")
        self.name, self.lsn, self.why = name, lsn, why


class UploadElection(Protocol):
    """Who uploads (a broker's lease, or ranks): asked before each upload of a committed segment the archive
    lacks, and told of each one found already archived by someone else."""

    def may_upload(self, segment_start_lsn: int) -> bool: ...

    def seen_archived(self, segment_start_lsn: int) -> None: ...


class RankElection:
    """Without a broker: safekeeper 1 uploads at once; safekeeper N once the archive has lacked what it needs
    for (N-1) x `takeover` seconds, counted from the first lack seen after the last segment someone else
    uploaded. Having taken over it goes on uploading at once, until it finds a segment uploaded by another
    (a lower id is back): then it waits again.

    Ids need not be dense: a missing id only delays the next one. The clock is per process, so a restart
    starts the wait again; that delays a takeover, it never brings two different uploads.
    """

    def __init__(self, node_id: int, takeover: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.wait = (node_id - 1) * takeover
        self.clock = clock
        self._missing_since: float | None = None

    def may_upload(self, segment_start_lsn: int) -> bool:
        now = self.clock()
        if self._missing_since is None:
            self._missing_since = now
        return now - self._missing_since >= self.wait

    def seen_archived(self, segment_start_lsn: int) -> None:
        self._missing_since = None


@dataclass(frozen=True)
class ArchiveOptions:
    """--archive, --s3-endpoint, --cluster and --archive-takeover."""

    url: str
    s3_endpoint: str | None = None
    cluster: str | None = None
    takeover: float = 30.0


@dataclass(frozen=True)
class PartialSegment:
    """The segment being written: its file name, the term that wrote its last byte, where its WAL ends, the bytes."""

    name: str
    term: int
    end_lsn: int
    data: bytes  # the whole segment size, zeros after end_lsn


class Archived(Protocol):
    """What the uploader needs of a safekeeper (sidecar.safekeeper.server.Safekeeper)."""

    node_id: int
    positions: PositionWatch

    def archive_state(self) -> AcceptorState: ...

    def complete_segment(self, segno: int) -> Path | None: ...

    def pin_wal(self, lsn: int, holder: str) -> AbstractContextManager[object]: ...

    async def read_partial(self) -> PartialSegment | None: ...

    async def backed_up(self, lsn: int) -> None: ...

    def archive_mismatch(self, name: str | None) -> None: ...


def first_archived_lsn(state: AcceptorState) -> int:
    """The first segment this cluster's safekeepers hold whole: the one the first term starts in (at its start)."""
    seg = state.wal_seg_size
    start = state.term_history[0].start_lsn
    return -(-start // seg) * seg


def check_segment(data: bytes, lsn: int, seg_size: int, system_id: int) -> str | None:
    """Why `data` is not a whole segment starting at `lsn` of this system; None when it is."""
    if len(data) != seg_size:
        return f"{len(data)} bytes, not {seg_size}"
    magic, info, _, pageaddr, _, sysid, size, _ = LONG_PAGE_HEADER.unpack_from(data)
    if magic != XLOG_PAGE_MAGIC or not info & XLP_LONG_HEADER or pageaddr != lsn:
        return f"no long page header for {format_lsn(lsn)} at its start"
    if sysid != system_id or size != seg_size:
        return f"system identifier {sysid} / segment size {size} differ from {system_id} / {seg_size}"
    return None


class Uploader:
    """Uploads a safekeeper's committed WAL while it serves; `close()` uploads the partial segment."""

    def __init__(self, sk: Archived, store: Storage, election: UploadElection, cluster: str | None = None,
                 on_upload: Callable[[int], None] | None = None) -> None:
        self.sk = sk
        self.root = store
        self.election = election
        self.cluster = cluster
        self.on_upload = on_upload or (lambda n: None)
        self.log = get_logger(node=sk.node_id, archive=store.location)
        self.store: Storage | None = None  # the cluster's wal/ once the system id is known
        self.error: str | None = None  # the last failure, until an upload succeeds
        self._histories: set[str] = set()
        self._partial: tuple[int, int] | None = None  # (term, end) of the last partial uploaded
        self._waiting: int | None = None  # segment start another safekeeper should upload
        self._not_whole: int | None = None  # the last segment found not held whole here (logged once)
        self.mismatch: ArchiveMismatch | None = None  # the object backup_lsn stops at, until it is verified
        self._mismatches: set[tuple[str, str]] = set()  # (object, its SHA-256) reported to the safekeeper

    # ---- the loop

    async def run(self) -> None:
        """Upload what becomes ready until cancelled; archive failures are retried with back-off."""
        backoff = RETRY
        term = self.sk.positions.value.term
        while True:
            try:
                now = self.sk.positions.value.term
                if now > term:  # the previous term ended here: its partial segment first
                    await self.upload_partial()
                    term = now
                ready = await self._upload_ready()
                self.error, backoff = None, RETRY
            except Exception as e:  # the archive, or a segment that cannot be read: try again later
                self.error = f"{type(e).__name__}: {e}"
                self._failed(e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            if ready is None:
                await self.sk.positions.changed()
            else:
                # A wait for commit_lsn to pass `ready`, or for a term change; a timer while another
                # safekeeper is the uploader, to see whether it did.
                await self._until(ready, RETRY if self._waiting is not None else None)

    def _failed(self, e: Exception, backoff: float) -> None:
        backup = format_lsn(self.sk.archive_state().backup_lsn)
        if isinstance(e, ArchiveMismatch):
            # Retried with the back-off: an operator who removes the object lets ours go up in its place.
            self.log.error("archived object differs from this safekeeper's segment; it is not counted as "
                           "archived and no WAL from it on is removed here", segment=e.name, lsn=format_lsn(e.lsn),
                           object=f"{self.store.location if self.store else self.root.location}/{e.name}",
                           sha256_here=e.ours, sha256_archived=e.theirs, error=str(e), backup_lsn=backup,
                           retry_seconds=backoff)
            self.mismatch = e
            if (e.name, e.theirs) not in self._mismatches:
                self._mismatches.add((e.name, e.theirs))
                self.sk.archive_mismatch(e.name)
        elif isinstance(e, SegmentDamaged):
            self.log.error("segment fails the WAL checks on this safekeeper; not uploaded, and no WAL from it on "
                           "is removed here", segment=e.name, lsn=format_lsn(e.lsn), reason=e.why, backup_lsn=backup,
                           retry_seconds=backoff)
        else:
            self.log.error("archiving failed; retrying", error=self.error, retry_seconds=backoff, backup_lsn=backup)

    async def _until(self, lsn: int, timeout: float | None) -> None:
        term = self.sk.positions.value.term
        wait = self.sk.positions.wait(lambda p: p.commit_lsn >= lsn or p.term != term)
        if timeout is None:
            await wait
        else:
            try:
                await asyncio.wait_for(wait, timeout)
            except asyncio.TimeoutError:
                pass

    async def _upload_ready(self) -> int | None:
        """Upload every ready segment in order; the commit_lsn the next one waits for (None: no WAL yet)."""
        state = self.sk.archive_state()
        if not state.system_id or not state.wal_seg_size or not state.term_history:
            return None
        seg = state.wal_seg_size
        store = self._store(state)
        await self._upload_histories(store, state)
        lsn = max(state.backup_lsn, first_archived_lsn(state))
        self._waiting = None
        while lsn + seg <= self.sk.positions.value.commit_lsn:
            if not await self._segment(store, self.sk.archive_state(), lsn):
                self._waiting = lsn
                return lsn + seg
            lsn += seg
            # Cleared before backup_lsn moves past it: nobody sees the segment archived and still reported.
            if self.mismatch is not None and self.mismatch.lsn < lsn:
                self.log.info("the archived object now matches this safekeeper's segment", segment=self.mismatch.name)
                self.mismatch, self._mismatches = None, set()
                self.sk.archive_mismatch(None)
            await self.sk.backed_up(lsn)
        return lsn + seg

    def _store(self, state: AcceptorState) -> Storage:
        if self.store is None:
            cluster = self.cluster or default_cluster(state.system_id)
            self.store = self.root.child(wal_prefix(cluster, state.system_id))
            self.log = self.log.bind(archive=self.store.location)
        return self.store

    async def _segment(self, store: Storage, state: AcceptorState, lsn: int) -> bool:
        """Make sure the archive holds the committed segment at `lsn`, as this safekeeper knows it; False while
        it lacks it and we may not upload. ArchiveMismatch when the object there is not that WAL, SegmentDamaged
        when our own copy fails the WAL checks: either way backup_lsn stays below it."""
        seg = state.wal_seg_size
        segno = lsn // seg
        path = self.sk.complete_segment(segno)
        tli = timeline_of(state.timeline_history, state.timeline, lsn + seg - 1)
        name = path.name if path is not None else segment_file_name(tli, segno, seg)
        size = await asyncio.to_thread(store.head, name)
        if size is None and (path is None or not self.election.may_upload(lsn)):
            return False
        data = None
        if path is not None:
            with self.sk.pin_wal(lsn, "the uploader"):  # removal stops below backup_lsn anyway; this says so
                data = await asyncio.to_thread(path.read_bytes)
            bad = check_segment(data, lsn, seg, state.system_id)
            if bad is not None:
                # Not held whole here (this safekeeper joined inside it): another one uploads it.
                if self._not_whole != lsn:
                    self._not_whole = lsn
                    self.log.warning("segment not held whole here; leaving it to another safekeeper",
                                     segment=name, reason=bad, lsn=format_lsn(lsn))
                if size is None:
                    return False
            else:
                return await self._put(store, name, lsn, tli, state, data, size)
        await self._adopt(store, name, lsn, tli, state, data)
        self.election.seen_archived(lsn)
        return True

    async def _put(self, store: Storage, name: str, lsn: int, tli: int, state: AcceptorState, data: bytes,
                   size: int | None) -> bool:
        """Upload our whole copy, or adopt the object there (`size`: its size, if seen) if it holds the same bytes."""
        seg = state.wal_seg_size
        try:
            # A bit flipped on this disk must not reach the archive, where every safekeeper would trust it.
            await asyncio.to_thread(check_segment_wal, data, lsn, seg, system_id=state.system_id, timeline=tli)
        except WalFormatError as e:
            raise SegmentDamaged(name, lsn, str(e)) from None
        began = time.perf_counter()
        try:
            if size is None:
                wrote = await asyncio.to_thread(store.put, name, data)
            else:  # another safekeeper's upload: compared without sending ours
                wrote = False
                await asyncio.to_thread(store.compare, name, data)
        except ObjectConflict as e:
            raise ArchiveMismatch(name, lsn, e.ours, e.theirs, "its bytes differ from this safekeeper's") from None
        if wrote:
            self.on_upload(len(data))
        else:
            self.election.seen_archived(lsn)
        self.log.info("segment archived" if wrote else "segment already archived, the same bytes", segment=name,
                      end_lsn=format_lsn(lsn + seg), seconds=round(time.perf_counter() - began, 3))
        await self._drop_partials(store, name)
        return True

    async def _adopt(self, store: Storage, name: str, lsn: int, tli: int, state: AcceptorState,
                     held: bytes | None) -> None:
        """An object uploaded by another safekeeper, of a segment not held whole here: it must be valid WAL of
        this segment, and hold what we hold of it (`held`: zeros before where this safekeeper's WAL begins)."""
        seg = state.wal_seg_size
        data = await asyncio.to_thread(store.read, name)
        try:
            await asyncio.to_thread(check_segment_wal, data, lsn, seg, system_id=state.system_id, timeline=tli)
        except WalFormatError as e:
            raise ArchiveMismatch(name, lsn, None, sha256(data).hex(), f"it fails the WAL checks: {e}") from None
        if held is not None:
            start = len(held) - len(held.lstrip(b"\0"))  # where this safekeeper's WAL begins
            if data[start:] != held[start:]:
                raise ArchiveMismatch(name, lsn, sha256(held[start:]).hex(), sha256(data[start:]).hex(),
                                      f"its bytes from {format_lsn(lsn + start)} differ from this safekeeper's")

    async def _drop_partials(self, store: Storage, name: str) -> None:
        """The partial objects of segment `name`, now archived whole: its committed bytes are all there.

        Only partials under the same name: one of a timeline the cluster left stays, as PostgreSQL
        keeps its own `.partial` file at a promotion.
        """
        partials = [k for k in await asyncio.to_thread(store.list, f"{name}.term-") if k.endswith(".partial")]
        for key in partials:
            await asyncio.to_thread(store.delete, key)
        if partials:
            self.log.info("partial segments dropped: the segment is archived whole", segment=name,
                          dropped=len(partials))

    async def _upload_histories(self, store: Storage, state: AcceptorState) -> None:
        """The .history file of every timeline this WAL went through, once its switch is committed."""
        commit = self.sk.positions.value.commit_lsn
        history = state.timeline_history
        for tli in {e.timeline for e in history[1:]} | {state.timeline}:
            name = history_file_name(tli)
            leading = history_up_to(history, tli)
            if tli <= 1 or name in self._histories or not leading or leading[-1].switch_lsn > commit:
                continue
            await asyncio.to_thread(store.put, name, format_timeline_history(leading).encode())
            self._histories.add(name)
            self.log.info("timeline history archived", file=name)

    # ---- the partial segment

    async def upload_partial(self) -> None:
        """Upload the segment being written, up to flush_lsn, under a name giving its term and end."""
        part = await self.sk.read_partial()
        state = self.sk.archive_state()
        if part is None or (part.term, part.end_lsn) == self._partial or not state.system_id:
            return
        store = self._store(state)
        if await asyncio.to_thread(store.head, part.name) == state.wal_seg_size:
            return  # archived whole already (this safekeeper lags): nothing a partial would add
        name = partial_name(part.name, part.term, part.end_lsn)
        await asyncio.to_thread(store.put, name, part.data)
        self._partial = (part.term, part.end_lsn)
        self.log.info("partial segment archived", file=name, term=part.term, end_lsn=format_lsn(part.end_lsn))

    async def close(self) -> None:
        """At shutdown: the partial segment, within SHUTDOWN_UPLOAD seconds (a stuck archive must not hang it)."""
        try:
            await asyncio.wait_for(self.upload_partial(), SHUTDOWN_UPLOAD)
        except Exception as e:
            self.log.warning("partial segment not archived at shutdown", error=f"{type(e).__name__}: {e}")


def uploader_for(sk: Archived, url: str, s3_endpoint: str | None, cluster: str | None, takeover: float,
                 on_upload: Callable[[int], None] | None = None) -> Uploader:
    """The uploader for `--archive URL`, elected by rank (no broker)."""
    from sidecar.objectstore import open_storage
    return Uploader(sk, open_storage(url, s3_endpoint=s3_endpoint), RankElection(sk.node_id, takeover), cluster,
                    on_upload)


__all__ = ["ArchiveMismatch", "ArchiveOptions", "Archived", "SegmentDamaged", "PartialSegment", "RankElection", "UploadElection", "Uploader",
           "uploader_for"]

"""Named physical reader slots: where each reader's WAL was flushed, kept in the data directory.

`CREATE_REPLICATION_SLOT ... PHYSICAL` (or `walsidecar readers slot create`) makes one; a reader
streaming with `START_REPLICATION SLOT s` moves it with the flush position of its standby status,
saved at most once per SAVE_INTERVAL (as PostgreSQL saves slots at checkpoints, a crash may move
a slot back a little, never forward). Temporary slots live as long as their connection, which alone
may use or drop them, and are never saved. They bound WAL removal (horizon.py): `on_change` tells
the remover when one moves. As PostgreSQL's max_slot_wal_keep_size, a slot that would hold more
than `SlotLimits.max_wal_keep` behind the flush position is invalidated (`invalidate_beyond`): it
holds nothing from then on and cannot be streamed from again; only dropping it frees its name.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.consensus.messages import SlotHold
from sidecar.consensus.reading import ServerState, readable_end
from sidecar.lsn import format_lsn, parse_lsn
from sidecar.pgrepl import ReplicationProtocolError, check_slot_name, timeline_of
from sidecar.durable import write_durably

FILE_NAME = "slots.json"
SAVE_INTERVAL = 1.0  # seconds between saves of positions moved by standby status
MAX_SLOTS = 100
MAX_SLOTS_PER_READER = 10
MAX_WAL_KEEP = 10 << 30  # PostgreSQL's usual advice for max_slot_wal_keep_size


@dataclass(frozen=True)
class SlotLimits:
    """What readers may hold: slots per safekeeper and per reader name, and WAL behind the flush per slot."""

    max_slots: int = MAX_SLOTS
    per_reader: int = MAX_SLOTS_PER_READER
    max_wal_keep: int | None = MAX_WAL_KEEP  # None: no bound


class SlotError(Exception):
    """A slot operation that cannot be done; `sqlstate` is what the reader is told."""

    def __init__(self, message: str, sqlstate: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class SlotsFileError(Exception):
    """The slots file cannot be read; the message names it."""


@dataclass
class Slot:
    name: str
    restart_lsn: int  # 0: no WAL reserved yet
    timeline: int  # of restart_lsn; 0 with it
    temporary: bool = False
    active: bool = False  # a connection streams with it
    reader: str = ""  # the reader name that created it ("" for slots older than the per-reader cap)
    invalidated: bool = False  # it held more than max_wal_keep: it holds nothing now
    owner: object | None = field(default=None, compare=False, repr=False)  # a temporary slot's connection

    @property
    def holds(self) -> int:
        """The LSN below which it keeps WAL from removal; 0 for none."""
        return 0 if self.invalidated else self.restart_lsn


INVALIDATED_DETAIL = "This slot has been invalidated because it exceeded the maximum reserved size " \
                     "(--max-slot-wal-keep-size)."


def reserve_from(s: ServerState) -> tuple[int, int]:
    """Where `CREATE_REPLICATION_SLOT ... RESERVE_WAL` reserves from, and its timeline: (0, 0) for nothing.

    What a reader may read now; before this safekeeper knows a commit (just after a start) nothing
    is readable yet, and the slot reserves from the oldest WAL held, more than needed, never less.
    """
    lsn = readable_end(s) or s.first_lsn or 0
    return lsn, timeline_of(s.history, s.timeline, lsn) if lsn else 0


class Slots:
    """The slots of one safekeeper; changes are saved durably (creation and removal at once).

    Thread contract: everything runs on the event loop, except that iterating (`holding`, for an
    InfoReply) may run in a proposer-port connection's thread at any time; it reads a copy.
    """

    def __init__(self, data_dir: Path, limits: SlotLimits = SlotLimits()) -> None:
        self.path = data_dir / FILE_NAME
        self.limits = limits
        self._slots: dict[str, Slot] = {}
        self._dirty = asyncio.Event()
        self._saving = asyncio.Lock()  # saves write through one temporary file: one at a time
        self.on_change: Callable[[], None] = lambda: None  # a slot moved, came or went
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            doc = json.loads(self.path.read_text())
            for entry in doc["slots"]:
                name = check_slot_name(entry["name"])
                lsn = parse_lsn(entry["restart_lsn"]) if entry.get("restart_lsn") else 0
                self._slots[name] = Slot(name, lsn, int(entry.get("timeline") or 0), reader=str(entry.get("reader") or ""),
                                         invalidated=bool(entry.get("invalidated")))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SlotsFileError(f"cannot read the reader slots in {self.path}: {e}") from None

    def __iter__(self):  # noqa: ANN204 - an iterator of Slot
        # list() copies in one step under the GIL: `check`'s InfoReply iterates from a connection thread.
        return iter(sorted(list(self._slots.values()), key=lambda s: s.name))

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, name: str) -> Slot | None:
        return self._slots.get(name)

    def _doc(self) -> bytes:
        slots = [{"name": s.name, "restart_lsn": format_lsn(s.restart_lsn) if s.restart_lsn else None,
                  "timeline": s.timeline or None, **({"reader": s.reader} if s.reader else {}),
                  **({"invalidated": True} if s.invalidated else {})} for s in self if not s.temporary]
        return json.dumps({"slots": slots}, indent=1).encode() + b"\n"

    async def save(self) -> None:
        """Write every persistent slot durably, in a thread; one save at a time (the slot saver, a slot's
        creation and the remover's invalidation all save, through the same temporary file)."""
        async with self._saving:
            self._dirty.clear()
            await asyncio.to_thread(write_durably, self.path, self._doc())

    async def create(self, name: str, temporary: bool, restart_lsn: int, timeline: int, reader: str = "",
                     owner: object | None = None) -> Slot:
        """A new slot of reader `reader`, saved before this returns unless temporary; SlotError if it exists
        or a cap is reached. A temporary slot is held by `owner` (its connection) until released."""
        try:
            check_slot_name(name)
        except ReplicationProtocolError as e:
            raise SlotError(str(e), "42602") from None
        if name in self._slots:
            raise SlotError(f'replication slot "{name}" already exists', "42710")
        if len(self._slots) >= self.limits.max_slots:
            raise SlotError(f"all replication slots are in use (at most {self.limits.max_slots})", "53400")
        # Per name, so that one reader's password cannot take every place from the others.
        if reader and sum(s.reader == reader for s in self._slots.values()) >= self.limits.per_reader:
            raise SlotError(f'reader "{reader}" has all the replication slots it may have (at most '
                            f"{self.limits.per_reader}); drop one first", "53400")
        slot = self._slots[name] = Slot(name, restart_lsn, timeline if restart_lsn else 0, temporary, reader=reader,
                                        owner=owner if temporary else None)
        if not temporary:
            try:
                await self.save()
            except BaseException:
                del self._slots[name]
                raise
        self.on_change()
        return slot

    async def drop(self, name: str, owner: object | None = None) -> None:
        """Remove a slot not in use (by another connection than `owner`); SlotError if missing or active."""
        slot = self.acquire_check(name, owner)
        del self._slots[name]
        self.on_change()
        if not slot.temporary:
            await self.save()

    def acquire_check(self, name: str, owner: object | None = None) -> Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise SlotError(f'replication slot "{name}" does not exist', "42704")
        # A temporary slot stays its connection's for that connection's life, as PostgreSQL's active_pid.
        if slot.active or (slot.owner is not None and slot.owner != owner):
            raise SlotError(f'replication slot "{name}" is active for another connection', "55006")
        return slot

    async def lookup(self, name: str) -> Slot | None:
        """`get` for a reader connection (the reader process asks across its link)."""
        return self.get(name)

    async def acquire(self, name: str, owner: object | None = None) -> Slot:
        """Mark the slot in use by one stream; SlotError if missing, in use, or invalidated."""
        slot = self.acquire_check(name, owner)
        if slot.invalidated:
            raise SlotError(f'can no longer get changes from replication slot "{name}": {INVALIDATED_DETAIL}',
                            "55000")
        slot.active = True
        return slot

    def release(self, slot: Slot) -> None:
        """A stream with the slot ended; a temporary slot's connection ended: the slot goes."""
        slot.active = False
        # By identity: the name may be another slot's by now (this one dropped, and the name taken again).
        if slot.temporary and self._slots.get(slot.name) is slot:
            del self._slots[slot.name]
            self.on_change()

    def stream_ended(self, slot: Slot) -> None:
        """A stream with the slot ended: released, but a temporary slot stays its connection's until that ends."""
        if slot.temporary:
            slot.active = False
        else:
            self.release(slot)

    def holding(self, flush_lsn: int) -> tuple[SlotHold, ...]:
        """The slots that hold WAL or were invalidated, with what they hold behind `flush_lsn`, for `check`."""
        return tuple(SlotHold(s.name, max(flush_lsn - s.holds, 0) if s.holds else 0, s.invalidated)
                     for s in self if s.holds or s.invalidated)

    def invalidate_beyond(self, flush_lsn: int) -> list[tuple[Slot, int]]:
        """Invalidate the slots holding more than `limits.max_wal_keep` behind `flush_lsn`; each with what it held.

        Saved at the next save; the remover saves before it removes what they held.
        """
        keep = self.limits.max_wal_keep
        if keep is None:
            return []
        out = []
        for slot in self._slots.values():
            if slot.holds and flush_lsn - slot.holds > keep:
                out.append((slot, flush_lsn - slot.holds))
                slot.invalidated = True
        if out:
            self._dirty.set()
            self.on_change()
        return out

    def advance(self, slot: Slot, flush_lsn: int, timeline: int) -> None:
        """A reader flushed up to `flush_lsn`: the slot moves forward (never back), saved soon."""
        if flush_lsn > slot.restart_lsn and not slot.invalidated:
            slot.restart_lsn, slot.timeline = flush_lsn, timeline
            if not slot.temporary:
                self._dirty.set()
            self.on_change()

    async def run(self) -> None:
        """Save moved positions, at most once per SAVE_INTERVAL, until cancelled (then save once more)."""
        try:
            while True:
                await self._dirty.wait()
                await self.save()
                await asyncio.sleep(SAVE_INTERVAL)  # rate limit, not synchronisation
        finally:
            if self._dirty.is_set():
                await asyncio.shield(self.save())

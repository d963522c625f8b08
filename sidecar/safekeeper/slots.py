"""Named physical reader slots: where each reader's WAL was flushed, kept in the data directory.

`CREATE_REPLICATION_SLOT ... PHYSICAL` (or `walsidecar readers slot create`) makes one; a reader
streaming with `START_REPLICATION SLOT s` moves it with the flush position of its standby status,
saved at most once per SAVE_INTERVAL (as PostgreSQL saves slots at checkpoints, a crash may move
a slot back a little, never forward). Temporary slots live as long as their connection and are
never saved. They bound WAL removal (horizon.py): `on_change` tells the remover when one moves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sidecar.consensus.reading import ServerState, readable_end
from sidecar.lsn import format_lsn, parse_lsn
from sidecar.pgrepl import ReplicationProtocolError, check_slot_name, timeline_of
from sidecar.safekeeper.storage import write_durably

FILE_NAME = "slots.json"
SAVE_INTERVAL = 1.0  # seconds between saves of positions moved by standby status
MAX_SLOTS = 100


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


def reserve_from(s: ServerState) -> tuple[int, int]:
    """Where `CREATE_REPLICATION_SLOT ... RESERVE_WAL` reserves from, and its timeline: (0, 0) for nothing.

    What a reader may read now; before this safekeeper knows a commit (just after a start) nothing
    is readable yet, and the slot reserves from the oldest WAL held, more than needed, never less.
    """
    lsn = readable_end(s) or s.first_lsn or 0
    return lsn, timeline_of(s.history, s.timeline, lsn) if lsn else 0


class Slots:
    """The slots of one safekeeper; changes are saved durably (creation and removal at once)."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / FILE_NAME
        self._slots: dict[str, Slot] = {}
        self._dirty = asyncio.Event()
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
                self._slots[name] = Slot(name, lsn, int(entry.get("timeline") or 0))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SlotsFileError(f"cannot read the reader slots in {self.path}: {e}") from None

    def __iter__(self):  # noqa: ANN204 - an iterator of Slot
        return iter(sorted(self._slots.values(), key=lambda s: s.name))

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, name: str) -> Slot | None:
        return self._slots.get(name)

    def _doc(self) -> bytes:
        slots = [{"name": s.name, "restart_lsn": format_lsn(s.restart_lsn) if s.restart_lsn else None,
                  "timeline": s.timeline or None} for s in self if not s.temporary]
        return json.dumps({"slots": slots}, indent=1).encode() + b"\n"

    async def save(self) -> None:
        """Write every persistent slot durably, in a thread."""
        self._dirty.clear()
        await asyncio.to_thread(write_durably, self.path, self._doc())

    async def create(self, name: str, temporary: bool, restart_lsn: int, timeline: int) -> Slot:
        """A new slot, saved before this returns unless temporary; SlotError if it exists."""
        try:
            check_slot_name(name)
        except ReplicationProtocolError as e:
            raise SlotError(str(e), "42602") from None
        if name in self._slots:
            raise SlotError(f'replication slot "{name}" already exists', "42710")
        if len(self._slots) >= MAX_SLOTS:
            raise SlotError(f"all replication slots are in use (at most {MAX_SLOTS})", "53400")
        slot = self._slots[name] = Slot(name, restart_lsn, timeline if restart_lsn else 0, temporary)
        if not temporary:
            try:
                await self.save()
            except BaseException:
                del self._slots[name]
                raise
        self.on_change()
        return slot

    async def drop(self, name: str) -> None:
        """Remove a slot not in use; SlotError if missing or active."""
        slot = self.acquire_check(name)
        del self._slots[name]
        self.on_change()
        if not slot.temporary:
            await self.save()

    def acquire_check(self, name: str) -> Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise SlotError(f'replication slot "{name}" does not exist', "42704")
        if slot.active:
            raise SlotError(f'replication slot "{name}" is active for another connection', "55006")
        return slot

    def acquire(self, name: str) -> Slot:
        """Mark the slot in use by one stream; SlotError if missing or already in use."""
        slot = self.acquire_check(name)
        slot.active = True
        return slot

    def release(self, slot: Slot) -> None:
        slot.active = False
        if slot.temporary:
            self._slots.pop(slot.name, None)
            self.on_change()

    def advance(self, slot: Slot, flush_lsn: int, timeline: int) -> None:
        """A reader flushed up to `flush_lsn`: the slot moves forward (never back), saved soon."""
        if flush_lsn > slot.restart_lsn:
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

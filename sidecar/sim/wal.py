"""Simulated WAL: self-describing records, a safekeeper's disk and a primary's pg_wal.

A record is `[total length u32][previous record's start u32][crc32 u32][payload]`, the
three fields standing in for PostgreSQL's xl_tot_len, xl_prev and xl_crc. Bytes are
written and shipped at arbitrary offsets, never aligned to records, so "the end of the
last complete record" has to be found the way PostgreSQL finds it: by walking the chain
of headers and stopping at the first record that is incomplete, fails its CRC or does
not point back at its predecessor.
"""

from __future__ import annotations

import bisect
import random
import struct
import zlib

from sidecar.consensus.acceptor import RecordEnd
from sidecar.timelines import TimelineHistory

BOOT = 0x1000000  # where the first term starts: the segment of the slot's restart position
HEADER = struct.Struct("<III")
_PREFIX = struct.Struct("<II")
_MASK = 0xFFFFFFFF


def encode_record(start: int, prev_start: int, payload: bytes) -> bytes:
    """The bytes of one record at `start` whose predecessor starts at `prev_start`."""
    prefix = _PREFIX.pack(HEADER.size + len(payload), (prev_start - BOOT) & _MASK)
    crc = zlib.crc32(payload, zlib.crc32(prefix))
    return prefix + crc.to_bytes(4, "little") + payload


def parse_chain(buf: bytearray, base: int, off: int, prev_start: int | None,
                starts: list[int], ends: list[int]) -> tuple[int, bool]:
    """Walk records in `buf` (which starts at LSN `base`) from offset `off`, appending to starts/ends.

    Returns (offset where the walk stopped, whether it stopped at an invalid record, as
    opposed to an incomplete one that more bytes could still complete).
    """
    n = len(buf)
    while off + HEADER.size <= n:
        total, prev, crc = HEADER.unpack_from(buf, off)
        if total <= HEADER.size:
            return off, True
        if off + total > n:
            return off, False
        if prev_start is not None and prev != (prev_start - BOOT) & _MASK:
            return off, True
        if zlib.crc32(buf[off + HEADER.size:off + total], zlib.crc32(buf[off:off + 8])) != crc:
            return off, True
        prev_start = base + off
        starts.append(prev_start)
        off += total
        ends.append(base + off)
    return off, False


class Disk:
    """A safekeeper's WAL store: bytes [start, end), of which [start, durable) are fsynced.

    `start` is None until the first Truncate positions the store (no segment exists yet).
    The record chain is parsed incrementally and cut back on truncation.
    """

    def __init__(self) -> None:
        self.start: int | None = None
        self.data = bytearray()
        self.end = 0  # start + len(data), kept as a field because everything asks for it
        self.durable = 0
        self.starts: list[int] = []
        self.ends: list[int] = []
        self._parsed = 0  # offset the chain walk reached
        self._invalid = False  # the walk hit a record no later byte can repair
        # Checkers' "verified equal up to" positions; a cut lowers them.
        self.marks: dict[object, int] = {}

    def write(self, lsn: int, data: bytes) -> None:
        if self.start is None or lsn != self.end:
            raise AssertionError(f"write at {lsn} does not continue the store ending at {self.end}")
        self.data += data
        self.end += len(data)

    def fsync(self) -> int:
        self.durable = self.end
        return self.durable

    def truncate(self, lsn: int) -> None:
        """Durably cut at `lsn` (everything below becomes durable), or position an empty store."""
        if self.start is None:
            self.start = self.durable = self.end = lsn
            return
        if not self.start <= lsn <= self.end:
            raise AssertionError(f"truncate at {lsn} outside the stored WAL [{self.start}, {self.end}]")
        self._cut(lsn)
        self.durable = lsn

    def _cut(self, lsn: int) -> None:
        assert self.start is not None
        del self.data[lsn - self.start:]
        self.end = lsn
        k = bisect.bisect_right(self.ends, lsn)
        del self.starts[k:], self.ends[k:]
        self._parsed = (self.ends[-1] if self.ends else self.start) - self.start
        self._invalid = False
        for key, mark in self.marks.items():
            if mark > lsn:
                self.marks[key] = lsn

    def crash(self, rng: random.Random) -> tuple[int, int]:
        """Lose unsynced bytes, except a random prefix of them and maybe torn junk after it.

        Returns (bytes of the unsynced region that survived, junk bytes left behind).
        """
        if self.start is None:
            return 0, 0
        unsynced = self.end - self.durable
        kept = 0
        if unsynced:
            r = rng.random()
            # A process kill keeps the page cache; a power loss keeps some prefix of it.
            kept = unsynced if r < 0.3 else 0 if r < 0.6 else rng.randint(0, unsynced)
        self._cut(self.durable + kept)
        junk = 0
        if kept < unsynced and rng.random() < 0.3:
            junk = rng.randint(1, 64)
            self.data += bytes(junk) if rng.random() < 0.5 else rng.randbytes(junk)
            self.end += junk
        self.durable = self.end  # what is on disk after the restart is all there is
        return kept, junk

    def chain(self) -> tuple[list[int], list[int]]:
        """(starts, ends) of the valid records from the store's start, as far as they go."""
        if self.start is not None and not self._invalid and self._parsed < len(self.data):
            prev = self.starts[-1] if self.starts else None
            self._parsed, self._invalid = parse_chain(self.data, self.start, self._parsed, prev,
                                                      self.starts, self.ends)
        return self.starts, self.ends

    def last_record(self, upto: int) -> tuple[int, int] | None:
        """(start, end) of the last complete record ending at or below `upto`."""
        starts, ends = self.chain()
        k = bisect.bisect_right(ends, upto)
        return (starts[k - 1], ends[k - 1]) if k else None

    def read(self, lo: int, hi: int) -> bytes:
        assert self.start is not None and self.start <= lo <= hi <= self.end, (lo, hi, self.start, self.end)
        return bytes(self.data[lo - self.start:hi - self.start])


def record_end(disk: Disk, upto: int, fingerprint: bool = True) -> RecordEnd:
    """The end of valid WAL if the stored bytes ended at `upto`: the last complete record.

    server.py (walcheck.record_end) walks from its last durable segment; this walks the chain from
    the store's start. Both find the same record end; a vote fingerprints that record wherever it lies.
    """
    if disk.start is None:
        return RecordEnd(0)
    last = disk.last_record(upto)
    if last is None:
        return RecordEnd(disk.start)
    if not fingerprint:
        return RecordEnd(last[1])
    return RecordEnd(last[1], last[0], zlib.crc32(disk.read(last[0], last[1])))


class Primary:
    """A PostgreSQL server's pg_wal: records from BOOT, flushed up to `flush` (maybe mid-record)."""

    def __init__(self, name: str, timeline: int, history: TimelineHistory, data: bytes = b"",
                 starts: list[int] | None = None, ends: list[int] | None = None) -> None:
        self.name = name
        self.timeline = timeline
        self.history = history
        self.data = bytearray(data)
        self.starts = starts or []
        self.ends = ends or []
        self.flush = self.end
        self.alive = True
        self.sent = BOOT  # highest position any replication stream sent
        self.agree = BOOT  # WAL below this is known to equal the acknowledged WAL

    @property
    def end(self) -> int:
        return BOOT + len(self.data)

    def write_record(self, rng: random.Random) -> tuple[int, int]:
        # Mostly small records, sometimes ones larger than a WAL page.
        size = rng.randint(1, 200) if rng.random() < 0.9 else rng.randint(500, 3000)
        start = self.end
        prev = self.starts[-1] if self.starts else BOOT
        self.data += encode_record(start, prev, rng.randbytes(size))
        self.starts.append(start)
        self.ends.append(self.end)
        return start, self.end

    def flush_some(self, rng: random.Random) -> int:
        """Flush further: to a record end (a commit) or anywhere (a full WAL page written out)."""
        if self.flush < self.end:
            if rng.random() < 0.5:
                k = bisect.bisect_right(self.ends, self.flush)
                self.flush = self.ends[rng.randint(k, len(self.ends) - 1)]
            else:
                self.flush = rng.randint(self.flush + 1, self.end)
        return self.flush

    def crash(self, rng: random.Random) -> tuple[int, int]:
        """Crash and recover: WAL past the last complete record that survived is discarded.

        Flushed bytes survive, and so may part of what was written but not flushed. Returns
        (the end of WAL after recovery, the flushed bytes that were discarded with a torn record).
        """
        survived = self.flush if rng.random() < 0.5 else rng.randint(self.flush, self.end)
        k = bisect.bisect_right(self.ends, survived)
        cut = self.ends[k - 1] if k else BOOT
        torn_flushed = max(self.flush - cut, 0)
        self.cut(cut)
        return cut, torn_flushed

    def cut(self, lsn: int) -> None:
        k = bisect.bisect_right(self.ends, lsn)
        del self.data[lsn - BOOT:], self.starts[k:], self.ends[k:]
        self.flush = lsn
        self.agree = min(self.agree, lsn)

    def record_end_at_or_below(self, lsn: int) -> int:
        k = bisect.bisect_right(self.ends, lsn)
        return self.ends[k - 1] if k else BOOT

    def read(self, lo: int, hi: int) -> bytes:
        assert BOOT <= lo <= hi <= self.end, (lo, hi, self.end)
        return bytes(self.data[lo - BOOT:hi - BOOT])

    def fork(self, name: str, at: int, timeline: int, history: TimelineHistory) -> Primary:
        """A server whose WAL is ours up to the record end `at`: a promoted standby or a restored copy."""
        k = bisect.bisect_right(self.ends, at)
        return Primary(name, timeline, history, bytes(self.data[:at - BOOT]), self.starts[:k], self.ends[:k])

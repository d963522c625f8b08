"""WAL received from the primary and kept in memory until the safekeepers have it."""

from __future__ import annotations

import bisect


class WalBuffer:
    """A contiguous window [start, end) of WAL held as the chunks it arrived in."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.end = start
        self._lsns: list[int] = []
        self._chunks: list[bytes] = []
        self._first = 0  # index of the first live chunk; trimmed chunks are dropped in bulk

    @property
    def size(self) -> int:
        return self.end - self.start

    def append(self, lsn: int, data: bytes) -> None:
        if lsn != self.end:
            raise ValueError(f"WAL at {lsn} does not continue the buffer ending at {self.end}")
        if data:
            self._lsns.append(lsn)
            self._chunks.append(data)
            self.end += len(data)

    def read(self, lsn: int, limit: int) -> bytes:
        """Up to `limit` bytes from `lsn`, joining small chunks into one piece."""
        if not self.start <= lsn <= self.end:
            raise ValueError(f"{lsn} is outside the buffered WAL [{self.start}, {self.end})")
        if lsn == self.end or limit <= 0:
            return b""
        i = bisect.bisect_right(self._lsns, lsn, lo=self._first) - 1
        parts: list[bytes] = []
        got = 0
        while i < len(self._chunks) and got < limit:
            chunk = self._chunks[i]
            offset = max(lsn - self._lsns[i], 0) if not parts else 0
            piece = chunk[offset:offset + limit - got] if offset or len(chunk) - offset > limit - got else chunk
            parts.append(piece)
            got += len(piece)
            i += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def trim(self, lsn: int) -> None:
        """Forget WAL below `lsn` (whole chunks only; `start` may stay a little lower)."""
        lsn = min(lsn, self.end)
        self._drop_before(bisect.bisect_right(self._lsns, lsn, lo=self._first) - 1)
        if lsn == self.end and self._first < len(self._chunks):
            self._lsns, self._chunks, self._first = [], [], 0
            self.start = lsn

    def bound(self, limit: int) -> None:
        """Keep at most `limit` bytes: forget whole chunks from the oldest (all, if the newest is larger)."""
        if self.end - self.start <= limit:
            return
        i = bisect.bisect_left(self._lsns, self.end - limit, lo=self._first)
        if i == len(self._lsns):
            self._lsns, self._chunks, self._first = [], [], 0
            self.start = self.end
        else:
            self._drop_before(i)

    def _drop_before(self, i: int) -> None:
        """Forget the live chunks before index `i`."""
        if i > self._first:
            for j in range(self._first, i):
                self._chunks[j] = b""  # free the WAL now; the lists themselves shrink in bulk below
            self._first = i
            self.start = self._lsns[i]
        if self._first > 1024 and self._first * 2 > len(self._lsns):
            del self._lsns[:self._first], self._chunks[:self._first]
            self._first = 0

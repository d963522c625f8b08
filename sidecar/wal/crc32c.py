"""CRC-32C (Castagnoli) in compiled code, with slice-by-8 lookup tables."""

from __future__ import annotations

import numpy as np

from sidecar.wal.jit import compiled, helper

_POLY = 0x82F63B78  # the Castagnoli polynomial, bit-reversed


def make_tables() -> np.ndarray:
    """The 8 x 256 slice-by-8 tables: table k gives a byte's CRC after k more zero bytes."""
    tables = np.zeros((8, 256), dtype=np.uint32)
    crc = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        crc = np.where(crc & 1, (crc >> 1) ^ np.uint32(_POLY), crc >> 1).astype(np.uint32)
    tables[0] = crc
    for k in range(1, 8):
        tables[k] = (tables[k - 1] >> 8) ^ tables[0][tables[k - 1] & 0xFF]
    return tables


TABLES = make_tables()


@helper
def crc32c(crc: int, buf: np.ndarray, start: int, stop: int) -> int:
    """The CRC-32C of buf[start:stop] continuing from crc, a finished value (as google_crc32c.extend takes it)."""
    t = TABLES
    c = np.uint32(crc) ^ np.uint32(0xFFFFFFFF)
    i = start
    while i < stop and i & 7:
        c = t[0, (c ^ buf[i]) & 0xFF] ^ (c >> 8)
        i += 1
    words = max(0, (stop - i) >> 3)
    # Eight bytes at a time, read as one little-endian word: each byte through the table of its distance to the end.
    for w in buf[i : i + words * 8].view(np.uint64):
        v = w ^ np.uint64(c)
        c = (t[7, v & 0xFF] ^ t[6, (v >> 8) & 0xFF] ^ t[5, (v >> 16) & 0xFF] ^ t[4, (v >> 24) & 0xFF]
             ^ t[3, (v >> 32) & 0xFF] ^ t[2, (v >> 40) & 0xFF] ^ t[1, (v >> 48) & 0xFF] ^ t[0, v >> 56])
    i += words * 8
    while i < stop:
        c = t[0, (c ^ buf[i]) & 0xFF] ^ (c >> 8)
        i += 1
    return np.int64(c ^ np.uint32(0xFFFFFFFF))


# For callers outside compiled code.
crc32c_extend = compiled(crc32c)

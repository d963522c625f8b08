"""WalBuffer: contiguous appends, reads across chunks, trimming."""

from __future__ import annotations

import random

import pytest

from sidecar.consensus.walbuffer import WalBuffer


def filled(start: int, chunks: list[bytes]) -> WalBuffer:
    buf = WalBuffer(start)
    lsn = start
    for c in chunks:
        buf.append(lsn, c)
        lsn += len(c)
    return buf


def test_append_must_continue_the_buffer() -> None:
    buf = WalBuffer(1000)
    buf.append(1000, b"abc")
    assert (buf.start, buf.end, buf.size) == (1000, 1003, 3)
    with pytest.raises(ValueError, match="does not continue"):
        buf.append(1004, b"x")
    with pytest.raises(ValueError, match="does not continue"):
        buf.append(1002, b"x")
    assert (buf.start, buf.end) == (1000, 1003)
    buf.append(1003, b"")
    assert buf.end == 1003
    buf.append(1003, b"de")
    assert buf.read(1000, 100) == b"abcde"


def test_read_across_chunks_and_limits() -> None:
    buf = filled(100, [b"aaaa", b"bb", b"cccccc", b"d"])
    assert buf.read(100, 100) == b"aaaabbccccccd"
    assert buf.read(102, 4) == b"aabb"
    assert buf.read(105, 5) == b"bcccc"
    assert buf.read(106, 6) == b"cccccc"
    assert buf.read(112, 10) == b"d"
    assert buf.read(100, 1) == b"a"


def test_read_at_the_end_is_empty() -> None:
    buf = filled(100, [b"aaaa"])
    assert buf.read(104, 10) == b""
    assert WalBuffer(100).read(100, 10) == b""


def test_read_outside_the_window_raises() -> None:
    buf = filled(100, [b"aaaa", b"bbbb"])
    with pytest.raises(ValueError):
        buf.read(99, 1)
    with pytest.raises(ValueError):
        buf.read(109, 1)
    buf.trim(104)
    with pytest.raises(ValueError):
        buf.read(100, 1)


def test_trim_drops_whole_chunks_below_lsn() -> None:
    buf = filled(100, [b"aaaa", b"bbbb", b"cccc"])
    buf.trim(106)  # inside the second chunk: it stays whole
    assert buf.start == 104
    assert buf.read(104, 100) == b"bbbbcccc"
    buf.trim(100)  # backwards: no effect
    assert buf.start == 104
    buf.trim(108)
    assert buf.start == 108
    assert buf.read(108, 100) == b"cccc"


def test_trim_to_the_end_empties_and_appends_continue() -> None:
    buf = filled(100, [b"aaaa", b"bbbb"])
    buf.trim(108)
    assert (buf.start, buf.end, buf.size) == (108, 108, 0)
    buf.trim(5000)  # beyond the end is clamped
    assert (buf.start, buf.end) == (108, 108)
    buf.append(108, b"zz")
    assert buf.read(108, 10) == b"zz"


def test_random_appends_reads_and_trims_match_a_flat_copy() -> None:
    rng = random.Random(7)
    start = 1 << 24
    buf = WalBuffer(start)
    flat = bytearray()
    for _ in range(5000):
        op = rng.random()
        if op < 0.5:
            data = rng.randbytes(rng.randint(0, 50))
            buf.append(start + len(flat), data)
            flat += data
        elif op < 0.9 and buf.end > buf.start:
            lsn = rng.randint(buf.start, buf.end)
            limit = rng.randint(1, 200)
            got = buf.read(lsn, limit)
            assert got == bytes(flat[lsn - start:lsn - start + limit])
        else:
            old = buf.start
            target = rng.randint(buf.start, buf.end)
            buf.trim(target)
            assert old <= buf.start <= target
        assert buf.end == start + len(flat)
    # Everything still held reads back byte for byte.
    assert buf.read(buf.start, buf.size) == bytes(flat[buf.start - start:])


def test_many_small_chunks_trimmed_one_by_one_read_back_correctly() -> None:
    start = 5000
    data = bytes(i % 251 for i in range(4000))
    buf = WalBuffer(start)
    for i, b in enumerate(data):
        buf.append(start + i, bytes([b]))
    for i in range(1, 3500):
        buf.trim(start + i)
        assert buf.start == start + i
        assert buf.read(start + i, 3) == data[i:i + 3]
    assert buf.read(buf.start, 10_000) == data[3499:]
    buf.append(buf.end, b"tail")
    assert buf.read(start + 3998, 10) == data[3998:] + b"tail"


def test_bound_keeps_at_most_the_limit_in_whole_chunks() -> None:
    buf = filled(0, [b"a" * 100, b"b" * 100, b"c" * 100, b"d" * 100])
    buf.bound(400)
    assert (buf.start, buf.end) == (0, 400)
    buf.bound(250)  # the chunk holding the cut goes too: never more than the limit
    assert (buf.start, buf.end) == (200, 400)
    assert buf.read(200, 1000) == b"c" * 100 + b"d" * 100
    buf.bound(99)  # even the newest chunk is larger
    assert (buf.start, buf.end, buf.size) == (400, 400, 0)
    buf.append(400, b"e" * 10)
    assert buf.read(400, 100) == b"e" * 10

"""Decoding speed of the receive path: FrameReader (what the safekeeper and the proposer's
links use) and FrameDecoder.feed, on streams of Appends and AppendReplies.

    PYTHONPATH=$PWD python3 scripts/bench_framing.py

Fed from memory 256 KiB at a time, as a socket would; CPU time of this process, best of N,
so other load on the machine skews it less.
"""

from __future__ import annotations

import asyncio
import time

from sidecar import framing
from sidecar.consensus import codec
from sidecar.consensus.messages import Append, AppendReply, Message

CHUNK = 256 * 1024
BOOT = 1 << 24


def _stream(msgs: list[Message]) -> bytes:
    return b"".join(codec.encode(m) for m in msgs)


def _reader(data: bytes, reps: int) -> tuple[float, int]:
    loop = asyncio.new_event_loop()
    best, count = float("inf"), 0
    for _ in range(reps):
        r = framing.FrameReader(loop, max_frame=codec.MAX_FRAME)
        view = memoryview(data)
        began = time.process_time()
        pos = count = 0
        while pos < len(view):
            buf = r.get_buffer(-1)
            n = min(len(buf), CHUNK, len(view) - pos)
            buf[:n] = view[pos:pos + n]
            r.buffer_updated(n)
            pos += n
            while r.has_messages():
                r._messages.popleft()
                count += 1
            r._queued = 0
        best = min(best, time.process_time() - began)
    loop.close()
    return best, count


def _feed(data: bytes, reps: int) -> tuple[float, int]:
    best, count = float("inf"), 0
    for _ in range(reps):
        d = codec.FrameDecoder()
        began = time.process_time()
        count = sum(len(d.feed(data[pos:pos + CHUNK])) for pos in range(0, len(data), CHUNK))
        best = min(best, time.process_time() - began)
    return best, count


def main() -> None:
    cases = {
        "Append 200 B": _stream([Append(5, BOOT + i * 200, BOOT, BOOT, b"x" * 200) for i in range(20_000)]),
        "Append 8 KiB": _stream([Append(5, BOOT + i * 8192, BOOT, BOOT, b"x" * 8192) for i in range(2_000)]),
        "Append 1 MiB": _stream([Append(5, BOOT + i * (1 << 20), BOOT, BOOT, b"x" * (1 << 20)) for i in range(16)]),
        "AppendReply": _stream([AppendReply(5, BOOT + i, BOOT) for i in range(100_000)]),
    }
    for name, data in cases.items():
        for how, bench in (("FrameReader", _reader), ("FrameDecoder.feed", _feed)):
            took, count = bench(data, 9)
            print(f"{how:18} {name:13} {count / took / 1e3:8.0f} k msg/s {len(data) / took / 1e6:8.0f} MB/s")


if __name__ == "__main__":
    main()

"""The compiled hot path against its pure-Python reference: the same messages, errors and decoder state on the
same valid and hostile inputs, and the choice between them (WALSIDECAR_PURE_PYTHON, a checkout without the build)."""

from __future__ import annotations

import array
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar import hotpath, pgrepl
from sidecar.consensus import codec, limits
from sidecar.consensus.messages import Append, AppendReply, ElectedReply, InfoRequest, VoteRequest

ROOT = Path(__file__).resolve().parents[2]
U64 = 2**64 - 1

compiled = pytest.mark.skipif(hotpath.COMPILED is None, reason="sidecar._hotpath is not built "
                              "(python setup.py build_ext --inplace) or WALSIDECAR_PURE_PYTHON is set")

# Values at and around every bound the decoders check.
edges = st.sampled_from([0, 1, limits.MAX_TERM, limits.MAX_TERM + 1, limits.MAX_LSN - 1, limits.MAX_LSN,
                         limits.MAX_LSN + 1, 2**63, U64 - 1, U64])
u64 = st.one_of(st.integers(0, U64), edges)


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """One frame, mostly the commit path's (Append, AppendReply) with fields at their bounds, some hostile."""
    kind = draw(st.sampled_from(["append", "reply", "other", "raw"]))
    if kind == "append":
        size = draw(st.one_of(st.integers(0, 40), st.sampled_from([16 * 1024 - 38, 16 * 1024 - 37, 20_000])))
        body = struct.pack(">QQQQ", draw(u64), draw(u64), draw(u64), draw(u64)) + bytes(size)
        body = body[:draw(st.sampled_from([len(body), len(body), 31, 0]))]
        frame = struct.pack(">IB", 1 + len(body), codec.TAG_APPEND) + body
    elif kind == "reply":
        body = struct.pack(">QQQ", draw(u64), draw(u64), draw(u64))
        body = body[:draw(st.sampled_from([24, 24, 23, 0]))] + draw(st.sampled_from([b"", b"", b"\0"]))
        frame = struct.pack(">IB", 1 + len(body), codec.TAG_APPEND_REPLY) + body
    elif kind == "other":
        frame = codec.encode(draw(st.sampled_from([VoteRequest(3), ElectedReply(2, 100), InfoRequest()])))
    else:
        frame = draw(st.binary(max_size=40))
    if draw(st.integers(0, 9)) == 0:  # a length at a limit
        frame = draw(st.sampled_from([0, 1, 25, 2**14, codec.MAX_FRAME, codec.MAX_FRAME + 1, 2**32 - 1])).to_bytes(
            4, "big") + frame[4:]
    return frame


def _outcome(call: Any) -> Any:
    try:
        return ("ok", call())
    except Exception as e:  # the exact error is what is compared
        return ("error", type(e), str(e))


def _messages(msgs: list[Any]) -> list[Any]:
    """Messages with the type of Append data shown (bytes or a view of the frame)."""
    return [(m, type(m.data)) if isinstance(m, Append) else m for m in msgs]


def _run(decoder_class: type[codec.FrameDecoder], chunks: list[bytes], max_frame: int, how: str) -> list[Any]:
    dec = decoder_class(max_frame)
    trace = []
    for chunk in chunks:
        if how == "feed":
            got = _outcome(lambda: _messages(dec.feed(chunk)))
        else:  # as the buffered protocol does: received into get_buffer(), then buffer_updated()
            out: list[Any] = []

            def step() -> None:
                pos = 0
                while pos < len(chunk):
                    buf = dec.get_buffer()
                    n = min(len(buf), len(chunk) - pos)
                    buf[:n] = chunk[pos:pos + n]
                    buf.release()
                    pos += n
                    dec.buffer_updated(n, out)

            got = _outcome(step)
            got = (got[0], _messages(out), *got[2:])
        trace.append((got, dec.pending, dec._start, dec._end, dec._frame_got if dec._frame is not None else None))
    return trace


@compiled
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames(), min_size=1, max_size=8), st.lists(st.integers(1, 70_000), min_size=1, max_size=6),
       st.sampled_from([codec.MAX_FRAME, limits.PREAUTH_MAX_FRAME, 64]), st.sampled_from(["feed", "buffer"]))
def test_frame_decoder_matches_the_reference(parts: list[bytes], sizes: list[int], max_frame: int, how: str) -> None:
    data = b"".join(parts)
    chunks, pos, i = [], 0, 0
    while pos < len(data):
        chunks.append(data[pos:pos + sizes[i % len(sizes)]])
        pos, i = pos + sizes[i % len(sizes)], i + 1
    assert _run(hotpath.FrameDecoder, chunks, max_frame, how) == _run(codec.FrameDecoder, chunks, max_frame, how)


EDGES = [0, 1, limits.MAX_TERM, limits.MAX_TERM + 1, limits.MAX_LSN - 2, limits.MAX_LSN - 1, limits.MAX_LSN,
         limits.MAX_LSN + 1, 2**63, U64 - 1, U64]


def _bound_frames() -> list[bytes]:
    """Every field of an Append and an AppendReply at every edge, alone; an Append's end at the LSN limit."""
    out = []
    for i in range(4):
        for v in EDGES:
            fields = [0, 0, 0, 0]
            fields[i] = v
            out.append(struct.pack(">IBQQQQ", 33, codec.TAG_APPEND, *fields))
            if i < 3:
                out.append(struct.pack(">IBQQQ", 25, codec.TAG_APPEND_REPLY, *fields[:3]))
    for begin in EDGES:
        for size in (1, 2, 3):
            out.append(struct.pack(">IBQQQQ", 33 + size, codec.TAG_APPEND, 1, begin, 0, 0) + bytes(size))
    return out


@compiled
@pytest.mark.parametrize("how", ["feed", "buffer"])
def test_frame_decoder_checks_every_bound_as_the_reference(how: str) -> None:
    for frame in _bound_frames():
        ok = codec.encode(AppendReply(1, 2, 3))
        chunks = [ok + frame + ok]
        assert _run(hotpath.FrameDecoder, chunks, codec.MAX_FRAME, how) == \
            _run(codec.FrameDecoder, chunks, codec.MAX_FRAME, how), frame.hex()


@compiled
def test_frame_decoder_takes_the_commit_path_itself() -> None:
    """Appends and AppendReplies within bounds decode in compiled code; an error after them still comes in order."""
    msgs = [Append(5, 100, 90, 0, b"wal"), AppendReply(5, 103, 90), Append(5, 103, 90, 0, b"")]
    stream = b"".join(codec.encode(m) for m in msgs)
    assert hotpath.FrameDecoder().feed(stream) == msgs
    bad = stream + struct.pack(">IBQQQ", 25, codec.TAG_APPEND_REPLY, limits.MAX_TERM + 1, 0, 0)
    for cls in (hotpath.FrameDecoder, codec.FrameDecoder):
        dec, out = cls(), []
        buf = dec.get_buffer()
        buf[:len(bad)] = bad
        buf.release()
        with pytest.raises(codec.FieldError, match="term"):
            dec.buffer_updated(len(bad), out)
        assert out == msgs


def _copy_payloads() -> list[Any]:
    w = pgrepl.xlogdata_header(0x1_0000_0028, 2**64 - 1, 2**63 + 5) + b"WAL bytes"
    k = pgrepl.encode_keepalive(123, 456, True)
    r = pgrepl.encode_status(1, 2, 3, 4)
    return [w, bytearray(w), memoryview(w), memoryview(w)[:25], memoryview(w)[:24], memoryview(b"x" + w)[1:],
            memoryview(w)[::2], memoryview(w).cast("c"), array.array("B", w), array.array("I", b"w" * 28),
            k, k[:-1], r, b"", b"w", b"w" * 25, b"z" * 30, "w" * 30]


@compiled
@pytest.mark.parametrize("payload", _copy_payloads(), ids=lambda p: f"{type(p).__name__}-{len(p)}")
def test_parse_copy_data_matches_the_reference(payload: Any) -> None:
    def parse(fn: Any) -> Any:
        got = _outcome(lambda: fn(payload))
        if got[0] == "ok" and isinstance(got[1], pgrepl.XLogData):
            m = got[1]
            return ("ok", (m.start, m.wal_end, m.send_time, bytes(m.data), type(m.data), m.data.format,
                           m.data.readonly, m.data.obj is getattr(payload, "obj", payload)))
        return got

    assert parse(hotpath.parse_copy_data) == parse(pgrepl.parse_copy_data)


@compiled
def test_parse_copy_data_of_a_released_view() -> None:
    view = memoryview(pgrepl.xlogdata_header(1, 2, 3))
    view.release()
    want = _outcome(lambda: pgrepl.parse_copy_data(view))
    assert want[0] == "error"
    assert _outcome(lambda: hotpath.parse_copy_data(view)) == want


@compiled
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=60), st.sampled_from([b"", b"w", b"k", b"r", b"h"]))
def test_parse_copy_data_on_hostile_bytes(raw: bytes, kind: bytes) -> None:
    payload = kind + raw
    want = _outcome(lambda: pgrepl.parse_copy_data(payload))
    got = _outcome(lambda: hotpath.parse_copy_data(payload))
    if want[0] == "ok" and isinstance(want[1], pgrepl.XLogData):
        want = (want[0], want[1], bytes(want[1].data))
        got = (got[0], got[1], bytes(got[1].data))
    assert got == want


def _implementation(env: dict[str, str], prelude: str = "") -> str:
    code = prelude + "from sidecar import hotpath; print(hotpath.implementation(), hotpath.FrameDecoder.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    return out.stdout.strip()


def test_walsidecar_pure_python_forces_the_reference() -> None:
    assert _implementation({"WALSIDECAR_PURE_PYTHON": "1"}) == "python FrameDecoder"


def test_a_checkout_without_the_build_runs_the_reference() -> None:
    # As if sidecar/_hotpath*.so were absent: its import fails.
    prelude = "import sys; sys.modules['sidecar._hotpath'] = None; "
    assert _implementation({"WALSIDECAR_PURE_PYTHON": ""}, prelude) == "python FrameDecoder"


@compiled
def test_the_build_is_chosen_by_default() -> None:
    assert _implementation({"WALSIDECAR_PURE_PYTHON": ""}) == "compiled CompiledFrameDecoder"

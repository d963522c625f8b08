"""Wire encoding: round trips, incremental framing, strict rejection and fuzzing."""

from __future__ import annotations

import random
import struct
import time

import pytest

from sidecar.consensus.codec import (
    MAX_FRAME,
    TAGS,
    EncodeError,
    FieldError,
    FrameDecoder,
    ProtocolError,
    check_bounds,
    decode,
    encode,
    encode_append_parts,
)
from sidecar.consensus.limits import MAX_MEMBERS, MAX_HISTORY, MAX_LSN, MAX_TERM, LimitError
from sidecar.consensus.messages import (
    NO_DEGRADED,
    PROTOCOL_VERSION,
    DegradedRange,
    DegradedRecord,
    DegradedRecordReply,
    SlotHold,
    TimelineFence,
    Append,
    AppendReply,
    AuthChallenge,
    AuthConfirm,
    AuthResponse,
    Elected,
    ElectedReply,
    Greeting,
    GreetingReply,
    InfoReply,
    InfoRequest,
    Message,
    Refusal,
    TermEntry,
    VoteReply,
    VoteRequest,
)
from sidecar.timelines import TimelineEntry

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:
    st = None

U64 = 2**64 - 1
U32 = 2**32 - 1

TERMS = (TermEntry(1, 0x1000000), TermEntry(2, 0x2A00028), TermEntry(MAX_TERM, MAX_LSN))
TIMELINES = (TimelineEntry(1, 0x3000000), TimelineEntry(U32, MAX_LSN))

SAMPLES: list[Message] = [
    Greeting(PROTOCOL_VERSION, "proposer-1", 7301234567890123456, 1, 16 * 1024 * 1024, 150004),
    Greeting(PROTOCOL_VERSION, "", 0, 0, 0, 0),
    Greeting(PROTOCOL_VERSION, "prôposeur-東京-🐘", U64, U32, U32, U32),
    Greeting(PROTOCOL_VERSION, "proposer-1", 7301234567890123456, 1, 16 * 1024 * 1024, 150004, 3),
    Greeting(PROTOCOL_VERSION, "p", 1, 1, 1, 1, MAX_MEMBERS),
    GreetingReply(3, 17),
    GreetingReply(U64, MAX_TERM),
    GreetingReply(3, 17, 5433),
    GreetingReply(1, 1, 65535),
    VoteRequest(0),
    VoteRequest(MAX_TERM),
    VoteReply(5, True, 0x3000000, (), ()),
    VoteReply(5, False, 0x3000000, TERMS, TIMELINES, tail_lsn=0x2FFFF00, tail_crc=U32),
    VoteReply(MAX_TERM, True, MAX_LSN, TERMS[:1], (), tail_lsn=MAX_LSN, tail_crc=0),
    VoteReply(5, True, 0x3000000, TERMS[:1], TIMELINES[:1], timeline=2),
    VoteReply(5, False, 0x3000000, TERMS[:1], (), timeline=1, fence=TimelineFence(9, 1, 0x3000000)),
    VoteReply(7, False, 0x3000000, TERMS[:1], (), timeline=1, lost_disk_term=5),
    VoteReply(MAX_TERM, False, 0, (), (), lost_disk_term=MAX_TERM),
    Elected(6, 0x3000000, ()),
    Elected(6, 0x3000000, TERMS),
    Elected(6, 0x3000000, TERMS, 1),
    Elected(6, 0x3000000, TERMS[:2], 3, (TimelineEntry(1, 0x2000000), TimelineEntry(2, 0x3000000))),
    Elected(6, 0x3000000, TERMS[:2], U32, TIMELINES[:1]),
    Elected(6, 0x3000000, TERMS[:2], 1, (), TimelineFence(6, 1, 0x3000000)),
    Elected(6, 0x3000000, TERMS[:2], 0, (), TimelineFence(6)),
    ElectedReply(6, 0x2FFFFF8),
    Append(6, 0x3000000, 0x2FFFF00, 0x2000000),
    Append(6, 0x3000000, 0x2FFFF00, 0x2000000, b"\x00\x01record bytes\xff"),
    Append(MAX_TERM, MAX_LSN - 256, MAX_LSN, MAX_LSN, bytes(range(256))),
    AppendReply(6, 0x3000100, 0x3000000),
    AppendReply(MAX_TERM, MAX_LSN, MAX_LSN),
    Refusal(""),
    Refusal("system_id mismatch: réfusé ✗"),
    InfoRequest(),
    InfoReply(2, 7301234567890123456, 16 * 1024 * 1024, 15, 1, 6, 6, 0x3000100, 0x3000000, True),
    InfoReply(0, 0, 0, 0, 0, 0, 0, 0, 0, False),
    InfoReply(2, 7301234567890123456, 16 * 1024 * 1024, 15, 2, 6, 6, 0x3000100, 0x3000000, False, 5433),
    InfoReply(2, 7301234567890123456, 16 * 1024 * 1024, 15, 2, 6, 6, 0x3000100, 0x3000000, False, 5433, 0x2000000,
              archive_mismatch="000000020000000000000003"),
    InfoReply(2, 7301234567890123456, 16 * 1024 * 1024, 15, 2, 6, 6, 0x3000100, 0x3000000, False, 5433, 0x2000000,
              10 << 30, (SlotHold("standby", 1 << 20),), "000000020000000000000003"),
    InfoReply(2, 7301234567890123456, 16 * 1024 * 1024, 15, 2, 6, 6, 0x3000100, 0x3000000, False, 5433,
              fence=TimelineFence(5, 1, 0x3000000)),
    InfoReply(2, 0, 0, 0, 0, 0, 0, 0, 0, False, members=3, amnesic=True),
    InfoReply(2, 7301234567890123456, 16 * 1024 * 1024, 15, 2, 9, 6, 0x3000100, 0x3000000, True, 5433,
              fence=TimelineFence(5, 1, 0x3000000), members=MAX_MEMBERS, lost_disk_term=MAX_TERM),
    AuthChallenge(bytes(range(32))),
    AuthChallenge(bytes(range(32)), b"\x30\x82" + b"c" * 600),
    AuthResponse(b"\x30\x82" + b"c" * 600, b"\xff" * 32, "sk1.internal", b"s" * 72, 5454),
    AuthResponse(b"c" * 8192, bytes(32), "東京", b"s" * 256),
    AuthConfirm(b"c", b"s"),
    InfoReply(2, 7301234567890123456, 16 * 1024 * 1024, 15, 2, 9, 9, 0x3000100, 0x3000000, True, 5433,
              degraded=DegradedRange(9, 0x3000000, 2, frozenset({1, 3})), degrade_term=9),
    InfoReply(2, 7301234567890123456, 16 * 1024 * 1024, 15, 2, 9, 9, 0x3000100, 0x3000000, True, 5433,
              degrade_term=MAX_TERM),
    DegradedRecord(9, DegradedRange(9, 0x3000000, 1, frozenset({2}))),
    DegradedRecord(9, DegradedRange(4, 0x3000000, 7, frozenset(range(1, MAX_MEMBERS + 1)))),
    DegradedRecord(9, NO_DEGRADED),
    DegradedRecordReply(9, 2),
    DegradedRecordReply(MAX_TERM, MAX_TERM),
]


def split(frame: bytes) -> tuple[int, memoryview]:
    """(tag, body) of a whole frame."""
    assert struct.unpack_from(">I", frame)[0] == len(frame) - 4
    return frame[4], memoryview(frame)[5:]


def read_all(data: bytes) -> list[Message]:
    """Every message in `data`, which must end at a frame boundary."""
    dec = FrameDecoder()
    out = dec.feed(data)
    assert dec.pending == 0
    return out


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    frame = encode(msg)
    assert isinstance(frame, bytes)
    tag, body = split(frame)
    assert tag == TAGS[type(msg)]
    assert chr(tag).isascii() and chr(tag).isalpha()
    assert decode(tag, body) == msg
    assert decode(tag, bytes(body)) == msg
    assert decode(tag, bytearray(body)) == msg
    assert FrameDecoder().feed(frame) == [msg]
    assert read_all(frame) == [msg]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_sample_is_within_bounds(msg: Message) -> None:
    check_bounds(msg)


def test_every_message_type_is_sampled() -> None:
    assert {type(m) for m in SAMPLES} == set(TAGS)
    assert len(set(TAGS.values())) == len(TAGS)


@pytest.mark.parametrize("msg", [
    AuthChallenge(bytes(31)), AuthChallenge(bytes(33)),
    AuthResponse(b"", bytes(32), "h", b"s"), AuthResponse(b"c" * 8193, bytes(32), "h", b"s"),
    AuthResponse(b"c", bytes(32), "", b"s"), AuthResponse(b"c", bytes(32), "h" * 256, b"s"),
    AuthResponse(b"c", bytes(32), "h", b"s" * 257), AuthResponse(b"c", bytes(16), "h", b"s"),
    AuthConfirm(b"c", b""), AuthConfirm(b"c" * 8193, b"s"),
], ids=lambda m: type(m).__name__)
def test_auth_fields_are_bounded_both_ways(msg: Message) -> None:
    with pytest.raises(EncodeError):
        encode(msg)
    # Hand-packed, the decoder refuses it the same way.
    tag = TAGS[type(msg)]
    blob = lambda b: struct.pack(">H", len(b)) + b  # noqa: E731
    if isinstance(msg, AuthChallenge):
        body = msg.nonce
    elif isinstance(msg, AuthResponse):
        body = msg.nonce + struct.pack(">H", msg.port) + blob(msg.certificate) + blob(msg.host.encode()) \
            + blob(msg.signature)
    else:
        body = blob(msg.certificate) + blob(msg.signature)
    with pytest.raises(ProtocolError):  # FieldError where the frame's layout is intact
        decode(tag, body)


def test_auth_frames_are_strict() -> None:
    frame = encode(AuthConfirm(b"cert", b"sig"))
    tag, body = split(frame)
    for bad in (bytes(body) + b"\0", bytes(body)[:-1], b"\x00\x05ab"):
        with pytest.raises(ProtocolError):
            decode(tag, bad)
    resp = split(encode(AuthResponse(b"c", bytes(32), "h", b"s")))
    with pytest.raises(ProtocolError, match="UTF-8"):
        decode(resp[0], bytes(resp[1]).replace(b"\x00\x01h", b"\x00\x01\xff"))


def test_large_append_round_trip() -> None:
    data = random.Random(1).randbytes(4 * 1024 * 1024)
    msg = Append(9, 0x5000000, 0x4FFFF00, 0x4000000, data)
    frame = encode(msg)
    assert len(frame) == 4 + 1 + 32 + len(data)
    decoded = decode(*split(frame))
    assert decoded == msg and type(decoded.data) is bytes
    assert decoded.end_lsn == 0x5000000 + len(data)
    [received] = FrameDecoder().feed(frame)
    # Received into a buffer of its own, which the message keeps without a copy.
    assert received == msg and type(received.data) is memoryview


def test_append_parts_match_encode() -> None:
    data = bytes(range(256)) * 64
    msg = Append(4, 0x1000000, 0xFFF000, 0xF00000, data)
    for payload in (data, bytearray(data), memoryview(data), memoryview(b"xx" + data)[2:]):
        header, body = encode_append_parts(4, 0x1000000, 0xFFF000, 0xF00000, payload)
        assert body is payload
        assert header + bytes(body) == encode(msg)


def test_append_of_maximum_size() -> None:
    max_data = MAX_FRAME - 1 - 32
    header, _ = encode_append_parts(1, 0, 0, 0, memoryview(bytes(max_data)))
    assert struct.unpack_from(">I", header)[0] == MAX_FRAME
    msg = Append(1, 0, 0, 0, bytes(max_data))
    assert FrameDecoder().feed(encode(msg)) == [msg]
    with pytest.raises(ProtocolError, match="exceeds"):
        encode_append_parts(1, 0, 0, 0, bytes(max_data + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(Append(1, 0, 0, 0, bytes(max_data + 1)))


def test_greeting_of_another_version_decodes_to_its_version() -> None:
    # A future layout is unknown, but the safekeeper must still be able to name the mismatch.
    body = struct.pack(">I", PROTOCOL_VERSION + 1) + b"\xffwhatever layout v2 has"
    msg = decode(ord("g"), body)
    assert isinstance(msg, Greeting) and msg.protocol_version == PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError):
        decode(ord("g"), b"\x00\x00\x00")


# ---------------------------------------------------------------- incremental framing


def test_frame_decoder_every_cut_point() -> None:
    frames = [encode(m) for m in SAMPLES]
    stream = b"".join(frames)
    for cut in range(len(stream) + 1):
        dec = FrameDecoder()
        got = dec.feed(stream[:cut])
        assert got == SAMPLES[: len(got)]
        got += dec.feed(stream[cut:])
        assert got == SAMPLES, f"cut at {cut}"
        assert dec.pending == 0


def test_frame_decoder_byte_at_a_time_and_random_chunks() -> None:
    stream = b"".join(encode(m) for m in SAMPLES)
    dec = FrameDecoder()
    got: list[Message] = []
    for i in range(len(stream)):
        got += dec.feed(stream[i:i + 1])
    assert got == SAMPLES

    rng = random.Random(7)
    for _ in range(200):
        dec, got, pos = FrameDecoder(), [], 0
        while pos < len(stream):
            n = rng.randint(0, 40)
            got += dec.feed(memoryview(stream)[pos:pos + n])
            pos += n
        assert got == SAMPLES


def test_frame_decoder_pending_reports_partial_frame() -> None:
    frame = encode(AppendReply(1, 2, 3))
    dec = FrameDecoder()
    assert dec.feed(frame + frame[:10]) == [AppendReply(1, 2, 3)]
    assert dec.pending == 10
    assert dec.feed(frame[10:]) == [AppendReply(1, 2, 3)]
    assert dec.pending == 0


def test_frame_decoder_many_small_frames() -> None:
    msgs = [AppendReply(7, 0x1000000 + i, 0x1000000 + i // 2) for i in range(100_000)]
    stream = b"".join(encode(m) for m in msgs)
    dec = FrameDecoder()
    got: list[Message] = []
    for pos in range(0, len(stream), 65_536):
        got += dec.feed(stream[pos:pos + 65_536])
    assert got == msgs


@pytest.mark.timeout(60)
def test_frame_decoder_large_frame_in_small_chunks_is_linear() -> None:
    data = bytes(16 * 1024 * 1024)
    msg = Append(2, 0, 0, 0, data)
    frame = encode(msg)
    dec = FrameDecoder()
    got: list[Message] = []
    started = time.perf_counter()
    for pos in range(0, len(frame), 1024):
        got += dec.feed(frame[pos:pos + 1024])
    elapsed = time.perf_counter() - started
    assert got == [msg]
    # Re-copying the buffer per chunk would move ~128 GiB here and take minutes.
    assert elapsed < 10, elapsed


def test_frame_decoder_reports_a_truncated_stream() -> None:
    for frame in (encode(VoteRequest(3)), encode(Append(1, 2, 3, 4, bytes(1000))),
                  encode(Append(1, 2, 3, 4, bytes(100_000)))):
        for cut in sorted({1, 4, 5, len(frame) // 2, len(frame) - 1}):
            dec = FrameDecoder()
            assert dec.feed(frame[:cut]) == []
            assert dec.pending == cut


def test_max_frame_is_settable() -> None:
    frame = encode(Append(1, 2, 3, 4, bytes(70_000)))
    dec = FrameDecoder(max_frame=64 * 1024)
    with pytest.raises(ProtocolError, match="exceeds the maximum of 65536"):
        dec.feed(frame[:4])
    dec = FrameDecoder(max_frame=64 * 1024)
    assert dec.feed(encode(VoteRequest(1))) == [VoteRequest(1)]
    dec.max_frame = MAX_FRAME  # the peer authenticated itself
    assert dec.feed(frame) == [Append(1, 2, 3, 4, bytes(70_000))]


# ---------------------------------------------------------------- rejection


def frame_of(tag: int | str, body: bytes) -> bytes:
    tag = ord(tag) if isinstance(tag, str) else tag
    return struct.pack(">IB", len(body) + 1, tag) + body


def rejected_everywhere(frame: bytes, match: str | None = None) -> None:
    """The frame is refused by decode() and FrameDecoder alike."""
    if len(frame) >= 5 and struct.unpack_from(">I", frame)[0] == len(frame) - 4:
        with pytest.raises(ProtocolError, match=match):
            decode(*split(frame))
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match=match):
        dec.feed(frame)
    with pytest.raises(ProtocolError):
        dec.feed(b"")  # the stream cannot recover after a bad frame


def test_unknown_tag() -> None:
    rejected_everywhere(frame_of("z", b""), r"unknown message tag 0x7a \('z'\)")
    rejected_everywhere(frame_of(0, b"abc"), "unknown message tag 0x00")
    with pytest.raises(ProtocolError, match="unknown message tag"):
        decode(0xFF, b"")


def test_zero_length_frame() -> None:
    rejected_everywhere(b"\x00\x00\x00\x00", "frame length 0")
    rejected_everywhere(b"\x00\x00\x00\x00" + encode(VoteRequest(1)), "frame length 0")


def test_declared_length_over_maximum() -> None:
    header = struct.pack(">I", MAX_FRAME + 1)
    # Refused from the header alone: nothing waits for 16 MiB that is never coming.
    rejected_everywhere(header, "exceeds the maximum")
    rejected_everywhere(b"\xff\xff\xff\xff" + b"a" * 40, "exceeds the maximum")
    dec = FrameDecoder()
    assert dec.feed(encode(VoteRequest(1)) + header[:3]) == [VoteRequest(1)]
    with pytest.raises(ProtocolError, match="exceeds the maximum"):
        dec.feed(header[3:])


FIXED = [GreetingReply(1, 2), VoteRequest(3), ElectedReply(4, 5), AppendReply(6, 7, 8),
         InfoReply(1, 2, 3, 4, 5, 6, 7, 8, 9, True)]
VARIABLE = [
    SAMPLES[0],
    VoteReply(5, False, 0x3000000, TERMS, TIMELINES, 1, 2),
    VoteReply(5, True, 0x3000000, (), ()),
    Elected(6, 0x3000000, TERMS),
    Elected(6, 0x3000000, ()),
    Refusal("no"),
]


@pytest.mark.parametrize("msg", FIXED + VARIABLE + [Append(1, 2, 3, 4)], ids=lambda m: type(m).__name__)
def test_truncated_body(msg: Message) -> None:
    tag, body = split(encode(msg))
    for cut in range(len(body)):
        with pytest.raises(ProtocolError):
            decode(tag, body[:cut])
        rejected_everywhere(frame_of(tag, bytes(body[:cut])))


@pytest.mark.parametrize("msg", FIXED + VARIABLE, ids=lambda m: type(m).__name__)
def test_trailing_bytes(msg: Message) -> None:
    tag, body = split(encode(msg))
    for extra in (b"\x00", b"\x00" * 16, b"junk"):
        rejected_everywhere(frame_of(tag, bytes(body) + extra))


def test_trailing_bytes_message() -> None:
    tag, body = split(encode(Elected(1, 2, TERMS)))
    with pytest.raises(ProtocolError, match="3 trailing bytes"):
        decode(tag, bytes(body) + b"abc")
    tag, body = split(encode(AppendReply(1, 2, 3)))
    with pytest.raises(ProtocolError, match="AppendReply body is 25 bytes, expected 24"):
        decode(tag, bytes(body) + b"!")


def test_bool_must_be_zero_or_one() -> None:
    tag, body = split(encode(VoteReply(5, True, 9, (), ())))
    bad = bytearray(body)
    assert bad[8] == 1
    for value in (2, 0x80, 0xFF):
        bad[8] = value
        rejected_everywhere(frame_of(tag, bytes(bad)), "granted is .*must be 0 or 1")


def test_history_count_larger_than_body() -> None:
    body = struct.pack(">QQII", 6, 0x3000000, 1, 2) + struct.pack(">QQ", 1, 0)
    rejected_everywhere(frame_of("e", body), "term_history count 2 needs 32 bytes, 16 remain")
    body = struct.pack(">QQII", 6, 0x3000000, 1, U32)
    rejected_everywhere(frame_of("e", body), "term history of 4294967295 entries exceeds 10000")
    body = struct.pack(">QQII", 6, 0x3000000, 2, 0) + struct.pack(">I", 1) + b"\x00" * 11
    rejected_everywhere(frame_of("e", body), "timeline_history count 1 needs 12 bytes, 11 remain")
    vote = struct.pack(">QBQQIII", 5, 1, 9, 0, 0, 1, 0) + struct.pack(">I", 1) + b"\x00" * 11
    rejected_everywhere(frame_of("V", vote), "timeline_history count 1 needs 12 bytes, 11 remain")
    vote = struct.pack(">QBQQIII", 5, 1, 9, 0, 0, 1, 1)
    rejected_everywhere(frame_of("V", vote), "term_history count 1")


def test_string_length_mismatch() -> None:
    body = struct.pack(">H", 5) + b"abc"
    rejected_everywhere(frame_of("x", body), "declares 5 bytes but 3 follow")
    body = struct.pack(">H", 1) + b"abc"
    rejected_everywhere(frame_of("x", body), "declares 1 bytes but 3 follow")


def test_invalid_utf8() -> None:
    for raw in (b"\xff", b"ab\xc3", b"\xed\xa0\x80", b"\xc0\xaf"):
        rejected_everywhere(frame_of("x", struct.pack(">H", len(raw)) + raw), "not valid UTF-8")
        greeting = struct.pack(">IQIIIHH", PROTOCOL_VERSION, 1, 1, 1, 1, 3, len(raw)) + raw
        rejected_everywhere(frame_of("g", greeting), "proposer_id is not valid UTF-8")


# ---------------------------------------------------------------- encode errors


@pytest.mark.parametrize(
    "msg",
    [
        VoteRequest(-1),
        VoteRequest(2**64),
        GreetingReply(1, U64 + 1),
        AppendReply(0, -5, 0),
        Append(2**64, 0, 0, 0),
        Greeting(PROTOCOL_VERSION, "p", 1, 2**32, 1, 1),
        VoteReply(1, True, 0, (), (), tail_crc=2**32),
        VoteReply(1, True, 0, (TermEntry(-1, 0),), ()),
        Elected(1, 0, (TermEntry(1, 2**64),)),
        VoteReply(1, True, 0, (), (TimelineEntry(2**32, 0),)),
        VoteReply(1, True, 0, (), (TimelineEntry(2, 5),), timeline=2),
        Elected(1, 0, (), 2**32),
        Elected(1, 0, (), 2, (TimelineEntry(2, 5),)),
        Elected(1, 0, (), 0, (TimelineEntry(1, 5),)),
        Elected(1, 0, (), 3, (TimelineEntry(2, 5), TimelineEntry(1, 6))),
        GreetingReply(1, 1, 65536),
        InfoReply(1, 2, 3, 4, 5, 6, 7, 8, 9, True, -1),
        Greeting(PROTOCOL_VERSION, "x" * 65536, 1, 1, 1, 1),
        Greeting(PROTOCOL_VERSION, "\ud800", 1, 1, 1, 1),
        Refusal("é" * 40000),
    ],
    ids=repr,
)
def test_encode_rejects_values_that_do_not_fit(msg: Message) -> None:
    with pytest.raises(EncodeError):
        encode(msg)


@pytest.mark.parametrize(
    "msg",
    [
        VoteRequest(MAX_TERM + 1),
        GreetingReply(1, MAX_TERM + 1),
        VoteReply(MAX_TERM + 1, True, 0, (), ()),
        VoteReply(1, True, MAX_LSN + 1, (), ()),
        VoteReply(1, True, 0, (), (), tail_lsn=MAX_LSN + 1),
        VoteReply(3, True, 0, (TermEntry(2, 0), TermEntry(1, 5)), ()),
        VoteReply(3, True, 0, (TermEntry(1, 5), TermEntry(2, 4)), ()),
        VoteReply(3, True, 0, (), (TimelineEntry(0, 5),)),
        VoteReply(3, True, 0, (), (TimelineEntry(2, 5), TimelineEntry(2, 6))),
        VoteReply(3, True, 0, tuple(TermEntry(t, 0) for t in range(1, MAX_HISTORY + 2)), ()),
        Elected(MAX_TERM + 1, 0, ()),
        Elected(1, MAX_LSN + 1, ()),
        Elected(2, 0, (TermEntry(2, 0), TermEntry(2, 0))),
        ElectedReply(MAX_TERM + 1, 0),
        ElectedReply(1, MAX_LSN + 1),
        Append(MAX_TERM + 1, 0, 0, 0),
        Append(1, MAX_LSN - 10, 0, 0, bytes(11)),
        Append(1, 0, MAX_LSN + 1, 0),
        Append(1, 0, 0, MAX_LSN + 1),
        AppendReply(MAX_TERM + 1, 0, 0),
        AppendReply(1, MAX_LSN + 1, 0),
        AppendReply(1, 0, MAX_LSN + 1),
        InfoReply(1, 1, 1, 1, 1, MAX_TERM + 1, 1, 0, 0, False),
        InfoReply(1, 1, 1, 1, 1, 1, MAX_TERM + 1, 0, 0, False),
        InfoReply(1, 1, 1, 1, 1, 1, 1, MAX_LSN + 1, 0, False),
        InfoReply(1, 1, 1, 1, 1, 1, 1, 0, MAX_LSN + 1, False),
        InfoReply(1, 1, 1, 1, 1, 1, 1, 0, 0, False, members=MAX_MEMBERS + 1),
        InfoReply(1, 1, 1, 1, 1, 1, 1, 0, 0, False, lost_disk_term=MAX_TERM + 1),
        VoteReply(1, False, 0, (), (), lost_disk_term=MAX_TERM + 1),
        Greeting(PROTOCOL_VERSION, "p", 1, 1, 1 << 24, 15, MAX_MEMBERS + 1),
    ],
    ids=repr,
)
def test_out_of_bounds_fields_are_refused_both_ways(msg: Message) -> None:
    """Whatever a peer may not send, we refuse to encode; a frame carrying it anyway does not decode."""
    with pytest.raises(EncodeError, match="outside|ascending|exceeds"):
        encode(msg)
    with pytest.raises(LimitError):
        check_bounds(msg)
    frame = _encode_unchecked(msg)
    rejected_everywhere(frame, "outside|ascending|exceeds")
    with pytest.raises(FieldError):  # a whole frame: the safekeeper may say why it refuses it
        FrameDecoder().feed(frame)


def test_an_append_ending_past_the_wal_range_is_refused_in_its_own_buffer() -> None:
    data = bytes(64 * 1024)  # long enough to be received into a buffer of its own
    frame = _encode_unchecked(Append(1, MAX_LSN - len(data) + 1, 0, 0, data))
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match="end LSN"):
        for pos in range(0, len(frame), 1000):
            dec.feed(frame[pos:pos + 1000])
    assert FrameDecoder().feed(encode(Append(1, MAX_LSN - len(data), 0, 0, data))) != []


def _encode_unchecked(msg: Message) -> bytes:
    """`msg` encoded as a peer that checks nothing would send it."""
    from sidecar.consensus import codec, limits

    saved = {name: getattr(limits, name) for name in ("MAX_TERM", "MAX_LSN", "MAX_HISTORY")}
    saved_codec = (codec.MAX_TERM, codec.MAX_LSN)
    checks = {name: getattr(limits, name) for name in dir(limits) if name.startswith("check_")}
    try:
        for name in checks:
            setattr(limits, name, lambda value, *args, **kw: value)
        codec.MAX_TERM = codec.MAX_LSN = U64  # type: ignore[misc]
        return encode(msg)
    finally:
        for name, check in checks.items():
            setattr(limits, name, check)
        codec.MAX_TERM, codec.MAX_LSN = saved_codec  # type: ignore[misc]
        assert all(getattr(limits, k) == v for k, v in saved.items())


def test_encode_longest_string() -> None:
    msg = Refusal("x" * 65535)
    assert decode(*split(encode(msg))) == msg


def test_encode_rejects_non_messages() -> None:
    with pytest.raises(TypeError):
        encode(TermEntry(1, 2))  # type: ignore[arg-type]


# ---------------------------------------------------------------- fuzzing

VALID_TAGS = sorted(TAGS.values())


def check_decode(tag: int, body: bytes) -> None:
    """decode() either refuses with ProtocolError or yields a message that encodes back to the input."""
    try:
        msg = decode(tag, body)
    except ProtocolError:
        return
    if isinstance(msg, Greeting) and msg.protocol_version != PROTOCOL_VERSION:
        return
    # Strict decoding means exactly one encoding per message.
    assert encode(msg) == frame_of(tag, body)


def check_stream(data: bytes, rng: random.Random) -> None:
    """FrameDecoder refuses with ProtocolError or returns messages, in any chunking."""
    whole: list[Message] | None
    try:
        whole = FrameDecoder().feed(data)
    except ProtocolError:
        whole = None
    dec = FrameDecoder()
    got: list[Message] = []
    pos = 0
    try:
        while pos < len(data):
            n = rng.randint(1, 16)
            got += dec.feed(data[pos:pos + n])
            pos += n
    except ProtocolError:
        assert whole is None
    else:
        assert whole == got


@pytest.mark.timeout(120)
def test_fuzz_random_bytes() -> None:
    rng = random.Random(0x5AFE)
    for i in range(20_000):
        size = rng.choice((rng.randint(0, 8), rng.randint(0, 64), rng.randint(0, 300)))
        raw = rng.randbytes(size)
        tag = rng.choice(VALID_TAGS) if i % 4 else rng.randrange(256)
        check_decode(tag, raw)
        check_stream(raw, rng)
        # Plausible headers reach the body decoders instead of failing on length.
        check_stream(frame_of(tag, raw), rng)


def mutate(frame: bytes, rng: random.Random) -> bytes:
    """`frame` with a few random edits: flips, overwrites, inserts, deletes, truncation."""
    buf = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and pos < len(buf):
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and pos < len(buf):
            buf[pos] = rng.randrange(256)
        elif op == 2:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:
            del buf[pos:pos + rng.randint(1, 8)]
        elif op == 4:
            del buf[pos:]
        else:
            buf[pos:pos] = rng.choice((b"\x00", b"\x01", b"\x02", b"\xff" * 4))
    return bytes(buf)


@pytest.mark.timeout(120)
def test_fuzz_mutated_frames() -> None:
    rng = random.Random(0xC0DEC)
    frames = [encode(m) for m in SAMPLES]
    for _ in range(20_000):
        frame = mutate(rng.choice(frames), rng)
        if len(frame) >= 5:
            check_decode(frame[4], frame[5:])
            # Keep the length consistent so that the body decoders see the damage.
            fixed = struct.pack(">I", len(frame) - 4) + frame[4:]
            check_stream(fixed, rng)
        check_stream(frame, rng)
        check_stream(frame + rng.choice(frames), rng)


if st is not None:
    u64 = st.integers(0, U64)
    u32 = st.integers(0, U32)
    terms = st.integers(0, MAX_TERM)
    lsns = st.integers(0, MAX_LSN)

    def ascending(make, keys, lsns):  # type: ignore[no-untyped-def]
        """Histories as limits.py allows them: keys strictly ascending, LSNs never going back."""
        return st.lists(st.tuples(keys, lsns), max_size=8, unique_by=lambda e: e[0]).map(
            lambda entries: tuple(make(k, lsn) for k, lsn in zip(sorted(e[0] for e in entries),
                                                                 sorted(e[1] for e in entries))))

    term_histories = ascending(TermEntry, terms, lsns)
    timeline_histories = ascending(TimelineEntry, st.integers(1, U32), lsns)
    utf8_names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)
    messages = st.one_of(
        st.builds(Greeting, st.just(PROTOCOL_VERSION), utf8_names, u64, u32, u32, u32),
        st.builds(GreetingReply, u64, terms),
        st.builds(VoteRequest, terms),
        st.builds(VoteReply, terms, st.booleans(), lsns, term_histories, timeline_histories, lsns, u32),
        st.builds(Elected, terms, lsns, term_histories),
        st.builds(ElectedReply, terms, lsns),
        st.builds(Append, terms, st.integers(0, MAX_LSN - 2000), lsns, lsns, st.binary(max_size=2000)),
        st.builds(AppendReply, terms, lsns, lsns),
        st.builds(Refusal, utf8_names),
    )

    @settings(max_examples=500, deadline=None)
    @given(st.lists(messages, max_size=6), st.data())
    def test_hypothesis_round_trip_in_any_chunking(msgs: list[Message], data: st.DataObject) -> None:
        stream = b"".join(encode(m) for m in msgs)
        cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
        dec = FrameDecoder()
        got: list[Message] = []
        prev = 0
        for cut in cuts + [len(stream)]:
            got += dec.feed(stream[prev:cut])
            prev = cut
        assert got == msgs
        assert read_all(stream) == msgs

    @settings(max_examples=2000, deadline=None)
    @given(st.sampled_from(VALID_TAGS + [0, ord("z")]), st.binary(max_size=200))
    def test_hypothesis_decode_refuses_only_with_protocol_error(tag: int, body: bytes) -> None:
        check_decode(tag, body)


@pytest.mark.parametrize("msg", [
    DegradedRecord(3, DegradedRange(4, 0x100, 1, frozenset({1}))),  # a range of a later term than the message's
    DegradedRecord(3, DegradedRange(0, 0x100, 0, frozenset())),  # no range, with a start
    DegradedRecord(3, DegradedRange(3, 0x100, 1, frozenset({0}))),  # node id 0 names no safekeeper
    DegradedRecord(3, DegradedRange(3, 0x100, 1, frozenset(range(1, MAX_MEMBERS + 2)))),
    DegradedRecord(3, DegradedRange(3, MAX_LSN + 1, 1, frozenset({1}))),
    DegradedRecordReply(MAX_TERM + 1, 1),
], ids=str)
def test_degraded_fields_are_bounded_both_ways(msg: Message) -> None:
    with pytest.raises(EncodeError):
        encode(msg)


def test_degraded_members_have_one_encoding() -> None:
    """Members go ascending; a frame listing them otherwise is refused, so every range has one encoding."""
    frame = bytearray(encode(DegradedRecord(3, DegradedRange(3, 0x100, 1, frozenset({1, 2})))))
    frame[-16:] = struct.pack(">QQ", 2, 1)
    rejected_everywhere(bytes(frame), "ascending")


def test_protocol_version_1_peers_are_told_apart() -> None:
    """A v1 safekeeper's InfoReply (no reader port) names the version; a v1 Greeting decodes to be refused."""
    v1_info = struct.pack(">QQIIIQQQQB", 1, 2, 3, 4, 5, 6, 7, 8, 9, 1)
    rejected_everywhere(frame_of("I", v1_info), "protocol version 1 .*upgrade it")
    v1_greeting = struct.pack(">IQIIIH", 1, 1, 1, 1 << 24, 15, 1) + b"p"
    msg = decode(ord("g"), v1_greeting)
    assert isinstance(msg, Greeting) and msg.protocol_version == 1 and PROTOCOL_VERSION == 5


def test_protocol_version_3_safekeepers_are_told_apart() -> None:
    """A version 3 safekeeper's InfoReply (no member count, no lost disk) says it is older; its Greeting, from a
    version 3 proposer, decodes to its version alone for the safekeeper to refuse by name."""
    v3_info = struct.pack(">QQIIIQQQQBHQ", 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 5433, 0)
    rejected_everywhere(frame_of("I", v3_info), "older version than 5 .*upgrade it")
    v3_greeting = struct.pack(">IQIIIH", 3, 1, 1, 1 << 24, 15, 1) + b"p"
    assert decode(ord("g"), v3_greeting) == Greeting(3, "", 0, 0, 0, 0)


@pytest.mark.parametrize("size", [10, 100_000])  # a small frame's beginning, and a large one's own buffer
def test_the_undecoded_bytes_taken_out_and_fed_back_decode_as_if_never_taken(size: int) -> None:
    """What the safekeeper's compiled stream loop does with a connection's decoder: takes the bytes not yet
    decoded, and later gives back the ones it did not serve."""
    first, second = Append(1, 0, 0, 0, b"a" * size), Append(1, size, 0, 0, b"b" * 7)
    stream = encode(first) + encode(second)
    cut = len(encode(first)) - 3
    dec = FrameDecoder()
    assert dec.feed(stream[:cut]) == []
    held = dec.take()
    assert held == stream[:cut] and dec.pending == 0 and dec.take() == b""
    out: list = []
    dec.buffer_feed(held + stream[cut:], out)
    assert out == [first, second] and dec.pending == 0
    out = []
    with pytest.raises(ProtocolError):
        dec.buffer_feed(encode(second) + b"\0\0\0\0", out)  # a frame of length 0 after a good one
    assert out == [second]  # the message before the bad frame is kept

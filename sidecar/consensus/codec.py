"""Wire encoding of the proposer/safekeeper messages (docs/protocol.md, "Messages").

A frame is a u32 big-endian length of what follows, a one-letter u8 tag, then the body.
Integers are fixed-width big-endian; histories are a u32 count then entries; strings are a
u16 byte length then UTF-8; bools are u8 0/1; Append data is the remainder of the frame.
The frame header, the Greeting's leading u32 protocol_version and the Refusal layout must
stay the same in every protocol version, so that peers of different versions can refuse
each other by name.

Every term, LSN and history is checked against `limits` in both directions, so whatever
decodes re-encodes to the same bytes and nothing out of bounds reaches the cores. Sans IO:
the asyncio side (`sidecar/framing.py`) feeds `FrameDecoder`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from struct import Struct
from types import MappingProxyType
from typing import Any, NoReturn

from sidecar.consensus import limits
from sidecar.consensus.limits import MAX_LSN, MAX_TERM
from sidecar.consensus.messages import (
    NO_DEGRADED,
    NO_FENCE,
    PROTOCOL_VERSION,
    Append,
    AppendReply,
    AuthChallenge,
    AuthConfirm,
    AuthResponse,
    DegradedRange,
    DegradedRecord,
    DegradedRecordReply,
    Elected,
    ElectedReply,
    Greeting,
    GreetingReply,
    InfoReply,
    SlotHold,
    InfoRequest,
    Message,
    Refusal,
    TermEntry,
    TermHistory,
    TimelineFence,
    VoteReply,
    VoteRequest,
)
from sidecar.timelines import TimelineEntry, TimelineHistory

__all__ = [
    "FRAME_HEADER_SIZE",
    "MAX_FRAME",
    "REPLY_MAX_FRAME",
    "TAGS",
    "EncodeError",
    "FieldError",
    "FrameDecoder",
    "ProtocolError",
    "check_bounds",
    "decode",
    "encode",
    "encode_append_parts",
]

# Append carries at most a few MiB of WAL; the KiB leaves room for its header.
MAX_FRAME = 16 * 1024 * 1024 + 1024
FRAME_HEADER_SIZE = 4

TAG_GREETING = ord("g")
TAG_GREETING_REPLY = ord("G")
TAG_VOTE_REQUEST = ord("v")
TAG_VOTE_REPLY = ord("V")
TAG_ELECTED = ord("e")
TAG_ELECTED_REPLY = ord("E")
TAG_APPEND = ord("a")
TAG_APPEND_REPLY = ord("A")
TAG_REFUSAL = ord("x")
TAG_INFO_REQUEST = ord("i")
TAG_INFO_REPLY = ord("I")
TAG_AUTH_CHALLENGE = ord("c")
TAG_AUTH_RESPONSE = ord("r")
TAG_AUTH_CONFIRM = ord("R")
TAG_DEGRADED_RECORD = ord("d")
TAG_DEGRADED_RECORD_REPLY = ord("D")

TAGS: MappingProxyType[type, int] = MappingProxyType({
    Greeting: TAG_GREETING,
    GreetingReply: TAG_GREETING_REPLY,
    VoteRequest: TAG_VOTE_REQUEST,
    VoteReply: TAG_VOTE_REPLY,
    Elected: TAG_ELECTED,
    ElectedReply: TAG_ELECTED_REPLY,
    Append: TAG_APPEND,
    AppendReply: TAG_APPEND_REPLY,
    Refusal: TAG_REFUSAL,
    InfoRequest: TAG_INFO_REQUEST,
    InfoReply: TAG_INFO_REPLY,
    AuthChallenge: TAG_AUTH_CHALLENGE,
    AuthResponse: TAG_AUTH_RESPONSE,
    AuthConfirm: TAG_AUTH_CONFIRM,
    DegradedRecord: TAG_DEGRADED_RECORD,
    DegradedRecordReply: TAG_DEGRADED_RECORD_REPLY,
})

_U32 = Struct(">I")
_U16 = Struct(">H")
_FRAME = Struct(">IB")
_TERM_ENTRY = Struct(">QQ")
_TIMELINE_ENTRY = Struct(">IQ")

# Bodies. Fixed prefixes end with the count or length of what follows, so one unpack reads it.
# protocol_version, system_id, timeline, wal_seg_size, pg_version, members, len(proposer_id)
_GREETING = Struct(">IQIIIHH")
_GREETING_REPLY = Struct(">QQH")  # node_id, term, reader_port
_VOTE_REQUEST = Struct(">Q")  # term
# term, granted, flush_lsn, tail_lsn, tail_crc, timeline, len(term_history); then the term and timeline histories
_VOTE_REPLY = Struct(">QBQQIII")
# term, start_lsn, timeline, len(term_history); then the term and timeline histories
_ELECTED = Struct(">QQII")
_ELECTED_REPLY = Struct(">QQ")  # term, flush_lsn
_FENCE = Struct(">QIQ")  # a TimelineFence (term, timeline, lsn), after the histories of VoteReply and Elected
_LOST_DISK_TERM = Struct(">Q")  # VoteReply's, after its fence
_APPEND = Struct(">QQQQ")  # term, begin_lsn, commit_lsn, peer_horizon_lsn; data follows
_APPEND_REPLY = Struct(">QQQ")  # term, flush_lsn, commit_lsn
_REFUSAL = Struct(">H")  # len(reason)
# node_id, system_id, wal_seg_size, pg_version, timeline, term, last_log_term, flush_lsn,
# commit_lsn, proposer_connected, reader_port, backup_lsn, members, amnesic, lost_disk_term
_INFO_REPLY = Struct(">QQIIIQQQQBHQHBQ")
# InfoReply of protocol version 1 (no reader port, no backup_lsn) and of versions 2 and 3 without a report (no
# members, amnesic, lost_disk_term): a client is told the safekeeper is older than it.
_INFO_REPLY_OLDER_SIZES = {Struct(">QQIIIQQQQB").size: 1, Struct(">QQIIIQQQQBHQ").size: 3}
# Then a report, only when there is something in it (so the reply is unchanged on the wire while there is
# none): slot_wal_limit, len(slots); per slot its WAL held, invalidated, then its name as a u16-length
# string; then the archived object it found not to be its WAL, a u16-length string ("": none).
# then the safekeeper's copy of a degraded range (a DegradedRange: term 0 is none) and its degrade_term (u64).
_INFO_SLOTS = Struct(">QH")
_INFO_SLOT = Struct(">QB")
MAX_INFO_SLOTS = 1000
# A DegradedRange: term, start_lsn, version, len(members); then each member's node id, ascending.
_DEGRADED = Struct(">QQQH")
_NODE_ID = Struct(">Q")
_DEGRADED_RECORD = Struct(">Q")  # term; then a DegradedRange
_DEGRADED_RECORD_REPLY = Struct(">QQ")  # term, version
# AuthChallenge: nonce, then the certificate as a u16 length and its bytes (none from link auth v1);
# AuthResponse: nonce, the u16 port dialled, then certificate, host and signature, each a u16 length
# and its bytes; AuthConfirm: certificate and signature the same way.

# Whole frames of fixed-size messages, so that encoding one is a single pack() call.
_GREETING_REPLY_FRAME = Struct(">IB" + _GREETING_REPLY.format[1:])
_VOTE_REQUEST_FRAME = Struct(">IB" + _VOTE_REQUEST.format[1:])
_ELECTED_REPLY_FRAME = Struct(">IB" + _ELECTED_REPLY.format[1:])
_APPEND_REPLY_FRAME = Struct(">IB" + _APPEND_REPLY.format[1:])
_APPEND_HEADER_FRAME = Struct(">IB" + _APPEND.format[1:])

_MAX_APPEND_DATA = MAX_FRAME - 1 - _APPEND.size
# The longest frame a safekeeper sends: a VoteReply with both histories at their limit (an Elected,
# which the proposer sends, is as long).
REPLY_MAX_FRAME = (1 + _VOTE_REPLY.size + limits.MAX_HISTORY * _TERM_ENTRY.size + _U32.size
                   + limits.MAX_HISTORY * _TIMELINE_ENTRY.size + _FENCE.size + _LOST_DISK_TERM.size)


class ProtocolError(Exception):
    """Malformed frame or message; the connection it came from must be closed."""


class FieldError(ProtocolError):
    """A whole, well-framed message with a field outside limits.py: the peer can be told which."""


class EncodeError(ProtocolError):
    """Our own message does not fit the wire or its bounds: a bug on this side, not the peer's."""


def _reject_length(length: int, maximum: int = MAX_FRAME) -> NoReturn:
    if length == 0:
        raise ProtocolError("frame length 0: a frame holds at least its tag byte")
    raise ProtocolError(f"frame length {length} exceeds the maximum of {maximum}")


# ---------------------------------------------------------------- bounds, in both directions


def _check_vote_reply(m: VoteReply) -> None:
    limits.check_term(m.term)
    limits.check_lsn(m.flush_lsn, "flush LSN")
    limits.check_lsn(m.tail_lsn, "tail LSN")
    limits.check_term_history(m.term_history)
    # 0: a voter that names no timeline; its history is still checked.
    limits.check_timeline(m.timeline, m.timeline_history if m.timeline else ())
    limits.check_timeline_history(m.timeline_history)
    limits.check_fence(m.fence, limits.MAX_TERM)  # a voter may hold a fence above the term it reports
    limits.check_term(m.lost_disk_term, "lost disk term")


def _check_greeting(m: Greeting) -> None:
    limits.check_members(m.members)


def _check_elected(m: Elected) -> None:
    limits.check_term(m.term)
    limits.check_lsn(m.start_lsn, "start LSN")
    limits.check_term_history(m.term_history)
    limits.check_timeline(m.timeline, m.timeline_history)
    limits.check_fence(m.fence, m.term)


def _check_term(m: VoteRequest) -> None:
    limits.check_term(m.term)


def _check_greeting_reply(m: GreetingReply) -> None:
    limits.check_term(m.term)
    limits.check_port(m.reader_port)


def _check_elected_reply(m: ElectedReply) -> None:
    limits.check_term(m.term)
    limits.check_lsn(m.flush_lsn, "flush LSN")


def _check_append_reply(m: AppendReply) -> None:
    limits.check_term(m.term)
    limits.check_lsn(m.flush_lsn, "flush LSN")
    limits.check_lsn(m.commit_lsn, "commit LSN")


def _check_append(term: int, begin: int, size: int, commit: int, horizon: int) -> None:
    """Called only when the one-line test in the hot paths fails: says which field is out of bounds."""
    limits.check_term(term)
    limits.check_lsn(commit, "commit LSN")
    limits.check_lsn(horizon, "peer horizon LSN")
    limits.check_lsn(begin + size, "end LSN")


def _check_info_reply(m: InfoReply) -> None:
    limits.check_term(m.term)
    limits.check_term(m.last_log_term, "last log term")
    limits.check_lsn(m.flush_lsn, "flush LSN")
    limits.check_lsn(m.commit_lsn, "commit LSN")
    limits.check_port(m.reader_port)
    limits.check_lsn(m.backup_lsn, "backup LSN")
    limits.check_lsn(m.slot_wal_limit, "slot WAL limit")
    if len(m.slots) > MAX_INFO_SLOTS:
        raise ProtocolError(f"InfoReply: {len(m.slots)} slots exceed {MAX_INFO_SLOTS}")
    for slot in m.slots:
        limits.check_lsn(slot.wal_bytes, "slot WAL held")
    limits.check_object_name(m.archive_mismatch)
    limits.check_fence(m.fence, limits.MAX_TERM)
    limits.check_members(m.members)
    limits.check_term(m.lost_disk_term, "lost disk term")
    limits.check_degraded(m.degraded, limits.MAX_TERM)
    limits.check_term(m.degrade_term, "degrade term")


def _check_degraded_record(m: DegradedRecord) -> None:
    limits.check_term(m.term)
    limits.check_degraded(m.record, m.term)


def _check_degraded_record_reply(m: DegradedRecordReply) -> None:
    limits.check_term(m.term)
    limits.check_term(m.version, "degraded range version")


def _check_auth_challenge(m: AuthChallenge) -> None:
    limits.check_nonce(m.nonce)
    if m.certificate:  # empty only as decoded from an older safekeeper, which linkauth then refuses
        limits.check_auth_field("certificate", m.certificate, limits.MAX_AUTH_CERT)


def _check_auth_response(m: AuthResponse) -> None:
    limits.check_nonce(m.nonce)
    if not 0 <= m.port <= 0xFFFF:
        raise limits.LimitError(f"port {m.port} is outside 0..65535")
    limits.check_auth_field("certificate", m.certificate, limits.MAX_AUTH_CERT)
    limits.check_auth_field("host", m.host.encode("utf-8", "surrogatepass"), limits.MAX_AUTH_HOST)
    limits.check_auth_field("signature", m.signature, limits.MAX_AUTH_SIGNATURE)


def _check_auth_confirm(m: AuthConfirm) -> None:
    limits.check_auth_field("certificate", m.certificate, limits.MAX_AUTH_CERT)
    limits.check_auth_field("signature", m.signature, limits.MAX_AUTH_SIGNATURE)


_BOUNDS: MappingProxyType[type, Callable[[Any], None]] = MappingProxyType({
    Greeting: _check_greeting,
    GreetingReply: _check_greeting_reply,
    VoteRequest: _check_term,
    VoteReply: _check_vote_reply,
    Elected: _check_elected,
    ElectedReply: _check_elected_reply,
    Append: lambda m: _check_append(m.term, m.begin_lsn, len(m.data), m.commit_lsn, m.peer_horizon_lsn),
    AppendReply: _check_append_reply,
    InfoReply: _check_info_reply,
    AuthChallenge: _check_auth_challenge,
    AuthResponse: _check_auth_response,
    AuthConfirm: _check_auth_confirm,
    DegradedRecord: _check_degraded_record,
    DegradedRecordReply: _check_degraded_record_reply,
})


def check_bounds(msg: Message) -> None:
    """limits.LimitError unless every term, LSN and history in `msg` is within limits.py.

    What encode() refuses and decode() refuses; for a core driven without the codec (the simulator).
    """
    check = _BOUNDS.get(type(msg))
    if check is not None:
        check(msg)


# ---------------------------------------------------------------- encoding


def _utf8(text: str, what: str) -> bytes:
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ProtocolError(f"{what} is not encodable as UTF-8: {e}") from None
    if len(raw) > 0xFFFF:
        raise ProtocolError(f"{what} is {len(raw)} bytes of UTF-8, the limit is 65535")
    return raw


def _term_entries_bytes(history: TermHistory) -> bytes:
    flat = [v for entry in history for v in (entry.term, entry.start_lsn)]
    return struct.pack(f">{len(flat)}Q", *flat)


def _timeline_history_bytes(history: TimelineHistory) -> bytes:
    return _U32.pack(len(history)) + b"".join(
        _TIMELINE_ENTRY.pack(entry.timeline, entry.switch_lsn) for entry in history
    )


def _fence_bytes(fence: TimelineFence) -> bytes:
    return _FENCE.pack(fence.term, fence.timeline, fence.lsn)


def _degraded_bytes(record: DegradedRange) -> bytes:
    members = sorted(record.members)
    return _DEGRADED.pack(record.term, record.start_lsn, record.version, len(members)) + b"".join(
        _NODE_ID.pack(n) for n in members)


def _framed(tag: int, body: bytes) -> bytes:
    if len(body) + 1 > MAX_FRAME:
        raise ProtocolError(f"message body of {len(body)} bytes does not fit in a frame")
    return _FRAME.pack(len(body) + 1, tag) + body


def _encode_greeting(m: Greeting) -> bytes:
    _check_greeting(m)
    pid = _utf8(m.proposer_id, "proposer_id")
    head = _GREETING.pack(m.protocol_version, m.system_id, m.timeline, m.wal_seg_size, m.pg_version, m.members,
                          len(pid))
    return _framed(TAG_GREETING, head + pid)


def _encode_greeting_reply(m: GreetingReply) -> bytes:
    _check_greeting_reply(m)
    return _GREETING_REPLY_FRAME.pack(1 + _GREETING_REPLY.size, TAG_GREETING_REPLY, m.node_id, m.term,
                                      m.reader_port)


def _encode_vote_request(m: VoteRequest) -> bytes:
    _check_term(m)
    return _VOTE_REQUEST_FRAME.pack(1 + _VOTE_REQUEST.size, TAG_VOTE_REQUEST, m.term)


def _encode_vote_reply(m: VoteReply) -> bytes:
    _check_vote_reply(m)
    head = _VOTE_REPLY.pack(
        m.term, 1 if m.granted else 0, m.flush_lsn, m.tail_lsn, m.tail_crc, m.timeline, len(m.term_history)
    )
    body = (head + _term_entries_bytes(m.term_history) + _timeline_history_bytes(m.timeline_history)
            + _fence_bytes(m.fence) + _LOST_DISK_TERM.pack(m.lost_disk_term))
    return _framed(TAG_VOTE_REPLY, body)


def _encode_elected(m: Elected) -> bytes:
    _check_elected(m)
    head = _ELECTED.pack(m.term, m.start_lsn, m.timeline, len(m.term_history))
    body = (head + _term_entries_bytes(m.term_history) + _timeline_history_bytes(m.timeline_history)
            + _fence_bytes(m.fence))
    return _framed(TAG_ELECTED, body)


def _encode_elected_reply(m: ElectedReply) -> bytes:
    _check_elected_reply(m)
    return _ELECTED_REPLY_FRAME.pack(1 + _ELECTED_REPLY.size, TAG_ELECTED_REPLY, m.term, m.flush_lsn)


def _encode_append(m: Append) -> bytes:
    header, data = encode_append_parts(m.term, m.begin_lsn, m.commit_lsn, m.peer_horizon_lsn, m.data)
    return header + data


def _encode_append_reply(m: AppendReply) -> bytes:
    _check_append_reply(m)
    return _APPEND_REPLY_FRAME.pack(
        1 + _APPEND_REPLY.size, TAG_APPEND_REPLY, m.term, m.flush_lsn, m.commit_lsn
    )


def _encode_refusal(m: Refusal) -> bytes:
    reason = _utf8(m.reason, "refusal reason")
    return _framed(TAG_REFUSAL, _REFUSAL.pack(len(reason)) + reason)


def _encode_info_request(m: InfoRequest) -> bytes:
    return _FRAME.pack(1, TAG_INFO_REQUEST)


def _encode_info_reply(m: InfoReply) -> bytes:
    _check_info_reply(m)
    body = _INFO_REPLY.pack(m.node_id, m.system_id, m.wal_seg_size, m.pg_version, m.timeline, m.term,
                            m.last_log_term, m.flush_lsn, m.commit_lsn, 1 if m.proposer_connected else 0,
                            m.reader_port, m.backup_lsn, m.members, 1 if m.amnesic else 0, m.lost_disk_term)
    if _has_report(m):  # without one, the shortest body
        body += _INFO_SLOTS.pack(m.slot_wal_limit, len(m.slots)) + b"".join(
            _INFO_SLOT.pack(h.wal_bytes, 1 if h.invalidated else 0) + _blob(_utf8(h.name, "slot name"))
            for h in m.slots) + _fence_bytes(m.fence) + _blob(_utf8(m.archive_mismatch, "archive mismatch")) \
            + _degraded_bytes(m.degraded) + _LOST_DISK_TERM.pack(m.degrade_term)
    return _framed(TAG_INFO_REPLY, body)


def _has_report(m: InfoReply) -> bool:
    return bool(m.slot_wal_limit or m.slots or m.archive_mismatch or m.fence != NO_FENCE or m.degraded
                or m.degrade_term)


def _encode_degraded_record(m: DegradedRecord) -> bytes:
    _check_degraded_record(m)
    return _framed(TAG_DEGRADED_RECORD, _DEGRADED_RECORD.pack(m.term) + _degraded_bytes(m.record))


def _encode_degraded_record_reply(m: DegradedRecordReply) -> bytes:
    _check_degraded_record_reply(m)
    return _framed(TAG_DEGRADED_RECORD_REPLY, _DEGRADED_RECORD_REPLY.pack(m.term, m.version))


def _blob(value: bytes) -> bytes:
    return _U16.pack(len(value)) + bytes(value)


def _encode_auth_challenge(m: AuthChallenge) -> bytes:
    _check_auth_challenge(m)
    return _framed(TAG_AUTH_CHALLENGE, bytes(m.nonce) + (_blob(m.certificate) if m.certificate else b""))


def _encode_auth_response(m: AuthResponse) -> bytes:
    _check_auth_response(m)
    body = bytes(m.nonce) + _U16.pack(m.port) + _blob(m.certificate) + _blob(_utf8(m.host, "host")) \
        + _blob(m.signature)
    return _framed(TAG_AUTH_RESPONSE, body)


def _encode_auth_confirm(m: AuthConfirm) -> bytes:
    _check_auth_confirm(m)
    return _framed(TAG_AUTH_CONFIRM, _blob(m.certificate) + _blob(m.signature))


_ENCODERS: MappingProxyType[type, Callable[[Any], bytes]] = MappingProxyType({
    Greeting: _encode_greeting,
    GreetingReply: _encode_greeting_reply,
    VoteRequest: _encode_vote_request,
    VoteReply: _encode_vote_reply,
    Elected: _encode_elected,
    ElectedReply: _encode_elected_reply,
    Append: _encode_append,
    AppendReply: _encode_append_reply,
    Refusal: _encode_refusal,
    InfoRequest: _encode_info_request,
    InfoReply: _encode_info_reply,
    DegradedRecord: _encode_degraded_record,
    DegradedRecordReply: _encode_degraded_record_reply,
    AuthChallenge: _encode_auth_challenge,
    AuthResponse: _encode_auth_response,
    AuthConfirm: _encode_auth_confirm,
})


def encode(msg: Message) -> bytes:
    """The whole frame for `msg`; EncodeError if a field does not fit its wire type or its bounds."""
    encoder = _ENCODERS.get(type(msg))
    if encoder is None:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    try:
        return encoder(msg)
    except EncodeError:
        raise
    except (struct.error, limits.LimitError, ProtocolError) as e:
        raise EncodeError(f"cannot encode {type(msg).__name__}: {e}") from None


def encode_append_parts(
    term: int, begin_lsn: int, commit_lsn: int, peer_horizon_lsn: int, data: bytes | bytearray | memoryview
) -> tuple[bytes, bytes | bytearray | memoryview]:
    """An Append frame as (header, data), for writelines() without copying the WAL bytes."""
    size = len(data) if isinstance(data, (bytes, bytearray)) else memoryview(data).nbytes
    if size > _MAX_APPEND_DATA:
        raise EncodeError(f"Append data of {size} bytes exceeds the maximum of {_MAX_APPEND_DATA}")
    try:
        if term > MAX_TERM or begin_lsn + size > MAX_LSN or commit_lsn > MAX_LSN or peer_horizon_lsn > MAX_LSN:
            _check_append(term, begin_lsn, size, commit_lsn, peer_horizon_lsn)
        header = _APPEND_HEADER_FRAME.pack(
            1 + _APPEND.size + size, TAG_APPEND, term, begin_lsn, commit_lsn, peer_horizon_lsn
        )
    except (struct.error, limits.LimitError) as e:
        raise EncodeError(f"cannot encode Append: {e}") from None
    return header, data


# ---------------------------------------------------------------- decoding

Body = bytes | bytearray | memoryview


def _need_exact(body: Body, size: int, name: str) -> None:
    if len(body) != size:
        raise ProtocolError(f"{name} body is {len(body)} bytes, expected {size}")


def _need_at_least(body: Body, size: int, name: str) -> None:
    if len(body) < size:
        raise ProtocolError(f"{name} body is {len(body)} bytes, expected at least {size}")


def _text(body: Body, start: int, length: int, what: str, name: str) -> str:
    end = start + length
    if end != len(body):
        raise ProtocolError(
            f"{name}: {what} declares {length} bytes but {len(body) - start} follow"
        )
    try:
        return str(body[start:end], "utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{name}: {what} is not valid UTF-8: {e}") from None


def _bool(value: int, what: str, name: str) -> bool:
    if value > 1:
        raise ProtocolError(f"{name}: {what} is {value}, a bool must be 0 or 1")
    return value == 1


def _term_entries(body: Body, start: int, count: int, name: str) -> tuple[TermHistory, int]:
    if count > limits.MAX_HISTORY:
        raise FieldError(f"{name} term history of {count} entries exceeds {limits.MAX_HISTORY}")
    end = start + count * _TERM_ENTRY.size
    if end > len(body):
        raise ProtocolError(
            f"{name}: term_history count {count} needs {end - start} bytes, {len(body) - start} remain"
        )
    history = tuple(TermEntry(t, lsn) for t, lsn in _TERM_ENTRY.iter_unpack(body[start:end]))
    return history, end


def _timeline_entries(body: Body, start: int, name: str) -> tuple[TimelineHistory, int]:
    if start + 4 > len(body):
        raise ProtocolError(f"{name}: body ends before the timeline_history count")
    (count,) = _U32.unpack_from(body, start)
    if count > limits.MAX_HISTORY:
        raise FieldError(f"{name} timeline history of {count} entries exceeds {limits.MAX_HISTORY}")
    start += 4
    end = start + count * _TIMELINE_ENTRY.size
    if end > len(body):
        raise ProtocolError(
            f"{name}: timeline_history count {count} needs {end - start} bytes, {len(body) - start} remain"
        )
    history = tuple(TimelineEntry(tli, lsn) for tli, lsn in _TIMELINE_ENTRY.iter_unpack(body[start:end]))
    return history, end


def _fence(body: Body, start: int, name: str) -> tuple[TimelineFence, int]:
    if start + _FENCE.size > len(body):
        raise ProtocolError(f"{name}: body ends before the timeline fence")
    return TimelineFence(*_FENCE.unpack_from(body, start)), start + _FENCE.size


def _no_trailing(body: Body, end: int, name: str) -> None:
    if end != len(body):
        raise ProtocolError(f"{name}: {len(body) - end} trailing bytes")


def _decode_greeting(body: Body) -> Greeting:
    _need_at_least(body, 4, "Greeting")
    (version,) = _U32.unpack_from(body)
    if version != PROTOCOL_VERSION:
        # Another version's layout is unknown past this field: hand the safekeeper just
        # the version so it can refuse the proposer by name instead of as garbage.
        return Greeting(version, "", 0, 0, 0, 0)
    _need_at_least(body, _GREETING.size, "Greeting")
    version, system_id, timeline, seg_size, pg_version, members, id_len = _GREETING.unpack_from(body)
    proposer_id = _text(body, _GREETING.size, id_len, "proposer_id", "Greeting")
    m = Greeting(version, proposer_id, system_id, timeline, seg_size, pg_version, members)
    _check_greeting(m)
    return m


def _decode_greeting_reply(body: Body) -> GreetingReply:
    _need_exact(body, _GREETING_REPLY.size, "GreetingReply")
    m = GreetingReply(*_GREETING_REPLY.unpack_from(body))
    _check_greeting_reply(m)
    return m


def _decode_vote_request(body: Body) -> VoteRequest:
    _need_exact(body, _VOTE_REQUEST.size, "VoteRequest")
    m = VoteRequest(*_VOTE_REQUEST.unpack_from(body))
    _check_term(m)
    return m


def _decode_vote_reply(body: Body) -> VoteReply:
    _need_at_least(body, _VOTE_REPLY.size, "VoteReply")
    term, granted, flush_lsn, tail_lsn, tail_crc, timeline, count = _VOTE_REPLY.unpack_from(body)
    terms, pos = _term_entries(body, _VOTE_REPLY.size, count, "VoteReply")
    timelines, pos = _timeline_entries(body, pos, "VoteReply")
    fence, pos = _fence(body, pos, "VoteReply")
    _need_at_least(body, pos + _LOST_DISK_TERM.size, "VoteReply")
    (lost_disk_term,) = _LOST_DISK_TERM.unpack_from(body, pos)
    pos += _LOST_DISK_TERM.size
    _no_trailing(body, pos, "VoteReply")
    m = VoteReply(term, _bool(granted, "granted", "VoteReply"), flush_lsn, terms, timelines, tail_lsn, tail_crc,
                  timeline, fence, lost_disk_term)
    _check_vote_reply(m)
    return m


def _decode_elected(body: Body) -> Elected:
    _need_at_least(body, _ELECTED.size, "Elected")
    term, start_lsn, timeline, count = _ELECTED.unpack_from(body)
    terms, pos = _term_entries(body, _ELECTED.size, count, "Elected")
    timelines, pos = _timeline_entries(body, pos, "Elected")
    fence, pos = _fence(body, pos, "Elected")
    _no_trailing(body, pos, "Elected")
    m = Elected(term, start_lsn, terms, timeline, timelines, fence)
    _check_elected(m)
    return m


def _decode_elected_reply(body: Body) -> ElectedReply:
    _need_exact(body, _ELECTED_REPLY.size, "ElectedReply")
    m = ElectedReply(*_ELECTED_REPLY.unpack_from(body))
    _check_elected_reply(m)
    return m


def _decode_append(body: Body, data: Body | None = None) -> Append:
    """`data`, if given, is the WAL already cut out of `body` (and kept without a copy)."""
    _need_at_least(body, _APPEND.size, "Append")
    term, begin_lsn, commit_lsn, horizon = _APPEND.unpack_from(body)
    if data is None:
        data = bytes(body[_APPEND.size:])
    size = len(body) - _APPEND.size
    if term > MAX_TERM or begin_lsn + size > MAX_LSN or commit_lsn > MAX_LSN or horizon > MAX_LSN:
        _check_append(term, begin_lsn, size, commit_lsn, horizon)
    return Append(term, begin_lsn, commit_lsn, horizon, data)  # type: ignore[arg-type]


def _decode_append_reply(body: Body) -> AppendReply:
    _need_exact(body, _APPEND_REPLY.size, "AppendReply")
    term, flush_lsn, commit_lsn = _APPEND_REPLY.unpack_from(body)
    if term > MAX_TERM or flush_lsn > MAX_LSN or commit_lsn > MAX_LSN:  # the proposer's hot path
        _check_append_reply(AppendReply(term, flush_lsn, commit_lsn))
    return AppendReply(term, flush_lsn, commit_lsn)


def _decode_refusal(body: Body) -> Refusal:
    _need_at_least(body, _REFUSAL.size, "Refusal")
    (length,) = _REFUSAL.unpack_from(body)
    return Refusal(_text(body, _REFUSAL.size, length, "reason", "Refusal"))


def _decode_info_request(body: Body) -> InfoRequest:
    _need_exact(body, 0, "InfoRequest")
    return InfoRequest()


def _decode_info_reply(body: Body) -> InfoReply:
    older = _INFO_REPLY_OLDER_SIZES.get(len(body))
    if older is not None:
        which = "version 1" if older == 1 else f"an older version than {PROTOCOL_VERSION}"
        raise ProtocolError(f"the safekeeper speaks protocol {which} (this walsidecar speaks {PROTOCOL_VERSION}): "
                            "upgrade it to this release")
    _need_at_least(body, _INFO_REPLY.size, "InfoReply")
    *fields, connected, reader_port, backup, members, amnesic, lost_disk_term = _INFO_REPLY.unpack_from(body)
    limit, slots, mismatch, fence, degraded, degrade_term = 0, [], "", NO_FENCE, NO_DEGRADED, 0
    if len(body) > _INFO_REPLY.size:
        _need_at_least(body, _INFO_REPLY.size + _INFO_SLOTS.size, "InfoReply")
        limit, count = _INFO_SLOTS.unpack_from(body, _INFO_REPLY.size)
        if count > MAX_INFO_SLOTS:
            raise ProtocolError(f"InfoReply: {count} slots exceed {MAX_INFO_SLOTS}")
        at = _INFO_REPLY.size + _INFO_SLOTS.size
        for _ in range(count):
            _need_at_least(body, at + _INFO_SLOT.size + _U16.size, "InfoReply")
            held, invalidated = _INFO_SLOT.unpack_from(body, at)
            (length,) = _U16.unpack_from(body, at + _INFO_SLOT.size)
            at += _INFO_SLOT.size + _U16.size
            _need_at_least(body, at + length, "InfoReply")
            try:
                name = str(body[at:at + length], "utf-8")
            except UnicodeDecodeError as e:
                raise ProtocolError(f"InfoReply: slot name is not UTF-8 ({e})") from None
            slots.append(SlotHold(name, held, _bool(invalidated, "invalidated", "InfoReply")))
            at += length
        fence, at = _fence(body, at, "InfoReply")
        _need_at_least(body, at + _U16.size, "InfoReply")
        (length,) = _U16.unpack_from(body, at)
        at += _U16.size
        _need_at_least(body, at + length, "InfoReply")
        mismatch = _text(body[:at + length], at, length, "archive mismatch", "InfoReply")
        degraded, at = _degraded(body, at + length, "InfoReply")
        _need_exact(body, at + _LOST_DISK_TERM.size, "InfoReply")
        (degrade_term,) = _LOST_DISK_TERM.unpack_from(body, at)
        if not (limit or slots or mismatch or fence != NO_FENCE or degraded or degrade_term):
            raise ProtocolError("InfoReply: an empty report is sent as none")  # one encoding per message
    else:
        _need_exact(body, _INFO_REPLY.size, "InfoReply")
    m = InfoReply(*fields, proposer_connected=_bool(connected, "proposer_connected", "InfoReply"),
                  reader_port=reader_port, backup_lsn=backup, slot_wal_limit=limit, slots=tuple(slots),
                  archive_mismatch=mismatch, fence=fence, members=members,
                  amnesic=_bool(amnesic, "amnesic", "InfoReply"), lost_disk_term=lost_disk_term,
                  degraded=degraded, degrade_term=degrade_term)
    _check_info_reply(m)
    return m


def _degraded(body: Body, start: int, name: str) -> tuple[DegradedRange, int]:
    _need_at_least(body, start + _DEGRADED.size, name)
    term, begin, version, count = _DEGRADED.unpack_from(body, start)
    at = start + _DEGRADED.size
    if count > limits.MAX_MEMBERS:
        raise ProtocolError(f"{name}: degraded range of {count} members exceeds {limits.MAX_MEMBERS}")
    _need_at_least(body, at + count * _NODE_ID.size, name)
    members = [_NODE_ID.unpack_from(body, at + i * _NODE_ID.size)[0] for i in range(count)]
    if any(a >= b for a, b in zip(members, members[1:])):
        raise ProtocolError(f"{name}: degraded range members are not ascending")  # one encoding per message
    return DegradedRange(term, begin, version, frozenset(members)), at + count * _NODE_ID.size


def _decode_degraded_record(body: Body) -> DegradedRecord:
    _need_at_least(body, _DEGRADED_RECORD.size, "DegradedRecord")
    (term,) = _DEGRADED_RECORD.unpack_from(body)
    record, at = _degraded(body, _DEGRADED_RECORD.size, "DegradedRecord")
    _no_trailing(body, at, "DegradedRecord")
    m = DegradedRecord(term, record)
    _check_degraded_record(m)
    return m


def _decode_degraded_record_reply(body: Body) -> DegradedRecordReply:
    _need_exact(body, _DEGRADED_RECORD_REPLY.size, "DegradedRecordReply")
    m = DegradedRecordReply(*_DEGRADED_RECORD_REPLY.unpack_from(body))
    _check_degraded_record_reply(m)
    return m


def _blobs(body: Body, start: int, count: int, name: str) -> list[bytes]:
    """`count` u16-length-prefixed byte strings from `start` that end the body exactly."""
    out = []
    for _ in range(count):
        if start + _U16.size > len(body):
            raise ProtocolError(f"{name}: body ends before a length")
        (length,) = _U16.unpack_from(body, start)
        start += _U16.size
        if start + length > len(body):
            raise ProtocolError(f"{name}: a field declares {length} bytes but {len(body) - start} remain")
        out.append(bytes(body[start:start + length]))
        start += length
    _no_trailing(body, start, name)
    return out


def _decode_auth_challenge(body: Body) -> AuthChallenge:
    if len(body) <= limits.AUTH_NONCE:  # link auth v1: the nonce alone (a wrong size fails the check)
        m = AuthChallenge(bytes(body))
    else:
        (cert,) = _blobs(body, limits.AUTH_NONCE, 1, "AuthChallenge")
        if not cert:
            raise ProtocolError("AuthChallenge: no certificate is sent as none")  # one encoding per message
        m = AuthChallenge(bytes(body[:limits.AUTH_NONCE]), cert)
    _check_auth_challenge(m)
    return m


def _decode_auth_response(body: Body) -> AuthResponse:
    _need_at_least(body, limits.AUTH_NONCE + _U16.size, "AuthResponse")
    (port,) = _U16.unpack_from(body, limits.AUTH_NONCE)
    cert, host, sig = _blobs(body, limits.AUTH_NONCE + _U16.size, 3, "AuthResponse")
    try:
        text = host.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"AuthResponse: host is not valid UTF-8: {e}") from None
    m = AuthResponse(cert, bytes(body[:limits.AUTH_NONCE]), text, sig, port)
    _check_auth_response(m)
    return m


def _decode_auth_confirm(body: Body) -> AuthConfirm:
    m = AuthConfirm(*_blobs(body, 0, 2, "AuthConfirm"))
    _check_auth_confirm(m)
    return m


_DECODERS: MappingProxyType[int, Callable[[Body], Message]] = MappingProxyType({
    TAG_GREETING: _decode_greeting,
    TAG_GREETING_REPLY: _decode_greeting_reply,
    TAG_VOTE_REQUEST: _decode_vote_request,
    TAG_VOTE_REPLY: _decode_vote_reply,
    TAG_ELECTED: _decode_elected,
    TAG_ELECTED_REPLY: _decode_elected_reply,
    TAG_APPEND: _decode_append,
    TAG_APPEND_REPLY: _decode_append_reply,
    TAG_REFUSAL: _decode_refusal,
    TAG_INFO_REQUEST: _decode_info_request,
    TAG_INFO_REPLY: _decode_info_reply,
    TAG_AUTH_CHALLENGE: _decode_auth_challenge,
    TAG_AUTH_RESPONSE: _decode_auth_response,
    TAG_AUTH_CONFIRM: _decode_auth_confirm,
    TAG_DEGRADED_RECORD: _decode_degraded_record,
    TAG_DEGRADED_RECORD_REPLY: _decode_degraded_record_reply,
})


def decode(tag: int, body: Body) -> Message:
    """The message with this tag and body (the frame minus length and tag); strict."""
    decoder = _DECODERS.get(tag)
    if decoder is None:
        shown = f" ({chr(tag)!r})" if 0x20 < tag < 0x7F else ""
        raise ProtocolError(f"unknown message tag 0x{tag:02x}{shown}")
    try:
        return decoder(body)
    except struct.error as e:  # a length check missed above; still the peer's fault
        raise ProtocolError(f"malformed message with tag 0x{tag:02x}: {e}") from None
    except limits.LimitError as e:
        raise FieldError(f"{_NAMES[tag]} {e}") from None


_NAMES: MappingProxyType[int, str] = MappingProxyType({tag: cls.__name__ for cls, tag in TAGS.items()})


class FrameDecoder:
    """Incremental and sans IO: bytes in, whole messages out, strictly in order.

    `feed()` copies what it is given. A socket may instead receive straight into the decoder:
    `get_buffer()` then `buffer_updated(n, out)`, as asyncio's buffered protocols do. Small
    frames are parsed out of one reusable buffer; a large one (an Append) is received into a
    buffer of its own that its message keeps as `data` without another copy.
    """

    OWN_BUFFER_AT = 16 * 1024  # frames at least this long are received into a buffer of their own
    # The receive buffer for small frames starts small (a connection that sends little costs
    # little) and doubles whenever it fills, so a busy one reads many frames per receive.
    SCRATCH_MIN, SCRATCH_MAX = 2 * OWN_BUFFER_AT, 256 * 1024

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame  # the longest frame accepted now; a server lowers it before a Greeting
        self._scratch = bytearray(self.SCRATCH_MIN)
        self._start = 0  # unparsed bytes are _scratch[_start:_end]
        self._end = 0
        self._frame: bytearray | None = None  # a large frame being received, header included
        self._frame_got = 0
        self._error: ProtocolError | None = None

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back; nonzero at EOF means a truncated stream."""
        return self._end - self._start + (self._frame_got if self._frame is not None else 0)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Buffer `data` and return every message it completes; ProtocolError on a bad frame."""
        out: list[Message] = []
        self.buffer_feed(data, out)
        return out

    def buffer_feed(self, data: bytes | bytearray | memoryview, out: list[Message]) -> None:
        """Buffer `data` and append every message it completes to `out`; on a bad frame the messages
        before it are in `out` already when ProtocolError is raised."""
        with memoryview(data) as view:
            pos = 0
            while True:
                buf = self.get_buffer()
                n = min(len(buf), len(view) - pos)
                buf[:n] = view[pos:pos + n]
                buf.release()
                pos += n
                self.buffer_updated(n, out)
                if pos == len(view):
                    return

    def take(self) -> bytes:
        """The bytes received and not yet decoded (a frame's beginning), out of the decoder: for a
        reader that goes on decoding elsewhere (the safekeeper's compiled stream loop) and gives back
        what it does not decode with `buffer_feed`."""
        if self._frame is not None:
            held = bytes(memoryview(self._frame)[:self._frame_got])
            self._frame = None
            self._frame_got = 0
        else:
            held = bytes(self._scratch[self._start:self._end])
        self._start = self._end = 0
        return held

    def get_buffer(self) -> memoryview:
        """Where the next bytes received go (at least one byte of room)."""
        if self._frame is not None:
            return memoryview(self._frame)[self._frame_got:]
        if self._end == len(self._scratch):
            # Move the unparsed tail to the front: it is shorter than OWN_BUFFER_AT or part of a
            # frame header, so this is cheap.
            tail = self._end - self._start
            if len(self._scratch) < self.SCRATCH_MAX:
                grown = bytearray(2 * len(self._scratch))
                grown[:tail] = self._scratch[self._start:self._end]
                self._scratch = grown
            else:
                self._scratch[:tail] = self._scratch[self._start:self._end]
            self._start, self._end = 0, tail
        return memoryview(self._scratch)[self._end:]

    def buffer_updated(self, nbytes: int, out: list[Message]) -> None:
        """`nbytes` arrived in the last `get_buffer()`: append what they complete to `out`.

        On a bad frame the messages before it are in `out` already when ProtocolError is raised.
        """
        if self._error is not None:
            # The stream cannot be resynchronised after a bad frame.
            raise ProtocolError(f"decoder already failed: {self._error}")
        try:
            if self._frame is not None:
                self._frame_got += nbytes
                if self._frame_got == len(self._frame):
                    frame, self._frame = self._frame, None
                    out.append(_decode_owned(frame))
            else:
                self._end += nbytes
                self._parse(out)
        except ProtocolError as e:
            self._error = e
            raise

    def _parse(self, out: list[Message]) -> None:
        buf, pos, end = self._scratch, self._start, self._end
        view = memoryview(buf)
        try:
            while end - pos >= FRAME_HEADER_SIZE:
                (length,) = _U32.unpack_from(buf, pos)
                if length == 0 or length > self.max_frame:
                    _reject_length(length, self.max_frame)
                stop = pos + FRAME_HEADER_SIZE + length
                if stop > end:
                    if length >= self.OWN_BUFFER_AT:
                        # Receive the rest of this frame directly into its own buffer.
                        frame = bytearray(FRAME_HEADER_SIZE + length)
                        frame[:end - pos] = buf[pos:end]
                        self._frame, self._frame_got = frame, end - pos
                        pos = end
                    break
                body = view[pos + FRAME_HEADER_SIZE + 1:stop]
                try:
                    out.append(decode(buf[pos + FRAME_HEADER_SIZE], body))
                finally:
                    # Decoders copy what they keep; a live view would pin the buffer it reuses.
                    body.release()
                pos = stop
        finally:
            view.release()
            if pos == end:
                pos = end = 0
            self._start, self._end = pos, end


def _decode_owned(frame: bytearray) -> Message:
    """A whole frame in a buffer of its own; Append data stays a view of that buffer."""
    tag = frame[FRAME_HEADER_SIZE]
    body = memoryview(frame)[FRAME_HEADER_SIZE + 1:]
    if tag == TAG_APPEND:
        try:
            return _decode_append(body, body[_APPEND.size:])
        except limits.LimitError as e:
            raise FieldError(f"Append {e}") from None
    return decode(tag, body)

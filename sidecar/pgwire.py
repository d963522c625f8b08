"""PostgreSQL's frontend/backend protocol v3, the server's side, sans IO.

The startup phase (SSLRequest, GSSENCRequest, CancelRequest, StartupMessage), the frontend
messages a WAL server receives, and the backend messages it sends. Layout as in PostgreSQL's
"Message Formats" page; bounds as in its postmaster (MAX_STARTUP_PACKET_LENGTH).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Request codes of the startup phase (the "protocol version" of a special packet).
PROTOCOL_3_0 = 3 << 16
CANCEL_REQUEST_CODE = 1234 << 16 | 5678
SSL_REQUEST_CODE = 1234 << 16 | 5679
GSSENC_REQUEST_CODE = 1234 << 16 | 5680
MAX_STARTUP_PACKET = 10000  # PostgreSQL's MAX_STARTUP_PACKET_LENGTH
# The largest message a reader sends is a command (pgrepl.MAX_COMMAND) or a SASL message; anything
# bigger is garbage or an attack, not a client of a WAL server.
MAX_MESSAGE = 64 * 1024
HEADER = struct.Struct(">cI")  # type byte, length (itself included, the type byte not)
_I32 = struct.Struct(">I")

# Type OIDs of the result columns a WAL server sends.
INT4_OID = 23
INT8_OID = 20
TEXT_OID = 25

# SQLSTATEs.
PROTOCOL_VIOLATION = "08P01"
FEATURE_NOT_SUPPORTED = "0A000"
SYNTAX_ERROR = "42601"
INVALID_AUTHORIZATION = "28000"
INVALID_PASSWORD = "28P01"
UNDEFINED_OBJECT = "42704"
DUPLICATE_OBJECT = "42710"
OBJECT_IN_USE = "55006"
TOO_MANY_CONNECTIONS = "53300"
ADMIN_SHUTDOWN = "57P01"
QUERY_CANCELED = "57014"
CONNECTION_FAILURE = "08006"
INTERNAL_ERROR = "XX000"


class ProtocolViolation(ValueError):
    """Bytes that are not the protocol: the connection gets a FATAL 08P01 and is closed."""


# ---- the startup phase ----------------------------------------------------------------------


@dataclass(frozen=True)
class SslRequest:
    pass


@dataclass(frozen=True)
class GssEncRequest:
    pass


@dataclass(frozen=True)
class CancelRequest:
    pid: int
    secret: int


@dataclass(frozen=True)
class Startup:
    """A StartupMessage: protocol 3.0 and its parameters (user, database, replication, ...)."""

    params: dict[str, str]


StartupPacket = SslRequest | GssEncRequest | CancelRequest | Startup


def startup_length(header: bytes) -> int:
    """The length of the rest of a startup packet from its first 4 bytes; ProtocolViolation if out of bounds."""
    (length,) = _I32.unpack(header)
    if not 8 <= length <= MAX_STARTUP_PACKET:
        raise ProtocolViolation(f"invalid length of startup packet: {length} bytes "
                                f"(between 8 and {MAX_STARTUP_PACKET} expected)")
    return length - 4


def parse_startup(body: bytes) -> StartupPacket:
    """The startup packet after its length word."""
    if len(body) < 4:
        raise ProtocolViolation(f"invalid length of startup packet: {len(body) + 4} bytes")
    (code,) = _I32.unpack_from(body)
    if code == SSL_REQUEST_CODE and len(body) == 4:
        return SslRequest()
    if code == GSSENC_REQUEST_CODE and len(body) == 4:
        return GssEncRequest()
    if code == CANCEL_REQUEST_CODE and len(body) == 12:
        pid, secret = struct.unpack_from(">II", body, 4)
        return CancelRequest(pid, secret)
    if code >> 16 != 3:
        raise ProtocolViolation(unsupported_protocol(code))
    fields = body[4:].split(b"\0")
    # name\0value\0 ... \0: an even number of strings, then the empty terminator (and the split's tail).
    if len(fields) < 2 or fields[-1] != b"" or fields[-2] != b"" or len(fields) % 2:
        raise ProtocolViolation("invalid startup packet layout: expected terminator as last byte")
    params: dict[str, str] = {}
    for i in range(0, len(fields) - 2, 2):
        try:
            name, value = fields[i].decode(), fields[i + 1].decode()
        except UnicodeDecodeError:
            raise ProtocolViolation("startup packet parameter is not UTF-8") from None
        if not name:
            raise ProtocolViolation("invalid startup packet layout: empty parameter name")
        params[name] = value
    if "user" not in params:
        raise ProtocolViolation("no PostgreSQL user name specified in startup packet")
    return Startup(params)


def unsupported_protocol(code: int) -> str:
    """PostgreSQL's FATAL for a protocol it does not speak, also a negotiation request already answered."""
    return f"unsupported frontend protocol {code >> 16}.{code & 0xFFFF}: this server supports 3.0"


def is_replication(params: dict[str, str]) -> bool:
    """A physical replication connection: replication=true (or on, yes, 1), as PostgreSQL parses it."""
    return params.get("replication", "").lower() in ("true", "on", "yes", "1")


def is_logical_replication(params: dict[str, str]) -> bool:
    return params.get("replication", "").lower() == "database"


# ---- frontend messages ----------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    text: str


@dataclass(frozen=True)
class PasswordPacket:
    """A 'p' message: SASLInitialResponse or SASLResponse, which only the state tells apart."""

    body: bytes


@dataclass(frozen=True)
class CopyData:
    data: bytes


@dataclass(frozen=True)
class CopyDone:
    pass


@dataclass(frozen=True)
class CopyFail:
    message: str


@dataclass(frozen=True)
class Terminate:
    pass


@dataclass(frozen=True)
class Unexpected:
    """A well-framed message of a kind a WAL server does not take (Parse, Bind, FunctionCall, ...)."""

    kind: str


FrontendMessage = Query | PasswordPacket | CopyData | CopyDone | CopyFail | Terminate | Unexpected

_EXTENDED = {b"P": "Parse", b"B": "Bind", b"E": "Execute", b"D": "Describe", b"C": "Close", b"S": "Sync",
             b"H": "Flush", b"F": "FunctionCall"}


def message_length(header: bytes, limit: int = MAX_MESSAGE) -> tuple[bytes, int]:
    """(type byte, body length) of a frontend message from its 5-byte header; ProtocolViolation on garbage."""
    kind, length = HEADER.unpack(header)
    if kind not in b"QpdcfX" and kind not in _EXTENDED:
        raise ProtocolViolation(f"invalid frontend message type {kind!r}")
    if not 4 <= length <= limit + 4:
        raise ProtocolViolation(f"invalid message length {length} for message type {kind!r} "
                                f"(at most {limit + 4})")
    return kind, length - 4


def parse_message(kind: bytes, body: bytes) -> FrontendMessage:
    """One frontend message from its type byte and body."""
    if kind == b"Q":
        return Query(_one_string(body, "Query"))
    if kind == b"p":
        return PasswordPacket(body)
    if kind == b"d":
        return CopyData(body)
    if kind == b"c":
        _empty(body, "CopyDone")
        return CopyDone()
    if kind == b"f":
        return CopyFail(_one_string(body, "CopyFail"))
    if kind == b"X":
        _empty(body, "Terminate")
        return Terminate()
    if kind in _EXTENDED:
        return Unexpected(_EXTENDED[kind])
    raise ProtocolViolation(f"invalid frontend message type {kind!r}")


def _one_string(body: bytes, what: str) -> str:
    if not body.endswith(b"\0") or body.index(b"\0") != len(body) - 1:
        raise ProtocolViolation(f"invalid {what} message: not one NUL-terminated string")
    try:
        return body[:-1].decode()
    except UnicodeDecodeError:
        raise ProtocolViolation(f"invalid {what} message: not UTF-8") from None


def _empty(body: bytes, what: str) -> None:
    if body:
        raise ProtocolViolation(f"invalid {what} message of {len(body) + 4} bytes")


def parse_sasl_initial(body: bytes) -> tuple[str, bytes]:
    """(mechanism, client-first-message) of a SASLInitialResponse."""
    end = body.find(b"\0")
    if end < 0 or len(body) < end + 5:
        raise ProtocolViolation("invalid SASLInitialResponse message")
    (n,) = _I32.unpack_from(body, end + 1)
    data = body[end + 5:]
    if n == 0xFFFFFFFF:
        data, n = b"", 0
    if n != len(data):
        raise ProtocolViolation("invalid SASLInitialResponse message: length of the data does not match")
    return body[:end].decode(errors="replace"), data


# ---- backend messages -----------------------------------------------------------------------


def message(kind: bytes, body: bytes = b"") -> bytes:
    """A backend message: type byte, length, body."""
    return HEADER.pack(kind, len(body) + 4) + body


def _cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def auth_sasl(mechanisms: Iterable[str]) -> bytes:
    return message(b"R", _I32.pack(10) + b"".join(_cstr(m) for m in mechanisms) + b"\0")


def auth_sasl_continue(data: bytes) -> bytes:
    return message(b"R", _I32.pack(11) + data)


def auth_sasl_final(data: bytes) -> bytes:
    return message(b"R", _I32.pack(12) + data)


def auth_ok() -> bytes:
    return message(b"R", _I32.pack(0))


def parameter_status(name: str, value: str) -> bytes:
    return message(b"S", _cstr(name) + _cstr(value))


def backend_key_data(pid: int, secret: int) -> bytes:
    return message(b"K", struct.pack(">II", pid, secret))


def ready_for_query(status: bytes = b"I") -> bytes:
    return message(b"Z", status)


def row_description(columns: Sequence[tuple[str, int]]) -> bytes:
    """A RowDescription of text-format columns (name, type OID)."""
    body = struct.pack(">H", len(columns))
    for name, oid in columns:
        size = 8 if oid == INT8_OID else 4 if oid == INT4_OID else -1
        body += _cstr(name) + struct.pack(">IhIhih", 0, 0, oid, size, -1, 0)
    return message(b"T", body)


def data_row(values: Sequence[str | bytes | None]) -> bytes:
    body = struct.pack(">H", len(values))
    for v in values:
        if v is None:
            body += struct.pack(">i", -1)
        else:
            raw = v.encode() if isinstance(v, str) else v
            body += _I32.pack(len(raw)) + raw
    return message(b"D", body)


def result(columns: Sequence[tuple[str, int]], rows: Sequence[Sequence[str | bytes | None]], tag: str) -> bytes:
    """RowDescription, the DataRows and CommandComplete: one command's result set."""
    return row_description(columns) + b"".join(data_row(r) for r in rows) + command_complete(tag)


def command_complete(tag: str) -> bytes:
    return message(b"C", _cstr(tag))


def empty_query_response() -> bytes:
    return message(b"I")


def _notice_fields(severity: str, sqlstate: str, text: str, detail: str | None, hint: str | None) -> bytes:
    parts = [b"S" + _cstr(severity), b"V" + _cstr(severity), b"C" + _cstr(sqlstate), b"M" + _cstr(text)]
    if detail:
        parts.append(b"D" + _cstr(detail))
    if hint:
        parts.append(b"H" + _cstr(hint))
    return b"".join(parts) + b"\0"


def error_response(sqlstate: str, text: str, *, severity: str = "ERROR", detail: str | None = None,
                   hint: str | None = None) -> bytes:
    """An ErrorResponse; severity ERROR (the command failed) or FATAL (the connection ends)."""
    return message(b"E", _notice_fields(severity, sqlstate, text, detail, hint))


def notice_response(text: str, *, severity: str = "NOTICE", sqlstate: str = "00000", detail: str | None = None,
                    hint: str | None = None) -> bytes:
    return message(b"N", _notice_fields(severity, sqlstate, text, detail, hint))


def copy_both_response() -> bytes:
    """CopyBothResponse of a replication stream: binary, no columns."""
    return message(b"W", struct.pack(">bH", 0, 0))


def copy_data(payload: bytes | bytearray | memoryview) -> bytes:
    return HEADER.pack(b"d", len(payload) + 4) + bytes(payload)


def copy_data_header(size: int) -> bytes:
    """The 5 bytes before a CopyData payload of `size` bytes (so a large payload is not copied)."""
    return HEADER.pack(b"d", size + 4)


def copy_done() -> bytes:
    return message(b"c")


SSL_ACCEPT = b"S"
SSL_REFUSE = b"N"

"""The frontend/backend protocol's server side: startup packets, frontend messages, backend encoders."""

from __future__ import annotations

import struct

import pytest

from sidecar import pgwire
from sidecar.pgwire import ProtocolViolation


def startup_body(params: dict[str, str], version: int = pgwire.PROTOCOL_3_0) -> bytes:
    return struct.pack(">I", version) + b"".join(k.encode() + b"\0" + v.encode() + b"\0"
                                                  for k, v in params.items()) + b"\0"


def packet(body: bytes) -> bytes:
    return struct.pack(">I", len(body) + 4) + body


def test_startup_packets() -> None:
    assert pgwire.parse_startup(struct.pack(">I", pgwire.SSL_REQUEST_CODE)) == pgwire.SslRequest()
    assert pgwire.parse_startup(struct.pack(">I", pgwire.GSSENC_REQUEST_CODE)) == pgwire.GssEncRequest()
    assert pgwire.parse_startup(struct.pack(">III", pgwire.CANCEL_REQUEST_CODE, 7, 9)) == pgwire.CancelRequest(7, 9)
    params = {"user": "walsidecar", "replication": "true", "application_name": "pg_receivewal"}
    assert pgwire.parse_startup(startup_body(params)) == pgwire.Startup(params)


def test_the_startup_length_is_bounded() -> None:
    data = packet(startup_body({"user": "u"}))
    assert pgwire.startup_length(data[:4]) == len(data) - 4
    for length in (0, 7, pgwire.MAX_STARTUP_PACKET + 1, 0x47455420):  # 'GET '
        with pytest.raises(ProtocolViolation, match="invalid length of startup packet"):
            pgwire.startup_length(struct.pack(">I", length))


@pytest.mark.parametrize("body, match", [
    (struct.pack(">I", 2 << 16), "unsupported frontend protocol 2.0"),
    (startup_body({"user": "u"})[:-1], "expected terminator"),
    (struct.pack(">I", pgwire.PROTOCOL_3_0) + b"user\0u\0", "expected terminator"),
    (struct.pack(">I", pgwire.PROTOCOL_3_0) + b"user\0\0", "expected terminator"),
    (startup_body({"database": "replication"}), "no PostgreSQL user name"),
    (struct.pack(">I", pgwire.PROTOCOL_3_0) + b"\0x\0\0", "empty parameter name"),
    (struct.pack(">I", pgwire.PROTOCOL_3_0) + b"user\0\xff\0\0", "not UTF-8"),
    (struct.pack(">II", pgwire.SSL_REQUEST_CODE, 1), "unsupported frontend protocol 1234.5679"),
])
def test_bad_startup_packets(body: bytes, match: str) -> None:
    with pytest.raises(ProtocolViolation, match=match):
        pgwire.parse_startup(body)


def test_replication_parameter() -> None:
    for value in ("true", "on", "yes", "1", "TRUE"):
        assert pgwire.is_replication({"replication": value})
    for params in ({}, {"replication": "false"}, {"replication": "database"}):
        assert not pgwire.is_replication(params)
    assert pgwire.is_logical_replication({"replication": "database"})


def test_frontend_messages() -> None:
    assert pgwire.message_length(b"Q\0\0\0\x0e") == (b"Q", 10)
    assert pgwire.parse_message(b"Q", b"IDENTIFY_SYSTEM\0") == pgwire.Query("IDENTIFY_SYSTEM")
    assert pgwire.parse_message(b"d", b"r123") == pgwire.CopyData(b"r123")
    assert pgwire.parse_message(b"c", b"") == pgwire.CopyDone()
    assert pgwire.parse_message(b"f", b"gone\0") == pgwire.CopyFail("gone")
    assert pgwire.parse_message(b"X", b"") == pgwire.Terminate()
    assert pgwire.parse_message(b"p", b"abc") == pgwire.PasswordPacket(b"abc")
    assert pgwire.parse_message(b"P", b"\0SELECT 1\0\0\0") == pgwire.Unexpected("Parse")


@pytest.mark.parametrize("header, match", [
    (b"\xff\0\0\0\x04", "invalid frontend message type"),
    (b"G\0\0\0\x04", "invalid frontend message type"),
    (b"Q\0\0\0\x03", "invalid message length 3"),
    (b"Q\x7f\xff\xff\xff", "invalid message length"),
])
def test_garbage_headers(header: bytes, match: str) -> None:
    with pytest.raises(ProtocolViolation, match=match):
        pgwire.message_length(header)


def test_the_message_size_cap() -> None:
    assert pgwire.message_length(struct.pack(">cI", b"d", pgwire.MAX_MESSAGE + 4))[1] == pgwire.MAX_MESSAGE
    with pytest.raises(ProtocolViolation):
        pgwire.message_length(struct.pack(">cI", b"d", pgwire.MAX_MESSAGE + 5))


@pytest.mark.parametrize("kind, body, match", [
    (b"Q", b"no terminator", "not one NUL-terminated string"),
    (b"Q", b"two\0strings\0", "not one NUL-terminated string"),
    (b"Q", b"\xff\xfe\0", "not UTF-8"),
    (b"c", b"x", "invalid CopyDone message"),
    (b"X", b"x", "invalid Terminate message"),
])
def test_bad_bodies(kind: bytes, body: bytes, match: str) -> None:
    with pytest.raises(ProtocolViolation, match=match):
        pgwire.parse_message(kind, body)


def test_sasl_initial_response() -> None:
    first = b"n,,n=,r=abc"
    body = b"SCRAM-SHA-256\0" + struct.pack(">I", len(first)) + first
    assert pgwire.parse_sasl_initial(body) == ("SCRAM-SHA-256", first)
    assert pgwire.parse_sasl_initial(b"SCRAM-SHA-256\0\xff\xff\xff\xff") == ("SCRAM-SHA-256", b"")
    for bad in (b"SCRAM-SHA-256", b"SCRAM-SHA-256\0\0\0", b"SCRAM-SHA-256\0\0\0\0\x09abc"):
        with pytest.raises(ProtocolViolation, match="SASLInitialResponse"):
            pgwire.parse_sasl_initial(bad)


def fields(message: bytes) -> tuple[bytes, bytes]:
    kind, length = pgwire.HEADER.unpack_from(message)
    assert len(message) == length + 1
    return kind, message[5:]


def test_backend_messages() -> None:
    assert fields(pgwire.auth_ok()) == (b"R", b"\0\0\0\0")
    assert fields(pgwire.auth_sasl(["SCRAM-SHA-256"])) == (b"R", b"\0\0\0\x0aSCRAM-SHA-256\0\0")
    assert fields(pgwire.auth_sasl_continue(b"r=x")) == (b"R", b"\0\0\0\x0br=x")
    assert fields(pgwire.auth_sasl_final(b"v=y")) == (b"R", b"\0\0\0\x0cv=y")
    assert fields(pgwire.parameter_status("a", "b")) == (b"S", b"a\0b\0")
    assert fields(pgwire.backend_key_data(1, 2)) == (b"K", struct.pack(">II", 1, 2))
    assert fields(pgwire.ready_for_query()) == (b"Z", b"I")
    assert fields(pgwire.command_complete("SHOW")) == (b"C", b"SHOW\0")
    assert fields(pgwire.empty_query_response()) == (b"I", b"")
    assert fields(pgwire.copy_both_response()) == (b"W", b"\0\0\0")
    assert fields(pgwire.copy_data(b"w123")) == (b"d", b"w123")
    assert pgwire.copy_data_header(4) + b"w123" == pgwire.copy_data(b"w123")
    assert fields(pgwire.copy_done()) == (b"c", b"")


def test_rows() -> None:
    kind, body = fields(pgwire.row_description([("systemid", pgwire.TEXT_OID), ("timeline", pgwire.INT4_OID)]))
    assert kind == b"T" and body[:2] == b"\0\x02"
    name_end = body.index(b"\0", 2)
    assert body[2:name_end] == b"systemid"
    table, attnum, oid, size, mod, fmt = struct.unpack_from(">IhIhih", body, name_end + 1)
    assert (table, attnum, oid, size, mod, fmt) == (0, 0, pgwire.TEXT_OID, -1, -1, 0)
    kind, body = fields(pgwire.data_row(["7", None, b"\x00\x01"]))
    assert kind == b"D" and body == b"\0\x03" + b"\0\0\0\x017" + b"\xff\xff\xff\xff" + b"\0\0\0\x02\x00\x01"
    whole = pgwire.result([("x", pgwire.TEXT_OID)], [("1",), ("2",)], "SHOW")
    assert whole.count(b"D\0\0\0") == 2 and whole.endswith(pgwire.command_complete("SHOW"))


def test_error_and_notice_fields() -> None:
    kind, body = fields(pgwire.error_response("22023", "bad start", detail="why", hint="do this"))
    assert kind == b"E"
    parts = dict((p[:1], p[1:]) for p in body.rstrip(b"\0").split(b"\0"))
    assert parts == {b"S": b"ERROR", b"V": b"ERROR", b"C": b"22023", b"M": b"bad start", b"D": b"why",
                     b"H": b"do this"}
    kind, body = fields(pgwire.error_response("08P01", "garbage", severity="FATAL"))
    assert b"SFATAL\0" in body and b"D" not in body.split(b"\0")[-2][:1]
    kind, body = fields(pgwire.notice_response("hello"))
    assert kind == b"N" and b"SNOTICE\0" in body and b"C00000\0" in body


def test_random_bytes_are_refused_with_protocol_violation_only() -> None:
    import random
    rng = random.Random(14)
    for _ in range(3000):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
        kind = bytes([rng.choice(b"QpdcfXPBZ\xff")])
        for parse in (pgwire.parse_startup, pgwire.parse_sasl_initial, lambda b: pgwire.parse_message(kind, b),
                      lambda b: pgwire.message_length((kind + b + bytes(4))[:5])):
            try:
                parse(data)
            except ProtocolViolation:
                pass

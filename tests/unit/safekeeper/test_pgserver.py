"""The reader port in process, against a stand-in safekeeper: SCRAM, bounds of the startup phase, the
end of a timeline and the commit cap as walsender.c does them."""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

import pytest

from support.helpers import run, until
from support.pgfrontend import Client
from sidecar import pgrepl, pgwire, readerauth
from sidecar.timelines import TimelineEntry
from sidecar.consensus.reading import ServerState
from sidecar.readerauth import AuthFile
from sidecar.safekeeper.pgserver import MAX_READERS, MAX_STARTUPS, ReaderPort, ReaderServer, to_drop
from sidecar.safekeeper.positions import Positions, PositionWatch
from sidecar.safekeeper.slots import Slots
from sidecar.safekeeper.storage import NoWal, WalPin

SEG = 16 << 20
SWITCH = SEG + 3000


class Standin:
    """What the reader port needs of a safekeeper: WAL bytes are a pattern of their LSN."""

    node_id = 1
    system_id = 7301
    wal_seg_size = SEG

    def __init__(self, tmp: Path) -> None:
        self.positions = PositionWatch(Positions(3, SEG + 5000, SEG + 4000, 0))
        self.slots = Slots(tmp)
        self.timeline, self.history = 2, (TimelineEntry(1, SWITCH),)
        self.disk = 0  # what the WAL on "disk" is: each cut writes other bytes
        self.announced: int | None = None  # a cut generation written before its positions are published
        self.reads = 0

    def reader_state(self) -> ServerState:
        p = self.positions.value
        return ServerState(p.term, p.flush_lsn, p.commit_lsn, p.generation, self.timeline, self.history, SEG)

    def read_wal(self, lsn: int, size: int) -> bytes:
        self.reads += 1
        return bytes((i * 7 + self.disk) & 0xFF for i in range(lsn, lsn + size))

    async def current_state(self) -> ServerState:
        return self.reader_state()

    def cut_generation(self) -> int:
        return self.announced if self.announced is not None else self.positions.value.generation

    async def reader_pin(self, lsn: int, holder: str) -> WalPin:
        return NoWal().pin(lsn, holder)


def error_of(body: bytes) -> dict[str, str]:
    return {f[:1].decode(): f[1:].decode() for f in body.split(b"\0") if f}


def serve(tmp: Path, test, port: dict | None = None, **kwargs):  # noqa: ANN001, ANN201
    """Run `test(server, sk)` against a reader port with one reader, 'reader' / 'secret'."""
    auth = tmp / "readers.auth"
    readerauth.add(auth, "reader", "secret")

    async def main() -> None:
        sk = Standin(tmp)
        server = ReaderServer(sk, ReaderPort("127.0.0.1", 0, AuthFile(auth), **(port or {})), **kwargs)
        await server.start()
        try:
            await test(server, sk)
        finally:
            await server.close()
    run(main(), timeout=30)


def test_scram_logs_in_and_a_wrong_password_is_refused(tmp_path: Path) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        c = await Client.connect(server.port)
        got = await c.login("secret")
        kinds = [k for k, _ in got]
        assert kinds[0] == b"R" and b"K" in kinds and kinds[-1] == b"Z"
        statuses = dict(body.split(b"\0")[:2] for k, body in got if k == b"S")
        assert statuses[b"server_version"].startswith(b"15.") and statuses[b"integer_datetimes"] == b"on"
        c.query("IDENTIFY_SYSTEM")
        rows = [body for k, body in await c.until(b"Z") if k == b"D"]
        assert b"7301" in rows[0] and b"0/1000FA0" in rows[0]  # xlogpos: the commit position
        bad = await Client.connect(server.port)
        got = await bad.login("wrong")
        assert got[0][0] == b"E" and error_of(got[0][1])["C"] == "28P01"
        stranger = await Client.connect(server.port)
        got = await stranger.login("secret", user="nobody")
        assert got[0][0] == b"E" and error_of(got[0][1])["M"] == 'password authentication failed for user "nobody"'
    serve(tmp_path, test)


def test_a_silent_client_is_dropped_and_the_readers_are_capped(tmp_path: Path) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        silent = await Client.connect(server.port)
        kind, body = await silent.message()
        assert kind == b"E" and "timeout" in error_of(body)["M"]
        assert await silent.reader.read() == b""
        held = [await Client.connect(server.port) for _ in range(2)]
        await until(lambda: len(server.connections) == 2, "the server to take both")
        third = await Client.connect(server.port)
        kind, body = await third.message()
        assert kind == b"E" and error_of(body)["C"] == "53300"
        for h in held:
            h.writer.close()
    serve(tmp_path, test, port={"authentication_timeout": 0.2}, max_readers=2)


def test_the_end_of_a_timeline_is_told_as_walsender_c_does(tmp_path: Path) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        c = await Client.connect(server.port)
        await c.login("secret")
        c.query("TIMELINE_HISTORY 2")
        rows = [body for k, body in await c.until(b"Z") if k == b"D"]
        assert b"00000002.history" in rows[0] and b"1\t0/1000BB8\t" in rows[0]
        c.query(f"START_REPLICATION PHYSICAL 0/{SEG:X} TIMELINE 1")
        kind, _ = await c.message()
        assert kind == b"W"
        received = bytearray()
        while True:
            kind, body = await c.message()
            if kind == b"c":
                break
            msg = pgrepl.parse_copy_data(body)
            assert isinstance(msg, pgrepl.XLogData) and msg.start == SEG + len(received)
            received += msg.data
        assert len(received) == SWITCH - SEG and bytes(received) == sk.read_wal(SEG, SWITCH - SEG)
        c.send(b"c")
        got = await c.until(b"Z")
        assert [k for k, _ in got] == [b"T", b"D", b"C", b"C", b"Z"]
        assert b"next_tli" in got[0][1] and got[1][1] == pgwire.data_row(["2", "0/1000BB8"])[5:]
        # pg_receivewal reads the row's CommandComplete, then wants one more before it follows timeline 2.
        assert (got[2][1], got[3][1]) == (b"START_STREAMING\0", b"START_REPLICATION\0")
    serve(tmp_path, test)


def test_a_stream_on_the_current_timeline_is_capped_at_the_commit_and_follows_it(tmp_path: Path) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        c = await Client.connect(server.port)
        await c.login("secret")
        c.query(f"START_REPLICATION PHYSICAL 0/{SWITCH:X}")
        assert (await c.message())[0] == b"W"
        end = SWITCH
        while end < SEG + 4000:
            msg = pgrepl.parse_copy_data((await c.message())[1])
            assert isinstance(msg, pgrepl.XLogData) and msg.wal_end == SEG + 4000
            end = msg.start + len(msg.data)
        assert end == SEG + 4000
        # Ask for a reply: whatever was sent before it has arrived, and nothing beyond the commit was.
        c.send(b"d", pgrepl.encode_status(end, end, 0, 0, True))
        msg = pgrepl.parse_copy_data((await c.message())[1])
        assert msg == pgrepl.Keepalive(SEG + 4000, msg.send_time, False)
        sk.positions.publish(Positions(3, SEG + 5000, SEG + 4500, 0))
        msg = pgrepl.parse_copy_data((await c.message())[1])
        assert isinstance(msg, pgrepl.XLogData) and (msg.start, len(msg.data)) == (SEG + 4000, 500)
        c.send(b"c")  # the reader ends it: CopyDone back, then the command completes
        assert [k for k, _ in await c.until(b"Z")] == [b"c", b"C", b"C", b"Z"]
        c.query("IDENTIFY_SYSTEM")
        assert (await c.until(b"Z"))[-1][0] == b"Z"
    serve(tmp_path, test)


def test_a_read_that_raced_an_announced_cut_is_not_sent(tmp_path: Path) -> None:
    """In the reader process the cut generation is written (shared memory) before the cut is made, and
    the positions after it arrive later: bytes read meanwhile may be the cut's, and are thrown away."""
    async def test(server: ReaderServer, sk: Standin) -> None:
        sk.announced = 1  # the safekeeper is cutting; its new positions are not published yet
        c = await Client.connect(server.port)
        await c.login("secret")
        c.query(f"START_REPLICATION PHYSICAL 0/{SWITCH:X}")
        assert (await c.message())[0] == b"W"
        await until(lambda: sk.reads >= 1, "the walsender to read")
        sk.disk = 1  # the cut wrote other bytes, then its positions are published
        sk.positions.publish(Positions(3, SWITCH + 100, SWITCH + 100, 1))
        msg = pgrepl.parse_copy_data((await c.message())[1])
        assert isinstance(msg, pgrepl.XLogData) and msg.start == SWITCH
        assert len(msg.data) == 100 and msg.data == sk.read_wal(SWITCH, 100), \
            "bytes read before the cut was published were sent"
    serve(tmp_path, test)


@pytest.mark.parametrize("garbage", [b"\x00\x00\x00\x08\x00\x00\x00\x00", b"\xff" * 8])
def test_garbage_before_the_startup_packet_is_fatal(tmp_path: Path, garbage: bytes) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        c = await Client.connect(server.port)
        c.writer.write(garbage)
        kind, body = await c.message()
        assert kind == b"E" and error_of(body)["C"] == "08P01" and error_of(body)["S"] == "FATAL"
        assert await c.reader.read() == b""
    serve(tmp_path, test)


def test_the_auth_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        later = await Client.connect(server.port)
        assert (await later.login("pw2", user="later"))[0][0] == b"E"
        readerauth.add(tmp_path / "readers.auth", "later", "pw2")
        ok = await Client.connect(server.port)
        assert (await ok.login("pw2", user="later"))[-1][0] == b"Z"
        readerauth.remove(tmp_path / "readers.auth", "later")
        gone = await Client.connect(server.port)
        assert (await gone.login("pw2", user="later"))[0][0] == b"E"
        (tmp_path / "readers.auth").chmod(0o644)  # unusable now: every reader is refused, the port stays up
        refused = await Client.connect(server.port)
        refused.startup(user="reader", replication="true")
        kind, body = await refused.message()
        assert kind == b"E" and error_of(body)["C"] == "28000"
    serve(tmp_path, test)


async def server_first(c: Client, user: str) -> str:
    """The salt an AuthenticationSASLContinue gives `user`, before any proof."""
    c.startup(user=user, replication="true")
    await c.message()
    first = b"n,,n=,r=abcdefghijklmnopqrstuvwx"
    c.send(b"p", b"SCRAM-SHA-256\0" + struct.pack(">I", len(first)) + first)
    kind, body = await c.message()
    assert kind == b"R" and body[:4] == b"\0\0\0\x0b"
    fields = dict(f.split("=", 1) for f in body[4:].decode().split(","))
    return f"{fields['s']} i={fields['i']}"


def test_server_first_does_not_tell_which_names_exist(tmp_path: Path) -> None:
    salts: dict[str, list[str]] = {}

    async def test(server: ReaderServer, sk: Standin) -> None:
        for user in ("reader", "nosuchuser", "reader", "nosuchuser", "admin"):
            salts.setdefault(user, []).append(await server_first(await Client.connect(server.port), user))
    serve(tmp_path, test)
    shapes = {user: {(len(s.split()[0]), s.split()[1]) for s in got} for user, got in salts.items()}
    assert shapes["nosuchuser"] == shapes["admin"] == shapes["reader"]  # same length and iteration count
    assert len(set(salts["nosuchuser"])) == 1  # a repeated probe sees what a real name shows: one salt
    assert salts["nosuchuser"][0] != salts["admin"][0]
    # The same secret (the safekeeper keeps it in its data directory): the same salts after a restart.
    runs: list[str] = []

    async def probe(server: ReaderServer, sk: Standin) -> None:
        runs.append(await server_first(await Client.connect(server.port), "nosuchuser"))
    for attempt in ("first", "restarted"):
        serve(tmp_path / attempt, probe, mock_secret=b"k" * 32)
    assert runs[0] == runs[1]


def test_a_temporary_slot_is_its_connections_and_its_end_removes_only_that_slot(tmp_path: Path) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        a, b = await Client.connect(server.port), await Client.connect(server.port)
        await a.login("secret")
        await b.login("secret")
        a.query("CREATE_REPLICATION_SLOT x TEMPORARY PHYSICAL RESERVE_WAL")
        assert (await a.until(b"Z"))[-2][0] == b"C"
        for command in ("DROP_REPLICATION_SLOT x", "START_REPLICATION SLOT x PHYSICAL 0/1000000"):
            b.query(command)
            got = await b.until(b"Z")
            assert got[0][0] == b"E" and error_of(got[0][1])["C"] == "55006", command
        a.query("DROP_REPLICATION_SLOT x")  # its own connection may
        assert (await a.until(b"Z"))[0][0] == b"C"
        b.query("CREATE_REPLICATION_SLOT x PHYSICAL RESERVE_WAL")
        assert (await b.until(b"Z"))[-2][0] == b"C"
        a.send(b"X")
        a.writer.close()
        await until(lambda: len(server.connections) == 1, "the temporary slot's connection to end")
        slot = sk.slots.get("x")
        assert slot is not None and not slot.temporary  # b's slot is still there
    serve(tmp_path, test)


async def stream_end(c: Client, query: str) -> tuple[bytes, bytes]:
    """The error of `query`, or the end of the first XLogData it streams."""
    c.query(query)
    kind, body = await c.message()
    if kind == b"E":
        await c.until(b"Z")
        return b"E", body
    assert kind == b"W"
    msg = pgrepl.parse_copy_data((await c.message())[1])
    return b"d", b"%d" % (msg.start + len(msg.data))


def test_a_password_reader_cannot_read_above_the_commit_nor_learn_the_term(tmp_path: Path) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        for term in (3, 99):  # the safekeeper's term, and a guess
            c = await Client.connect(server.port)
            await c.login("secret")
            kind, body = await stream_end(c, f"START_REPLICATION PHYSICAL 0/{SEG + 4000:X} TIMELINE 2 TERM {term}")
            assert kind == b"E", f"TERM {term} was served to a password reader: WAL up to {body!r}"
            error = error_of(body)
            assert error["C"] == "42501" and "term 3" not in error["M"] and " 3" not in error["M"]
    serve(tmp_path, test)


def test_a_wrong_term_is_refused_without_the_current_one() -> None:
    from sidecar.consensus.reading import ReadCursor, ReadRefused
    s = ServerState(3, SEG + 5000, SEG + 4000, 0, 1, (), SEG)
    with pytest.raises(ReadRefused) as e:
        ReadCursor(SEG, 1, s, term=99)
    assert "3" not in str(e.value).replace("99", "")


def test_over_tls_a_proposer_certificate_reads_above_the_commit_and_channel_binding_is_offered(
        tmp_path: Path, pki) -> None:  # noqa: ANN001 - the session's TestPKI
    import types

    import psycopg

    from sidecar import tls
    from sidecar.address import Address
    from sidecar.walclient import ReaderError, WalReader, reader_conninfo

    passfile = tmp_path / "pgpass"
    passfile.write_text("*:*:*:reader:secret\n")
    passfile.chmod(0o600)
    auth = tmp_path / "readers.auth"
    readerauth.add(auth, "reader", "secret")
    server_dir = pki.certs("safekeeper", 1)

    def creds(role: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(reader_user="reader", reader_passfile=passfile, certs_dir=pki.certs(role),
                                     insecure=False, reader_timeout=10.0)

    def read_above_commit(port: int, role: str) -> int | str:
        try:
            with WalReader(Address("127.0.0.1", port), creds(role)) as r:
                return max(lsn + len(data) for lsn, data in r.stream(SEG + 4000, timeline=2, term=3,
                                                                     stop_at=SEG + 5000))
        except ReaderError as e:
            return f"{e.sqlstate}: {e}"

    def bound(port: int) -> str:
        conninfo = reader_conninfo(Address("127.0.0.1", port), creds("client"), channel_binding="require")
        with psycopg.connect(conninfo, autocommit=True) as conn:
            return conn.pgconn.parameter_status(b"server_version").decode()

    async def main() -> None:
        sk = Standin(tmp_path)
        options = ReaderPort("127.0.0.1", 0, AuthFile(auth), ssl_context=tls.reader_port_context(server_dir),
                             server_end_point=tls.server_end_point(server_dir))
        server = ReaderServer(sk, options)
        await server.start()
        try:
            assert await asyncio.to_thread(read_above_commit, server.port, "proposer") == SEG + 5000
            refused = await asyncio.to_thread(read_above_commit, server.port, "client")
            assert isinstance(refused, str) and refused.startswith("42501")
            assert (await asyncio.to_thread(bound, server.port)).startswith("15.")
        finally:
            await server.close()
    run(main(), timeout=60)


def negotiation(code: int) -> bytes:
    return struct.pack(">II", 8, code)


async def answer_until_closed(c: Client) -> tuple[bytes, dict[str, str]]:
    """What the server sent before its FATAL ErrorResponse, and the FATAL's fields; then the close."""
    before = b""
    while (b := await c.reader.readexactly(1)) != b"E":
        before += b
    (length,) = struct.unpack(">I", await c.reader.readexactly(4))
    fields = error_of(await c.reader.readexactly(length - 4))
    assert await c.reader.read() == b"", "the connection is closed after the FATAL"
    return before, fields


@pytest.mark.parametrize(("sent", "answers", "protocol"), [
    ([pgwire.SSL_REQUEST_CODE] * 1000, b"N", "1234.5679"),
    ([pgwire.GSSENC_REQUEST_CODE] * 1000, b"N", "1234.5680"),
    ([pgwire.GSSENC_REQUEST_CODE, pgwire.SSL_REQUEST_CODE] * 500, b"NN", "1234.5680"),
])
def test_one_ssl_and_one_gss_request_per_connection_as_postgresql(tmp_path: Path, sent: list[int], answers: bytes,
                                                                   protocol: str) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        c = await Client.connect(server.port)
        c.writer.write(b"".join(negotiation(code) for code in sent))
        before, fatal = await answer_until_closed(c)
        assert before == answers
        assert (fatal["S"], fatal["C"]) == ("FATAL", "08P01")
        assert fatal["M"].startswith(f"unsupported frontend protocol {protocol}"), fatal
    serve(tmp_path, test)


def test_a_startup_packet_over_postgresqls_cap_is_fatal(tmp_path: Path) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        c = await Client.connect(server.port)
        c.writer.write(struct.pack(">II", pgwire.MAX_STARTUP_PACKET + 1, pgwire.PROTOCOL_3_0) + b"user\0" * 2000)
        before, fatal = await answer_until_closed(c)
        assert before == b"" and fatal["C"] == "08P01" and "invalid length of startup packet" in fatal["M"]
    serve(tmp_path, test)


def test_silent_connections_do_not_keep_a_reader_out(tmp_path: Path) -> None:
    async def test(server: ReaderServer, sk: Standin) -> None:
        silent = [await Client.connect(server.port) for _ in range(MAX_READERS + 8)]
        # Each newcomer beyond MAX_STARTUPS drops the oldest stranger; nobody logged in is refused.
        for s in silent[:-MAX_STARTUPS]:
            kind, body = await asyncio.wait_for(s.message(), 10)
            assert kind == b"E" and error_of(body)["C"] == "53300"
        reader = await Client.connect(server.port)
        assert (await reader.login("secret"))[-1][0] == b"Z"
        assert len(server.starting) <= MAX_STARTUPS and len(server.connections) <= MAX_STARTUPS + 1
        for s in silent:
            s.writer.close()
    serve(tmp_path, test)


def test_strangers_from_one_address_drop_their_own_before_anothers() -> None:
    assert to_drop(["10.0.0.9", "10.0.0.1", "10.0.0.1", "10.0.0.2"]) == 1
    assert to_drop(["10.0.0.9", "10.0.0.1", "10.0.0.2"]) == 0  # a tie: the oldest
    assert to_drop(["10.0.0.9"] * 3 + ["10.0.0.1"] * 4) == 3


def test_a_reader_asking_for_replies_it_never_reads_is_not_read_from(tmp_path: Path) -> None:
    """L-4: replies wait for the send buffer to drain before the reader's next message is read."""
    async def test(server: ReaderServer, sk: Standin) -> None:
        # Small socket buffers on both ends, so what is unread shows in the server's own buffer.
        for s in server._server.sockets:  # noqa: SLF001 - accepted sockets inherit the listener's sizes
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        c = Client(*await asyncio.open_connection(sock=sock))
        await c.login("secret")
        c.query(f"START_REPLICATION PHYSICAL 0/{SEG + 4000:X}")
        assert (await c.message())[0] == b"W"
        (conn,) = server.connections
        transport = conn.writer.transport
        status = pgwire.copy_data(pgrepl.encode_status(0, 0, 0, 0, reply_requested=True))
        asked = 40_000  # 1.5 MB of requests, 0.9 MB of replies
        c.writer.write(status * asked)
        bound = 256 << 10
        # Either the server stops reading this reader, or its buffer grows past any bound.
        await until(lambda: not transport.is_reading() or transport.get_write_buffer_size() > bound,
                    "the server to stop reading or to buffer past the bound", timeout=60)
        assert transport.get_write_buffer_size() <= bound
        # Nothing is lost: once the reader reads, every reply comes, one per request.
        for _ in range(asked):
            msg = pgrepl.parse_copy_data((await c.message())[1])
            assert isinstance(msg, pgrepl.Keepalive) and not msg.reply_requested
    serve(tmp_path, test)

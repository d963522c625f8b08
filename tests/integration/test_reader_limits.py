"""What a reader may do on a safekeeper's reader port, against real safekeeper processes over real sockets
(audit-2 M-4, L-2, L-3, M-6, L-5, L-4): the in-process tests are in tests/unit/safekeeper/test_pgserver.py.

Each test here fails on the code the audit reviewed (16afbeb): slots held WAL without bound and `check`
said OK (M-4), any password reader read above the commit position with TERM and a wrong term was told the
right one (L-2), a temporary slot's end removed whatever slot then had its name (L-3), the mock salt of an
unknown name was shorter than a real one and changed at every restart (M-6), no SCRAM-SHA-256-PLUS
was offered, so libpq's channel_binding=require could not connect (L-5), and a reader that asked for a
reply to every status message and read none was read on while the replies piled up in memory (L-4).
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import ssl
import struct
import threading
import types
import urllib.request
from pathlib import Path

import psycopg
import pytest
from scramp import ScramClient

from support.deployment import APP, Deployment, Writer, commit_lsn_of
from support.helpers import free_port, peak_rss, wait_for, walsidecar
from support.procs import ProcessTracker
from sidecar import pgrepl, pgwire
from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG, format_lsn, parse_lsn, parse_segment_file_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def replication(d: Deployment, i: int, **params: str) -> psycopg.Connection:
    # No prepared statements: a replication connection takes only the simple query protocol.
    return psycopg.connect(d.reader_dsn(i, **params), replication="true", autocommit=True, prepare_threshold=None)


def commit_position(d: Deployment, i: int) -> int:
    with replication(d, i) as r:
        return parse_lsn(r.execute("IDENTIFY_SYSTEM").fetchone()[2])


def read_slot(d: Deployment, i: int, name: str) -> tuple:
    with replication(d, i) as r:
        return r.execute(f"READ_REPLICATION_SLOT {name}").fetchone()


def switch_segments(d: Deployment, n: int) -> None:
    """n segment switches, each after a commit, so the commit position moves n segments on."""
    with d.sql() as c:
        for i in range(n):
            c.execute("INSERT INTO load VALUES (%s, repeat('w', 200))", (i,))
            c.execute("SELECT pg_switch_wal()")
        c.execute("INSERT INTO load VALUES (-1, 'after the switches')")


def held_segments(d: Deployment, i: int) -> list[int]:
    segnos = []
    for p in (d.sk_dir(i) / "wal").iterdir():
        try:
            segnos.append(parse_segment_file_name(p.name, SEG)[1])
        except ValueError:
            continue
    return sorted(segnos)


def restart_safekeeper(d: Deployment, i: int, *options: str) -> None:
    d.stop(f"safekeeper{i}")
    d.start(f"safekeeper{i}", *options)
    wait_for(lambda: commit_position(d, i) > 0, timeout=60, ignore=(psycopg.OperationalError,),
             what=f"safekeeper {i}'s reader port after the restart")


# ---- M-4: slots are bounded, and check says what they hold -----------------------------------------------


def test_slots_are_capped_and_one_holding_too_much_wal_is_invalidated_and_named_by_check(
        deployment: Deployment) -> None:
    d = deployment
    restart_safekeeper(d, 1, "--keep-wal", "16MB", "--max-slot-wal-keep-size", "48MB",
                       "--max-slots-per-reader", "2")
    with replication(d, 1) as r:
        r.execute("CREATE_REPLICATION_SLOT pin1 PHYSICAL RESERVE_WAL")
        r.execute("CREATE_REPLICATION_SLOT pin2 PHYSICAL RESERVE_WAL")
        with pytest.raises(psycopg.Error) as refused:
            r.execute("CREATE_REPLICATION_SLOT pin3 PHYSICAL RESERVE_WAL")
        assert refused.value.sqlstate == "53400", refused.value
    held_from = parse_lsn(read_slot(d, 1, "pin1")[1]) // SEG
    # Before: the slot holds what it reserved, within the bound.
    switch_segments(d, 2)
    wait_for(lambda: commit_position(d, 1) >= (held_from + 2) * SEG, timeout=60, what="the commit to move on")
    assert held_segments(d, 1)[0] <= held_from, "a slot within --max-slot-wal-keep-size holds its WAL"
    # Then more than 48MB behind: the slots are invalidated and hold nothing, so --keep-wal removes the WAL.
    switch_segments(d, 5)
    wait_for(lambda: read_slot(d, 1, "pin1")[1] is None, timeout=60,
             what="pin1 to be invalidated once it held more than --max-slot-wal-keep-size")
    wait_for(lambda: held_segments(d, 1)[0] > held_from, timeout=60,
             what="safekeeper 1 to remove the WAL the invalidated slots held")
    with replication(d, 1) as r:
        with pytest.raises(psycopg.Error, match="invalidated") as e:
            r.execute(f"START_REPLICATION SLOT pin1 PHYSICAL {format_lsn(commit_position(d, 1))}")
        assert e.value.sqlstate == "55000", e.value
    check = walsidecar("check", "--pg-dsn", d.pg.dsn(), "--safekeepers", ",".join(d.addresses), *d.tls("client"))
    lines = [line for line in check.stdout.splitlines() if "reader slots" in line]
    assert any("FAILED" in line and "pin1 invalidated" in line and "pin2 invalidated" in line for line in lines), \
        check.stdout + check.stderr
    assert check.returncode != 0


# ---- L-2: TERM reads are the proposer's ---------------------------------------------------------------


def test_a_password_reader_cannot_read_with_a_term_nor_learn_it_and_a_proposer_certificate_can(
        deployment: Deployment) -> None:
    from sidecar.walclient import ReaderError, WalReader
    d = deployment
    term = d.term(1)
    assert term > 0
    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (1, 'committed')")
    flushed = d.flush_lsn()
    commit = wait_for(lambda: (p := commit_position(d, 1)) >= flushed and p, timeout=30,
                      what="safekeeper 1's commit position to pass the insert")
    start = commit - commit % SEG
    for guess in (term, term + 97):
        with replication(d, 1) as r:
            with pytest.raises(psycopg.Error) as e:
                r.execute(f"START_REPLICATION PHYSICAL {format_lsn(start)} TIMELINE 1 TERM {guess}")
        assert e.value.sqlstate == "42501", e.value
        assert str(term) not in str(e.value).replace(str(guess), ""), f"the refusal tells the term: {e.value}"

    def creds(role: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(reader_user="walsidecar", reader_passfile=d.reader_passfile,
                                     certs_dir=d.certs_dir(f"reader-{role}", role), insecure=False,
                                     reader_timeout=10.0)

    address = d.members["safekeeper1"].reader_address  # type: ignore[attr-defined]
    with WalReader(address, creds("proposer")) as reader:
        end = max(lsn + len(data) for lsn, data in reader.stream(start, timeline=1, term=term, stop_at=commit))
    assert end >= commit
    with pytest.raises(ReaderError) as refused:
        with WalReader(address, creds("client")) as reader:
            list(reader.stream(start, timeline=1, term=term, stop_at=commit))
    assert refused.value.sqlstate == "42501"


# ---- L-3: a temporary slot is its connection's and goes by identity ------------------------------------


def test_a_temporary_slots_end_removes_only_itself(deployment: Deployment) -> None:
    d = deployment
    metrics = f"127.0.0.1:{free_port()}"
    restart_safekeeper(d, 1, "--metrics", metrics)
    with replication(d, 1) as a, replication(d, 1) as b:
        a.execute("CREATE_REPLICATION_SLOT x TEMPORARY PHYSICAL RESERVE_WAL")
        for command in ("DROP_REPLICATION_SLOT x", "START_REPLICATION SLOT x PHYSICAL 0/1000000"):
            with pytest.raises(psycopg.Error) as e:
                b.execute(command)
            assert e.value.sqlstate == "55006", (command, e.value)
        a.execute("DROP_REPLICATION_SLOT x")  # its own connection may
        b.execute("CREATE_REPLICATION_SLOT x PHYSICAL RESERVE_WAL")
        a.close()  # the temporary slot's connection ends after another's slot took the name
        # Its end (and the release of its slots) is handled once the safekeeper counts b's connection alone.
        wait_for(lambda: readers(metrics) == 1, timeout=30, what="a's connection to end on the safekeeper")
        assert b.execute("READ_REPLICATION_SLOT x").fetchone()[0] == "physical"
    restart_safekeeper(d, 1)
    assert read_slot(d, 1, "x")[0] == "physical", "b's slot is on disk too"


def readers(metrics: str) -> int:
    """Reader connections the safekeeper serving /status on `metrics` has now."""
    with urllib.request.urlopen(f"http://{metrics}/status", timeout=10) as f:
        return int(json.load(f)["readers"])


# ---- M-6 and L-5: SCRAM tells no names, and binds to the TLS channel ------------------------------------


def server_first(address: tuple[str, int], user: str) -> tuple[list[str], bytes, int]:
    """The mechanisms offered and the salt and iteration count an AuthenticationSASLContinue gives `user`,
    before any proof, over TLS (certificate not checked: only the SCRAM messages matter here)."""
    with socket.create_connection(address, timeout=30) as raw:
        raw.sendall(struct.pack(">II", 8, pgwire.SSL_REQUEST_CODE))
        assert raw.recv(1) == b"S"
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        with context.wrap_socket(raw) as s:
            params = b"user\0" + user.encode() + b"\0database\0replication\0replication\0true\0\0"
            s.sendall(struct.pack(">II", 8 + len(params), pgwire.PROTOCOL_3_0) + params)
            kind, body = message(s)
            assert kind == b"R" and body[:4] == struct.pack(">I", 10), (kind, body[:80])
            mechanisms = [m.decode() for m in body[4:].split(b"\0") if m]
            first = b"n,,n=,r=abcdefghijklmnopqrstuvwx"
            payload = b"SCRAM-SHA-256\0" + struct.pack(">I", len(first)) + first
            s.sendall(b"p" + struct.pack(">I", 4 + len(payload)) + payload)
            kind, body = message(s)
            assert kind == b"R" and body[:4] == struct.pack(">I", 11), (kind, body[:80])
            fields = dict(f.split("=", 1) for f in body[4:].decode().split(","))
            return mechanisms, base64.b64decode(fields["s"]), int(fields["i"])


def message(s: ssl.SSLSocket) -> tuple[bytes, bytes]:
    head = recv_exactly(s, 5)
    return head[:1], recv_exactly(s, struct.unpack(">I", head[1:])[0] - 4)


def recv_exactly(s: ssl.SSLSocket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def test_scram_salts_do_not_tell_which_names_exist(deployment: Deployment) -> None:
    d = deployment
    reader = d.members["safekeeper1"].reader_address  # type: ignore[attr-defined]
    address = (reader.host, reader.port)
    _, real_salt, real_iterations = server_first(address, "walsidecar")
    unknown = {user: server_first(address, user) for user in ("nosuchuser", "admin")}
    for user, (_, salt, iterations) in unknown.items():
        assert (len(salt), iterations) == (len(real_salt), real_iterations), \
            f"{user!r}'s mock salt is shaped unlike a real one: {len(salt)} bytes, {iterations} iterations"
    assert unknown["nosuchuser"][1] != unknown["admin"][1]
    assert server_first(address, "nosuchuser")[1] == unknown["nosuchuser"][1], "a repeated probe sees one salt"
    restart_safekeeper(d, 1)
    assert server_first(address, "nosuchuser")[1] == unknown["nosuchuser"][1], "as a real name's, after a restart"
    assert server_first(address, "walsidecar")[1] == real_salt


def test_channel_binding_is_offered_over_tls_and_libpq_can_require_it(deployment: Deployment) -> None:
    d = deployment
    reader = d.members["safekeeper1"].reader_address  # type: ignore[attr-defined]
    mechanisms = server_first((reader.host, reader.port), "walsidecar")[0]
    assert mechanisms == ["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"], mechanisms
    # libpq insists on SCRAM-SHA-256-PLUS with channel_binding=require: a relay cannot pass it on.
    with replication(d, 1, channel_binding="require") as r:
        assert r.execute("IDENTIFY_SYSTEM").fetchone()[1] == 1


# ---- L-4: a reader that asks for replies and never reads them is not read from ------------------------

# What the safekeeper's peak resident memory may grow by while a reader floods it (16afbeb's grew by
# more than the reader sent: a buffered reply for every status message read).
MEMORY_BOUND = 24 << 20
STATUS_REQUEST = pgwire.copy_data(pgrepl.encode_status(0, 0, 0, 0, reply_requested=True))
REPLY_SIZE = len(pgwire.copy_data(pgrepl.encode_keepalive(0, 0)))
CLIENT_RCVBUF = 4096
SENDER_TIMEOUT = 20


def flood_bound() -> int:
    """The most a reader that never reads can push into a safekeeper that stops reading once the replies it
    owes do not drain: the reader's send buffer and the safekeeper's receive buffer at their largest
    (tcp_wmem, tcp_rmem), and the requests whose replies fill the safekeeper's send buffer (tcp_wmem) and
    the reader's small receive buffer; 8 MiB for the TLS records and the event loop's buffers."""
    wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    rmem = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
    replied = (wmem + 2 * CLIENT_RCVBUF) // REPLY_SIZE * len(STATUS_REQUEST)
    return wmem + rmem + replied + (8 << 20)


def logged_in(d: Deployment, i: int) -> ssl.SSLSocket:
    """A replication connection to safekeeper i's reader port over verified TLS, logged in with
    SCRAM-SHA-256 by hand: a frontend that reads only when it chooses to, which libpq is not."""
    user, password = d.reader_passfile.read_text().strip().split(":")[3:5]  # *:*:*:user:password
    reader = d.members[f"safekeeper{i}"].reader_address  # type: ignore[attr-defined]
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)  # before connect: the window it offers
    raw.settimeout(30)
    raw.connect((reader.host, reader.port))
    raw.sendall(struct.pack(">II", 8, pgwire.SSL_REQUEST_CODE))
    assert raw.recv(1) == b"S"
    context = ssl.create_default_context(cafile=str(d.certs_dir("reader", "client") / "ca.crt"))
    s = context.wrap_socket(raw, server_hostname=reader.host)
    params = f"user\0{user}\0database\0replication\0replication\0true\0\0".encode()
    s.sendall(struct.pack(">II", 8 + len(params), pgwire.PROTOCOL_3_0) + params)
    kind, body = message(s)
    assert kind == b"R" and body[:4] == struct.pack(">I", 10), (kind, body[:80])
    scram = ScramClient(["SCRAM-SHA-256"], user, password)
    first = scram.get_client_first().encode()
    s.sendall(pgwire.message(b"p", b"SCRAM-SHA-256\0" + struct.pack(">I", len(first)) + first))
    kind, body = message(s)
    assert kind == b"R" and body[:4] == struct.pack(">I", 11), (kind, body[:80])
    scram.set_server_first(body[4:].decode())
    s.sendall(pgwire.message(b"p", scram.get_client_final().encode()))
    kind, body = message(s)
    assert kind == b"R" and body[:4] == struct.pack(">I", 12), (kind, body[:80])
    scram.set_server_final(body[4:].decode())
    while kind != b"Z":
        kind, body = message(s)
        assert kind != b"E", body
    return s


class StatusFlood(threading.Thread):
    """Standby status messages asking for a reply, pushed as fast as the socket takes them until `limit`
    bytes went out or the socket fails; nothing is ever read."""

    def __init__(self, s: ssl.SSLSocket, limit: int) -> None:
        super().__init__(daemon=True)
        self.s, self.limit = s, limit
        s.settimeout(None)  # a send the safekeeper does not take blocks until it does, or until stop()
        self.pushed = 0
        self.error: OSError | None = None

    def run(self) -> None:
        chunk = STATUS_REQUEST * 1000
        try:
            while self.pushed < self.limit:
                self.s.sendall(chunk)
                self.pushed += len(chunk)
        except OSError as e:
            self.error = e

    def stop(self) -> None:
        """Unblock a send the safekeeper does not take: shut the socket down under it."""
        with socket.fromfd(self.s.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
            with contextlib.suppress(OSError):
                dup.shutdown(socket.SHUT_RDWR)
        self.join(timeout=30)
        assert not self.is_alive(), "the flood's send did not end with its socket shut down"
        self.s.close()


def test_a_reader_asking_for_replies_it_never_reads_is_not_read_from_and_commits_go_on(
        pg_factory, procs: ProcessTracker, test_dir: Path) -> None:  # noqa: ANN001
    d = Deployment(pg_factory(settings={"synchronous_standby_names": APP}), procs, test_dir)
    # The stream of a reader that takes nothing ends after this long (PostgreSQL's wal_sender_timeout, 60 s
    # by default); the old safekeeper read on all that while.
    d.extra["safekeeper1"] = ["--pg-wal-sender-timeout", str(SENDER_TIMEOUT)]
    d.start_all()
    with d.sql() as c:
        c.execute("CREATE TABLE load (id int, pad text)")
    pid = d.safekeepers[1].pid
    limit = flood_bound()
    s = logged_in(d, 1)
    s.sendall(pgwire.message(b"Q", f"START_REPLICATION PHYSICAL {format_lsn(commit_position(d, 1))}\0".encode()))
    kind, body = message(s)
    assert kind == b"W", body  # CopyBothResponse: streaming
    log = d.log_path("safekeeper1")
    peak = peak_rss(pid)
    writer = Writer(d.pg.dsn())
    writer.start()
    flood = StatusFlood(s, limit)
    flood.start()
    try:
        # The safekeeper stops reading once the replies it owes do not drain, and ends the stream once
        # they (or the WAL the writer's commits make it send) stayed untaken for SENDER_TIMEOUT;
        # 16afbeb's read on meanwhile, as long as it was sent status messages.
        wait_for(lambda: "stream ended" in log.read_text() or not flood.is_alive(), timeout=SENDER_TIMEOUT + 120,
                 what="the safekeeper to end the stream, or the flood to end")
        pushed, grown = flood.pushed, peak_rss(pid) - peak
    finally:
        flood.stop()
        acked = writer.stop()
    assert pushed < limit, \
        f"the safekeeper read {pushed >> 20} MiB of status messages whose replies were never read ({flood.error!r})"
    assert grown < MEMORY_BOUND, f"the safekeeper grew by {grown >> 20} MiB for a reader that reads nothing"
    ended = [line for line in log.read_text().splitlines() if "stream ended" in line]
    assert len(ended) == 1 and "the reader took no" in ended[0] and f"for {SENDER_TIMEOUT}s" in ended[0], ended
    # Meanwhile the proposer's stream went on: commits acknowledged, and safekeeper 1 has them.
    assert acked and writer.error is None, writer.error
    with d.sql() as c:
        end = commit_lsn_of(c, "INSERT INTO load VALUES (-1, 'after the flood')")
    wait_for(lambda: commit_position(d, 1) >= end, timeout=60,
             what="safekeeper 1's commit position to pass the commits made during the flood")

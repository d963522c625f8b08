"""The safekeepers' reader port against real PostgreSQL 15 clients: pg_receivewal, a standby, libpq, psycopg."""

from __future__ import annotations

import asyncio
import os
import re
import pwd
import shutil
import socket
import ssl
import struct
import subprocess
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from support.deployment import APP, Deployment, Writer, commit_lsn_of, read_wal, start_commit, syncrep_waiters
from support.helpers import created, free_port, run, until, wait_for
from support.procs import ProcessTracker
from sidecar import pgwire
from sidecar.lsn import DEFAULT_SEGMENT_SIZE, format_lsn, parse_lsn, segment_file_name
from sidecar.pgcluster import LocalCluster, find_bin_dir
from sidecar.processes import sidecar_argv
from sidecar.proposer.replication import ReplicationStream, connect_replication

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def replication(d: Deployment, i: int, **params: str) -> psycopg.Connection:
    # No prepared statements: a replication connection takes only the simple query protocol.
    return psycopg.connect(d.reader_dsn(i, **params), replication="true", autocommit=True, prepare_threshold=None)


def commit_position(d: Deployment, i: int) -> int:
    """What safekeeper i serves now: IDENTIFY_SYSTEM's xlogpos (its commit position)."""
    with replication(d, i) as r:
        return parse_lsn(r.execute("IDENTIFY_SYSTEM").fetchone()[2])


def identify(d: Deployment, i: int) -> tuple:
    with replication(d, i) as r:
        return r.execute("IDENTIFY_SYSTEM").fetchone()


def fill_wal(d: Deployment, rows: int = 20000) -> int:
    """Commit rows across a segment switch; the end of WAL after the last commit."""
    with d.sql() as c:
        c.execute(f"INSERT INTO load SELECT g, repeat('r', 300) FROM generate_series(1, {rows}) g")
        c.execute("SELECT pg_switch_wal()")
        return commit_lsn_of(c, "INSERT INTO load VALUES (-1, 'after the switch')")


# ---- (a) pg_receivewal --------------------------------------------------------------------------


def receivewal(procs: ProcessTracker, d: Deployment, i: int, directory: Path, slot: str):  # noqa: ANN201
    directory.mkdir(parents=True, exist_ok=True)
    return procs.start([str(find_bin_dir() / "pg_receivewal"), "-d", d.reader_dsn(i), "-D", str(directory),
                        "-S", slot, "--status-interval=1", "--synchronous", "--no-loop", "-v"], name="pg_receivewal")


def test_pg_receivewal_writes_the_primarys_wal_and_resumes_from_its_slot(deployment: Deployment,
                                                                         procs: ProcessTracker, test_dir: Path) -> None:
    d = deployment
    with replication(d, 1) as r:
        r.execute("CREATE_REPLICATION_SLOT archive1 PHYSICAL")
        assert r.execute("READ_REPLICATION_SLOT archive1").fetchone() == ("physical", None, None)
    fill_wal(d)
    first = receivewal(procs, d, 1, test_dir / "recv1", "archive1")
    commit = wait_for(lambda: (c := commit_position(d, 1)) >= d.flush_lsn() and c, timeout=60,
                      what="safekeeper 1's commit position to reach the primary's flush")
    # Without a slot position, it starts at the segment of IDENTIFY_SYSTEM's xlogpos; the WAL
    # before it is the primary's too, as it is stored: start from the earliest segment it wrote.
    def written() -> list[int]:
        return [int(p.name[8:24], 16) * DEFAULT_SEGMENT_SIZE
                for p in (test_dir / "recv1").iterdir() if not p.name.endswith(".tmp")]
    start = min(wait_for(written, timeout=60, what="pg_receivewal to open its first segment"))

    primary = read_wal(d.pg.pg_wal_dir, start, commit)
    # pg_receivewal's .partial file is zero-padded from the start: wait for the bytes, not the length.
    wait_for(lambda: read_wal(test_dir / "recv1", start, commit) == primary, timeout=60,
             what="pg_receivewal to hold the primary's WAL up to the commit position")
    completed = [p.name for p in (test_dir / "recv1").iterdir() if len(p.name) == 24]
    for name in completed:  # a completed segment is the primary's, whole
        assert (test_dir / "recv1" / name).read_bytes() == (d.pg.pg_wal_dir / name).read_bytes(), name
    # Its standby status moved the slot.
    slot_lsn = wait_for(lambda: (row := identify_slot(d, 1, "archive1")) and row[1] and parse_lsn(row[1]) >= commit
                        and parse_lsn(row[1]), timeout=30, what="the slot to reach the commit position")
    first.interrupt()

    # More WAL while it is down; a new pg_receivewal in an empty directory starts at the slot.
    end = fill_wal(d, 5000)
    receivewal(procs, d, 1, test_dir / "recv2", "archive1")
    resume = slot_lsn - slot_lsn % DEFAULT_SEGMENT_SIZE
    commit = wait_for(lambda: (c := commit_position(d, 1)) >= end and c, timeout=60, what="the commit to move on")
    primary = read_wal(d.pg.pg_wal_dir, resume, commit)
    wait_for(lambda: read_wal(test_dir / "recv2", resume, commit) == primary, timeout=60,
             what="the restarted pg_receivewal to hold the primary's WAL from its slot up to the commit position")
    names = sorted(p.name[:24] for p in (test_dir / "recv2").iterdir())
    assert names[0] == segment_file_name(1, resume // DEFAULT_SEGMENT_SIZE), names


def identify_slot(d: Deployment, i: int, slot: str) -> tuple:
    with replication(d, i) as r:
        return r.execute(f"READ_REPLICATION_SLOT {slot}").fetchone()


# ---- (b) a standby --------------------------------------------------------------------------------


def test_a_standby_streams_from_a_safekeeper_and_has_every_acknowledged_row(deployment: Deployment,
                                                                           test_dir: Path) -> None:
    d = deployment
    postgres = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
    home = test_dir / "standby"
    home.mkdir()
    # The standby runs as postgres: its own copy of the CA certificate and of the reader's password.
    shutil.copy(d.certs_dir("reader", "client") / "ca.crt", home / "ca.crt")
    shutil.copy(d.reader_passfile, home / "readers.pgpass")
    os.chmod(home / "readers.pgpass", 0o600)
    for p in (home, home / "ca.crt", home / "readers.pgpass"):
        if postgres is not None:
            os.chown(p, postgres.pw_uid, postgres.pw_gid)
    standby = LocalCluster(home / "data", free_port(), log_file=home / "standby.log")
    try:
        standby._prepare_log_file()
        standby.run_bin("pg_basebackup", "-D", str(standby.data_dir), "-d", d.pg.dsn(), "-X", "none",
                        "-c", "fast", timeout=120)
        standby.set({"port": str(standby.port), "hot_standby": "on", "synchronous_standby_names": "",
                     "primary_conninfo": d.reader_dsn(1, application_name="standby1",
                                                      passfile=str(home / "readers.pgpass"),
                                                      sslrootcert=str(home / "ca.crt"))})
        (standby.data_dir / "standby.signal").touch()
        if postgres is not None:
            os.chown(standby.data_dir / "standby.signal", postgres.pw_uid, postgres.pw_gid)
        writer = Writer(d.pg.dsn())
        writer.start()
        standby.start()
        wait_for(lambda: len(writer.acked) >= 200, timeout=60, what="acknowledged writes")
        acked = writer.stop()
        assert writer.error is None

        def standby_rows() -> int:
            with psycopg.connect(standby.dsn(), autocommit=True, connect_timeout=5) as c:
                return c.execute("SELECT count(*) FROM load WHERE id = ANY(%s)", (acked,)).fetchone()[0]
        wait_for(lambda: standby_rows() == len(acked), timeout=120, ignore=(psycopg.OperationalError,),
                 what="the standby to replay every acknowledged row")
        with psycopg.connect(standby.dsn(), autocommit=True) as c:
            assert c.execute("SELECT pg_is_in_recovery()").fetchone()[0] is True
            status, conninfo = c.execute("SELECT status, conninfo FROM pg_stat_wal_receiver").fetchone()
            assert status == "streaming" and f"port={d.members['safekeeper1'].reader_port}" in conninfo
        # The primary still has one synchronous standby: the sidecar.
        rows = d.replication_rows()
        assert set(rows) == {APP} and rows[APP][1] == "sync", rows
    finally:
        standby.teardown()


# ---- (c) nothing beyond the commit position --------------------------------------------------------


def committed(d: Deployment) -> tuple[int, int]:
    """Commit WAL and wait until safekeeper 1 serves all of it: (its commit position, its segment's start)."""
    fill_wal(d, 2000)
    base = wait_for(lambda: commit_position(d, 1) >= d.flush_lsn() and commit_position(d, 1), timeout=60,
                    what="the commit position to reach the primary's flush")
    return base, base - base % DEFAULT_SEGMENT_SIZE


async def reader(d: Deployment, start: int, name: str, received: bytearray, **kwargs: Any) -> ReplicationStream:
    """A started stream from safekeeper 1's reader port, from `start`, gathering the WAL into `received`."""
    conn = await connect_replication(d.reader_dsn(1), name)
    stream = ReplicationStream(conn, start_lsn=start, timeline=1, slot=None,
                               on_wal=lambda lsn, data: received.extend(data), **kwargs)
    await stream.start()
    return stream


async def run_ahead(d: Deployment) -> tuple[int, int, threading.Thread, dict]:
    """Stop safekeepers 2 and 3 and start a commit, which hangs while safekeeper 1 stores its WAL beyond
    the commit position: (that commit position, the end of what safekeeper 1 stores, the commit's thread
    and result)."""
    d.safekeepers[2].kill9()
    d.safekeepers[3].kill9()
    commit = await asyncio.to_thread(commit_position, d, 1)
    thread, result = start_commit(d.pg.dsn(), "INSERT INTO load SELECT g, repeat('z', 500) "
                                              "FROM generate_series(1, 3000) g")
    await until(lambda: syncrep_waiters(d) >= 1, "the commit to wait for the quorum", timeout=30)
    with d.sql() as c:
        ahead = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
    assert ahead > commit
    await until(lambda: len(read_wal(d.sk_dir(1) / "wal", commit, ahead)) == ahead - commit,
                "safekeeper 1 to store the WAL the quorum has not acknowledged", timeout=30)
    return commit, ahead, thread, result


def test_a_reader_never_receives_wal_beyond_the_commit_position(deployment: Deployment) -> None:
    d = deployment
    base, start = committed(d)

    async def main() -> None:
        received = bytearray()
        stream = await reader(d, start, "checker", received)

        async def synced() -> int:
            """Everything the safekeeper sent before now has arrived: ask for a reply and wait for it."""
            k = stream.keepalives_received
            stream.send_status(stream.received_lsn, stream.received_lsn, 0, reply_requested=True)
            await until(lambda: stream.keepalives_received > k, "the keepalive answering the status")
            return stream.received_lsn

        try:
            await until(lambda: stream.received_lsn >= base, "the WAL up to the commit position")
            commit, ahead, thread, result = await run_ahead(d)
            got = await synced()
            assert got <= commit, f"received up to {format_lsn(got)} with the commit at {format_lsn(commit)}"
            assert stream.server_wal_end <= commit
            # The quorum returns: the commit moves on, and so does the reader, to the same bytes.
            d.start_safekeeper(2)
            await asyncio.to_thread(thread.join, 120)
            assert result.get("done"), result
            await until(lambda: stream.received_lsn >= ahead, "the reader to receive the committed WAL", timeout=60)
            served = await asyncio.to_thread(commit_position, d, 1)
            assert stream.received_lsn <= served
        finally:
            await stream.close()
        assert bytes(received) == read_wal(d.pg.pg_wal_dir, start, stream.received_lsn)

    run(main(), timeout=240)


def test_a_reader_streams_on_across_a_term_that_cuts_its_safekeepers_tail(deployment: Deployment) -> None:
    d = deployment
    base, start = committed(d)

    async def main() -> None:
        received = bytearray()
        stream = await reader(d, start, "across-terms", received)
        try:
            await until(lambda: stream.received_lsn >= base, "the WAL up to the commit position")
            # Safekeeper 1 alone stores WAL beyond the commit position ...
            _, ahead, thread, result = await run_ahead(d)
            # ... which a term elected without it cuts: a proposer of safekeepers 2 and 3 only, then all three.
            term = d.term(1)
            d.kill("proposer")
            d.start_safekeeper(2)
            d.start_safekeeper(3)
            d.start_proposer("--safekeepers", ",".join(d.addresses[1:]))
            await asyncio.to_thread(wait_for, lambda: d.term(2) > term, 60, 0.05, "a term without safekeeper 1")
            d.stop("proposer")
            d.start_proposer()
            await asyncio.to_thread(thread.join, 120)
            assert result.get("done"), result
            await asyncio.to_thread(wait_for, lambda: d.term(1) > term + 1, 60, 0.05, "safekeeper 1 in the new term")
            with d.sql() as c:
                end = commit_lsn_of(c, "INSERT INTO load VALUES (-2, 'after the cut')")
            await until(lambda: stream.received_lsn >= end, "the reader to go on past the cut", timeout=60)
        finally:
            await stream.close()
        assert bytes(received) == read_wal(d.pg.pg_wal_dir, start, stream.received_lsn)
        # Safekeeper 1 joined the new term with its tail cut at the start of the term it missed.
        log = d.log_path("safekeeper1").read_text()
        cuts = [parse_lsn(m) for m in re.findall(r"elected .* truncate_lsn=(\S+)", log)]
        assert cuts and cuts[-1] < ahead, (cuts, ahead)

    run(main(), timeout=240)


def rss(pid: int) -> int:
    """Resident memory of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_reader_that_stops_reading_holds_no_wal_in_memory_and_commits_go_on(deployment: Deployment) -> None:
    d = deployment
    base, start = committed(d)
    pid = d.safekeepers[1].pid

    async def main() -> None:
        stream = await reader(d, start, "stalled", bytearray(), server_timeout=None)
        try:
            await until(lambda: stream.received_lsn >= base, "the WAL up to the commit position")
            stream.pause()
            before = rss(pid)
            # 64 MiB of WAL, one commit at a time, while the reader takes none of it.
            end = await asyncio.to_thread(fill_wal, d, 200000)
            grown = rss(pid) - before
            assert grown < 32 << 20, f"the safekeeper grew by {grown >> 20} MiB while its reader did not read"
            assert end - base > 48 << 20
            stream.resume()
            await until(lambda: stream.received_lsn >= end, "the reader to catch up once it reads", timeout=120)
        finally:
            await stream.close()

    run(main(), timeout=240)


# ---- (d) bad input ---------------------------------------------------------------------------------


def raw(d: Deployment, i: int) -> socket.socket:
    address = d.members[f"safekeeper{i}"].reader_address
    return socket.create_connection((address.host, address.port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def fatal_of(data: bytes) -> tuple[str, str]:
    """(SQLSTATE, message) of the FATAL ErrorResponse at the end of what the server sent."""
    i = data.rindex(b"E")
    (length,) = struct.unpack(">I", data[i + 1:i + 5])
    fields = dict((f[:1].decode(), f[1:].decode()) for f in data[i + 5:i + 1 + length].split(b"\0") if f)
    assert fields["S"] == "FATAL", fields
    return fields["C"], fields["M"]


def tls_startup(d: Deployment, i: int, params: dict[str, str]) -> ssl.SSLSocket:
    sock = raw(d, i)
    sock.sendall(struct.pack(">II", 8, pgwire.SSL_REQUEST_CODE))
    assert sock.recv(1) == b"S"
    ctx = ssl.create_default_context(cafile=str(d.certs_dir("reader", "client") / "ca.crt"))
    tls = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    body = struct.pack(">I", pgwire.PROTOCOL_3_0) + b"".join(k.encode() + b"\0" + v.encode() + b"\0"
                                                             for k, v in params.items()) + b"\0"
    tls.sendall(struct.pack(">I", len(body) + 4) + body)
    return tls


def test_bad_input_gets_clear_errors_and_the_commits_go_on(deployment: Deployment) -> None:
    d = deployment
    # Garbage instead of a startup packet.
    with raw(d, 1) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        code, message = fatal_of(read_all(s))
        assert code == "08P01" and "invalid length of startup packet" in message
    with raw(d, 1) as s:
        s.sendall(struct.pack(">II", 8, 0x00020000))
        code, message = fatal_of(read_all(s))
        assert code == "08P01" and "unsupported frontend protocol 2.0" in message
    # Plaintext where TLS is configured.
    with raw(d, 1) as s:
        body = struct.pack(">I", pgwire.PROTOCOL_3_0) + b"user\0walsidecar\0replication\0true\0\0"
        s.sendall(struct.pack(">I", len(body) + 4) + body)
        code, message = fatal_of(read_all(s))
        assert code == "28000" and "only TLS" in message
    # Garbage after the startup packet, in the middle of SCRAM.
    with tls_startup(d, 1, {"user": "walsidecar", "replication": "true"}) as s:
        hello = s.recv(1024)
        assert hello[:1] == b"R" and b"SCRAM-SHA-256" in hello
        s.sendall(b"\xff" * 64)
        code, message = fatal_of(read_all(s))
        assert code == "08P01" and "invalid frontend message type" in message
    # Not a replication connection.
    with pytest.raises(psycopg.OperationalError, match="physical replication only"):
        psycopg.connect(d.reader_dsn(1, dbname="postgres")).close()
    # Wrong password, unknown user: the same answer.
    for user in ("walsidecar", "nobody"):
        with pytest.raises(psycopg.OperationalError, match=f'password authentication failed for user "{user}"'):
            psycopg.connect(d.reader_dsn(1, user=user, password="wrong", passfile="/dev/null"), replication="true")
    # Commands that fail leave the connection usable.
    with replication(d, 1) as r:
        for command, sqlstate, text in (
                ("SELECT 1", "0A000", "cannot execute SQL"),
                ("FROBNICATE", "0A000", "cannot execute SQL"),
                ("BASE_BACKUP", "0A000", "BASE_BACKUP is not served"),
                ("START_REPLICATION SLOT s LOGICAL 0/0", "0A000", "logical replication"),
                ("START_REPLICATION PHYSICAL 100/0", "22023", "ahead of the WAL"),
                ("START_REPLICATION PHYSICAL 0/0", "58P01", "is not stored here"),
                ("START_REPLICATION PHYSICAL 0/1000000 TIMELINE 7", "22023", "timeline 7"),
                ("START_REPLICATION SLOT nosuch PHYSICAL 0/1000000", "42704", "does not exist"),
                ("TIMELINE_HISTORY 1", "58P01", "00000001.history"),
                ("SHOW shared_buffers", "42704", "unrecognized configuration parameter"),
                ("IDENTIFY_SYSTEM 7", "42601", "syntax error"),
                ("START_REPLICATION PHYSICAL nope", "42601", "invalid WAL position")):
            with pytest.raises(psycopg.Error, match=text) as err:
                r.execute(command)
            assert err.value.sqlstate == sqlstate, (command, err.value.sqlstate)
            assert r.execute("IDENTIFY_SYSTEM").fetchone()[1] == 1
    # The safekeepers run on and the proposer's commits go on.
    with d.sql() as c:
        c.execute("INSERT INTO load VALUES (7, 'after the bad input')")
    d.check_running()
    assert d.replication_row()[2] == "sync"


def test_slots_are_created_listed_and_dropped(deployment: Deployment) -> None:
    d = deployment
    with replication(d, 1) as r:
        row = r.execute("CREATE_REPLICATION_SLOT keep1 PHYSICAL RESERVE_WAL").fetchone()
        assert row[0] == "keep1" and parse_lsn(row[1]) > 0
        with pytest.raises(psycopg.Error, match="already exists"):
            r.execute("CREATE_REPLICATION_SLOT keep1 PHYSICAL")
        r.execute("CREATE_REPLICATION_SLOT temp1 TEMPORARY PHYSICAL")
        slot_type, lsn, tli = r.execute("READ_REPLICATION_SLOT keep1").fetchone()
        assert (slot_type, parse_lsn(lsn), tli) == ("physical", parse_lsn(row[1]), 1)
    # The temporary slot went with its connection; the other is kept across a restart.
    with replication(d, 1) as r:
        assert r.execute("READ_REPLICATION_SLOT temp1").fetchone() == (None, None, None)
    d.restart("safekeeper1")
    wait_for(lambda: identify_slot(d, 1, "keep1")[0] == "physical", timeout=30, ignore=(psycopg.OperationalError,),
             what="the slot after a restart")
    with replication(d, 1) as r:
        r.execute("DROP_REPLICATION_SLOT keep1")
        assert r.execute("READ_REPLICATION_SLOT keep1").fetchone() == (None, None, None)
    # pg_receivewal's own --create-slot and --drop-slot.
    for flag in ("--create-slot", "--drop-slot"):
        out = subprocess.run([str(find_bin_dir() / "pg_receivewal"), "-d", d.reader_dsn(1), "-S", "made_by_tool", flag],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert identify_slot(d, 1, "made_by_tool")[0] == ("physical" if flag == "--create-slot" else None)


# ---- (e) TLS and the auth file -----------------------------------------------------------------------


def test_tls_verify_full_and_no_auth_file_refuses_unless_insecure(deployment: Deployment, procs: ProcessTracker,
                                                                  test_dir: Path) -> None:
    d = deployment
    with replication(d, 2) as r:
        assert r.pgconn.ssl_in_use
        assert r.execute("IDENTIFY_SYSTEM").fetchone()[1] == 1
    certs = d.certs_dir("safekeeper9", "safekeeper", 9)
    port, reader_port = free_port(), free_port()
    procs.start(sidecar_argv("safekeeper", "--id", "9", "--listen", f"127.0.0.1:{port}", "--data-dir",
                             str(created(test_dir / "sk9", 9)), "--pg-listen", f"127.0.0.1:{reader_port}",
                             "--certs-dir", str(certs)), name="sk9")
    dsn = d.reader_dsn(1, port=str(reader_port))
    refused = wait_for(lambda: refusal(dsn), timeout=30, what="the safekeeper without an auth file to answer")
    assert "no reader may connect" in refused and "--pg-auth-file" in refused
    port, reader_port = free_port(), free_port()
    procs.start(sidecar_argv("safekeeper", "--id", "8", "--listen", f"127.0.0.1:{port}", "--data-dir",
                             str(created(test_dir / "sk8", 8)), "--pg-listen", f"127.0.0.1:{reader_port}", "--insecure"),
                name="sk8")
    trusted = f"host=127.0.0.1 port={reader_port} user=anyone sslmode=disable dbname=replication"
    row = wait_for(lambda: identify_dsn(trusted), timeout=30, ignore=(psycopg.OperationalError,),
                   what="the --insecure reader port to trust a reader")
    assert row[1] == 1 and row[2] == "0/0"


def refusal(dsn: str) -> str | None:
    try:
        psycopg.connect(dsn, replication="true").close()
    except psycopg.OperationalError as e:
        return str(e) if "Connection refused" not in str(e) else None
    return "connected"


def identify_dsn(dsn: str) -> tuple:
    with psycopg.connect(dsn, replication="true", autocommit=True) as r:
        return r.execute("IDENTIFY_SYSTEM").fetchone()


def test_readers_command_manages_the_auth_file(test_dir: Path) -> None:
    from support.helpers import walsidecar
    import subprocess
    import sys
    path = test_dir / "readers.auth"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WALSIDECAR_")}
    add = subprocess.run([sys.executable, "-m", "sidecar", "readers", "add", "alice", "--pg-auth-file", str(path)],
                         input="s3cret\n", capture_output=True, text=True, env=env, timeout=60)
    assert add.returncode == 0, add.stderr
    assert os.stat(path).st_mode & 0o777 == 0o600
    text = path.read_text()
    assert "alice:SCRAM-SHA-256$4096:" in text and "s3cret" not in text
    assert walsidecar("readers", "list", "--pg-auth-file", str(path)).stdout.split() == ["alice"]
    os.chmod(path, 0o644)
    out = walsidecar("readers", "list", "--pg-auth-file", str(path))
    assert out.returncode != 0 and "group or world access" in out.stderr and "Traceback" not in out.stderr
    os.chmod(path, 0o600)
    assert walsidecar("readers", "remove", "alice", "--pg-auth-file", str(path)).returncode == 0
    out = walsidecar("readers", "remove", "alice", "--pg-auth-file", str(path))
    assert out.returncode != 0 and "no reader 'alice'" in out.stderr


def test_a_missing_auth_file_or_a_taken_port_refuses_to_start(test_dir: Path, pki) -> None:  # noqa: ANN001
    from support.helpers import walsidecar
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        out = walsidecar("safekeeper", "--id", "1", "--listen", f"127.0.0.1:{free_port()}", "--data-dir",
                         str(test_dir / "sk"), "--pg-listen", f"127.0.0.1:{free_port()}", "--pg-auth-file",
                         str(test_dir / "missing.auth"), "--insecure")
        assert out.returncode != 0 and "cannot read the reader auth file" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        out = walsidecar("safekeeper", "--id", "1", "--listen", f"127.0.0.1:{free_port()}", "--data-dir",
                         str(test_dir / "sk"), "--pg-listen", f"127.0.0.1:{taken.getsockname()[1]}", "--insecure")
        assert out.returncode != 0 and "for the reader port (--pg-listen)" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    finally:
        taken.close()




# ---- (f) strangers before authentication, against a safekeeper process --------------------------------


@pytest.fixture
def lone_safekeeper(procs: ProcessTracker, test_dir: Path):  # noqa: ANN201
    """Start a safekeeper with a reader port (no proposer, no TLS; SCRAM for 'reader' / 'secret'); its reader port."""
    from sidecar import readerauth
    auth = test_dir / "readers.auth"
    readerauth.add(auth, "reader", "secret")

    def start(*options: str) -> int:
        port, reader_port = free_port(), free_port()
        procs.start(sidecar_argv("safekeeper", "--id", "7", "--listen", f"127.0.0.1:{port}", "--data-dir",
                                 str(created(test_dir / "sk7", 7)), "--pg-listen", f"127.0.0.1:{reader_port}",
                                 "--pg-auth-file", str(auth), "--insecure", *options), name="sk7")
        wait_for(lambda: identify_dsn(lone_dsn(reader_port)), timeout=30, ignore=(psycopg.OperationalError,),
                 what="the safekeeper's reader port to log a reader in")
        return reader_port
    return start


def lone_dsn(port: int) -> str:
    return f"host=127.0.0.1 port={port} user=reader password=secret sslmode=disable dbname=replication"


def stranger(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def test_a_stranger_gets_one_answer_per_negotiation_then_fatal(lone_safekeeper) -> None:  # noqa: ANN001
    port = lone_safekeeper()
    for code, answers in ((pgwire.SSL_REQUEST_CODE, b"N"), (pgwire.GSSENC_REQUEST_CODE, b"N")):
        with stranger(port) as s:
            s.sendall(struct.pack(">II", 8, code) * 1000)
            got = read_all(s)
            assert got[:got.index(b"E")] == answers, got[:40]
            sqlstate, message = fatal_of(got)
            assert sqlstate == "08P01" and message.startswith(f"unsupported frontend protocol 1234.{code & 0xFFFF}")
    with stranger(port) as s:  # over PostgreSQL's MAX_STARTUP_PACKET_LENGTH
        s.sendall(struct.pack(">II", pgwire.MAX_STARTUP_PACKET + 1, pgwire.PROTOCOL_3_0) + bytes(10_000))
        sqlstate, message = fatal_of(read_all(s))
        assert sqlstate == "08P01" and "invalid length of startup packet" in message
    assert identify_dsn(lone_dsn(port))[0]  # and the port serves readers on


def test_silent_connections_do_not_keep_a_reader_out_of_a_safekeeper(lone_safekeeper) -> None:  # noqa: ANN001
    port = lone_safekeeper()
    silent = [stranger(port) for _ in range(40)]  # more than the 32 reader connections
    try:
        # The 40th connection dropped the 32nd: every one before it was dropped for a newer one.
        sqlstate, message = fatal_of(read_all(silent[31]))
        assert sqlstate == "53300" and "authenticating" in message
        with psycopg.connect(lone_dsn(port), replication="true", autocommit=True) as r:
            assert r.execute("IDENTIFY_SYSTEM").fetchone()[1] == 1
    finally:
        for s in silent:
            s.close()


def test_a_silent_connection_is_closed_at_the_authentication_deadline(lone_safekeeper) -> None:  # noqa: ANN001
    port = lone_safekeeper("--pg-authentication-timeout", "1")
    with stranger(port) as s:
        s.sendall(struct.pack(">II", 8, pgwire.SSL_REQUEST_CODE))  # then nothing
        got = read_all(s)
        assert got[:1] == b"N"
        sqlstate, message = fatal_of(got)
        assert sqlstate == "08P01" and "canceling authentication due to timeout (1s)" in message

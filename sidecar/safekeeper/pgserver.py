"""The reader port: PostgreSQL's replication protocol for pg_receivewal, standbys and restore-wal.

One connection: SSLRequest (TLS with the node certificate under --certs-dir), the startup packet
(replication=true), SCRAM-SHA-256 against the --pg-auth-file verifiers (SCRAM-SHA-256-PLUS, bound to
the TLS channel, offered too over TLS), then replication commands
(sidecar/pgrepl.py) until the reader leaves. START_REPLICATION hands over to walsender.py. A
command that fails gets an ERROR and the connection stays usable; bytes that are not the protocol
get a FATAL and the connection is closed. Reading above the commit position (TERM t) is for the
proposer's recovery and `failover` alone: a connection with a proposer's client certificate.

Before a connection has authenticated, it is a stranger's: its work is bounded (one SSLRequest and
one GSSENCRequest, as PostgreSQL's ProcessStartupPacket allows, and the startup packet's size), the
whole phase has a deadline, and at most MAX_STARTUPS connections are in it at once; a new one
drops the oldest, so silent connections cannot keep a reader with a password out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from scramp import ScramException, ScramMechanism

from sidecar import pgrepl, pgwire, tls
from sidecar.certs import Identity
from sidecar.address import cannot_listen
from sidecar.consensus.reading import ReadRefused, ServerState, readable_end
from sidecar.logs import get_logger
from sidecar.lsn import format_lsn
from sidecar.readerauth import MECHANISM, MECHANISM_PLUS, AuthFile, AuthFileError, Verifier, mock_verifier
from sidecar.safekeeper.positions import PositionWatch
from sidecar.safekeeper.slots import Slot, SlotError, reserve_from
from sidecar.safekeeper.walsender import WAL_SENDER_TIMEOUT, ReaderSlots, StreamEnded, WalSender

# PostgreSQL's authentication_timeout, for the whole startup phase; shorter than its 60 s because
# the proposers' port gives a handshake 10 s too (tls.HANDSHAKE_TIMEOUT), and a slot held by a silent
# stranger is a slot a standby cannot have.
AUTHENTICATION_TIMEOUT = 10.0
MAX_READERS = 32  # connections at once, authenticated or not; more get "too many clients"
# Connections still authenticating at once. A reader's own startup takes milliseconds, so a few are
# plenty; beyond them one is dropped rather than the newcomer refused (the oldest of the address
# holding the most), so whoever holds connections open without logging in never fills the port,
# and one address flooding it mostly drops its own.
MAX_STARTUPS = 8
SERVER_VERSION = "15.0 (walsidecar safekeeper)"
_PARAMETERS = (("server_version", SERVER_VERSION), ("server_encoding", "UTF8"), ("client_encoding", "UTF8"),
               ("DateStyle", "ISO, MDY"), ("integer_datetimes", "on"), ("standard_conforming_strings", "on"),
               ("TimeZone", "UTC"), ("IntervalStyle", "postgres"), ("is_superuser", "off"),
               ("application_name", ""))


@dataclass(frozen=True)
class ReaderPort:
    """Where and how the reader port listens: no auth file refuses everyone unless `insecure` (trust)."""

    host: str
    port: int
    auth: AuthFile | None
    insecure: bool = False
    ssl_context: ssl.SSLContext | None = None
    # RFC 5929 tls-server-end-point of the node certificate (tls.server_end_point): SCRAM-SHA-256-PLUS is offered.
    server_end_point: bytes | None = None
    authentication_timeout: float = AUTHENTICATION_TIMEOUT  # seconds from connect to logged in
    wal_sender_timeout: float = WAL_SENDER_TIMEOUT  # a streaming reader that takes nothing, or is silent, this long
    certs_dir: Path | None = None  # where ssl_context and server_end_point came from (the reader process rebuilds them)

    def to_spec(self) -> dict[str, Any]:
        """What the reader process (readerprocess.py) builds the same options from."""
        if self.ssl_context is not None and self.certs_dir is None:
            raise ValueError("a reader port with TLS needs its certs_dir to be served from the reader process")
        return {"host": self.host, "port": self.port, "auth": str(self.auth.path) if self.auth is not None else None,
                "insecure": self.insecure, "certs_dir": str(self.certs_dir) if self.ssl_context is not None else None,
                "authentication_timeout": self.authentication_timeout,
                "wal_sender_timeout": self.wal_sender_timeout}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> ReaderPort:
        certs = Path(spec["certs_dir"]) if spec["certs_dir"] is not None else None
        return cls(spec["host"], spec["port"], AuthFile(Path(spec["auth"])) if spec["auth"] is not None else None,
                   spec["insecure"], tls.reader_port_context(certs) if certs is not None else None,
                   tls.server_end_point(certs) if certs is not None else None, spec["authentication_timeout"],
                   spec["wal_sender_timeout"], certs)


class Served(Protocol):
    """What the reader port needs of the safekeeper (readerprocess.RemoteSafekeeper, in the reader process)."""

    node_id: int
    positions: PositionWatch
    slots: ReaderSlots

    def reader_state(self) -> ServerState: ...

    async def current_state(self) -> ServerState:
        """The safekeeper's state now, for a command's answer (`reader_state()` may be a wait behind it)."""
        ...

    def read_wal(self, lsn: int, size: int) -> bytes: ...

    def cut_generation(self) -> int: ...

    async def reader_pin(self, lsn: int, holder: str) -> Any: ...

    @property
    def system_id(self) -> int: ...

    @property
    def wal_seg_size(self) -> int: ...


class Fatal(Exception):
    """End the connection with a FATAL ErrorResponse."""

    def __init__(self, message: str, sqlstate: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate, self.hint = sqlstate, hint


class CommandError(Exception):
    """The command fails with an ERROR; the connection stays usable."""

    def __init__(self, message: str, sqlstate: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate, self.hint = sqlstate, hint


def scram_client_first(scram: Any, client_first: str) -> None:
    """Give scramp's server libpq's client-first-message.

    libpq sends an empty SCRAM user name (`n=,`: the startup packet's user is the one that counts),
    which scramp refuses; it gets a placeholder, and the bare message the client signs is put back.
    """
    gs2, sep, bare = client_first.partition(",")
    gs2b, sep2, bare = bare.partition(",")
    if not (sep and sep2 and bare.startswith("n=,")):
        scram.set_client_first(client_first)
        return
    scram.set_client_first(f"{gs2},{gs2b},n=*,{bare[3:]}")
    scram.client_first_bare = bare


class ReaderServer:
    """The reader port of one safekeeper."""

    def __init__(self, sk: Served, options: ReaderPort, *, max_readers: int = MAX_READERS,
                 max_startups: int = MAX_STARTUPS, mock_secret: bytes | None = None,
                 sock: Any = None) -> None:
        self.sk = sk
        self.sock = sock  # a socket bound and listening already (the safekeeper's), or None to bind one
        self.on_count: Callable[[], None] = lambda: None  # connections or streams came or went
        self.options = options
        self.max_readers = max_readers
        self.max_startups = max_startups
        self.log = get_logger(node=sk.node_id, port="reader")
        self.connections: set[Connection] = set()
        self.starting: dict[Connection, None] = {}  # not authenticated yet, oldest first
        self._server: asyncio.Server | None = None
        self.port = options.port
        # Keys unknown users' salts (readerauth.mock_verifier); the safekeeper keeps one in its data directory.
        self.mock_secret = mock_secret if mock_secret is not None else secrets.token_bytes(32)

    async def start(self) -> None:
        """Bind the port; OSError saying which address and why when it cannot be."""
        o = self.options
        try:
            self._server = await (asyncio.start_server(self._connection, sock=self.sock) if self.sock is not None
                                  else asyncio.start_server(self._connection, o.host, o.port))
        except OSError as e:
            raise cannot_listen(o.host, o.port, "the reader port (--pg-listen)", e) from e
        self.port = self._server.sockets[0].getsockname()[1]
        auth = "scram-sha-256" if o.auth is not None else "trust (--insecure)" if o.insecure else "refuse-all"
        self.log.info("reader port listening", address=f"{o.host}:{self.port}", tls=o.ssl_context is not None,
                      auth=auth)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for c in list(self.connections):
                c.writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    @property
    def streaming(self) -> int:
        """Readers in START_REPLICATION now."""
        return sum(1 for c in self.connections if c.streaming)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(self, reader, writer)
        if len(self.starting) >= self.max_startups:
            starting = list(self.starting)
            victim = starting[to_drop([c.host for c in starting])]
            victim.log.warning("too many reader connections authenticating; dropping one", limit=self.max_startups)
            victim.drop(Fatal("too many connections are authenticating; this one was dropped",
                              pgwire.TOO_MANY_CONNECTIONS))
        if len(self.connections) >= self.max_readers:
            conn.log.warning("reader connection limit reached; refusing", limit=self.max_readers)
            await conn.fatal(Fatal("sorry, too many clients already", pgwire.TOO_MANY_CONNECTIONS))
            return
        self.connections.add(conn)
        self.starting[conn] = None
        self.on_count()
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)
            self.starting.pop(conn, None)
            self.on_count()


def to_drop(hosts: list[str]) -> int:
    """Which of the authenticating connections (their addresses, oldest first) goes: the oldest of the
    address that has the most of them."""
    counts = Counter(hosts)
    most = max(counts.values())
    return next(i for i, h in enumerate(hosts) if counts[h] == most)


def _peer(writer: asyncio.StreamWriter) -> tuple[str, str]:
    """(address, address:port) of the other end."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return str(peer[0]), "%s:%s" % peer[:2]
    return "unknown", "unknown"


class Connection:
    """One reader's connection, from the first byte to the close."""

    def __init__(self, server: ReaderServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server, self.sk = server, server.sk
        self.reader, self.writer = reader, writer
        self.host, peer = _peer(writer)
        self.log = server.log.bind(peer=peer)
        self.user = ""
        self.streaming = False
        self.temporary: list[Slot] = []
        self.identity: Identity | None = None  # the verified client certificate's role, if one was sent

    async def serve(self) -> None:
        deadline = self.server.options.authentication_timeout
        try:
            try:
                async with asyncio.timeout(deadline):
                    started = await self._startup()
            except TimeoutError:
                raise Fatal(f"canceling authentication due to timeout ({deadline:g}s)",
                            pgwire.PROTOCOL_VIOLATION) from None
            self.server.starting.pop(self, None)
            if started:
                await self._commands()
        except Fatal as e:
            self.log.warning("reader refused", reason=str(e), sqlstate=e.sqlstate, user=self.user or None)
            await self.fatal(e)
        except pgwire.ProtocolViolation as e:
            self.log.warning("reader broke the protocol; closing", reason=str(e), user=self.user or None)
            await self.fatal(Fatal(str(e), pgwire.PROTOCOL_VIOLATION))
        except StreamEnded as e:
            self.log.info("stream ended", reason=str(e), user=self.user)
            await self.fatal(Fatal(str(e), pgwire.PROTOCOL_VIOLATION))
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError) as e:
            self.log.info("reader connection closed", user=self.user or None,
                          reason=type(e).__name__ if not isinstance(e, asyncio.IncompleteReadError) else "eof")
        except Exception as e:  # a bug or a storage failure: this reader only
            self.log.error("reader connection failed", error=f"{type(e).__name__}: {e}", user=self.user or None)
            await self.fatal(Fatal(f"internal error: {e}", pgwire.INTERNAL_ERROR))
        finally:
            for slot in self.temporary:
                self.sk.slots.release(slot)
            self.writer.close()

    async def fatal(self, e: Fatal) -> None:
        with contextlib.suppress(Exception):
            self.writer.write(pgwire.error_response(e.sqlstate, str(e), severity="FATAL", hint=e.hint))
            await asyncio.wait_for(self.writer.drain(), 5)
        self.writer.close()

    def drop(self, e: Fatal) -> None:
        """End a connection from outside its task: the FATAL goes out, and its next read sees the close."""
        self.server.starting.pop(self, None)
        self.server.connections.discard(self)  # its slot is free now, not when its task sees the close
        with contextlib.suppress(Exception):
            self.writer.write(pgwire.error_response(e.sqlstate, str(e), severity="FATAL", hint=e.hint))
        self.writer.close()

    # ---- startup ----------------------------------------------------------------------------

    async def _startup(self) -> bool:
        """SSL negotiation, the startup packet and authentication; False for a CancelRequest."""
        o = self.server.options
        # As ProcessStartupPacket: one SSLRequest and one GSSENCRequest, GSS only while SSL is not on;
        # a repeat is not a negotiation but an unknown protocol. So a stranger gets at most two
        # answers, not one per 8 bytes it sends.
        encrypted = ssl_done = gss_done = False
        while True:
            body = await self.reader.readexactly(pgwire.startup_length(await self.reader.readexactly(4)))
            packet = pgwire.parse_startup(body)
            if isinstance(packet, pgwire.SslRequest) and not ssl_done:
                ssl_done = True
                if o.ssl_context is None:
                    await self._answer(pgwire.SSL_REFUSE)
                    continue
                if self.reader._buffer:  # noqa: SLF001 - plaintext after the request: an injection attempt
                    raise pgwire.ProtocolViolation("received unencrypted data after SSL request")
                # No yield between the answer and start_tls: the loop would read the ClientHello
                # into the plaintext reader, and the handshake would wait for it forever.
                self.writer.write(pgwire.SSL_ACCEPT)
                await self.writer.drain()
                await self.writer.start_tls(o.ssl_context, ssl_handshake_timeout=tls.HANDSHAKE_TIMEOUT)
                encrypted = gss_done = True
                self.identity = tls.peer_role(self.writer)
                continue
            if isinstance(packet, pgwire.GssEncRequest) and not gss_done:
                gss_done = True
                await self._answer(pgwire.SSL_REFUSE)
                continue
            if isinstance(packet, pgwire.CancelRequest):
                return False  # nothing runs that a cancel could stop; PostgreSQL closes without a word
            if isinstance(packet, pgwire.SslRequest):
                raise pgwire.ProtocolViolation(pgwire.unsupported_protocol(pgwire.SSL_REQUEST_CODE))
            if isinstance(packet, pgwire.GssEncRequest):
                raise pgwire.ProtocolViolation(pgwire.unsupported_protocol(pgwire.GSSENC_REQUEST_CODE))
            break
        params = packet.params
        self.user = params["user"]
        if o.ssl_context is not None and not encrypted:
            # As a hostssl line: with certificates, WAL and SCRAM exchanges never travel in clear.
            raise Fatal(f'this reader port accepts only TLS connections (user "{self.user}")',
                        pgwire.INVALID_AUTHORIZATION, hint="connect with sslmode=verify-full sslrootcert=ca.crt")
        self.log = self.log.bind(user=self.user, application_name=params.get("application_name", ""))
        if not (pgwire.is_replication(params) or (params.get("database") == "replication"
                                                  and "replication" not in params)):
            what = "logical replication" if pgwire.is_logical_replication(params) else "a connection without " \
                "replication=true"
            raise Fatal(f"{what} is not served here: a safekeeper serves physical replication only",
                        pgwire.FEATURE_NOT_SUPPORTED if "replication" in params else pgwire.INVALID_AUTHORIZATION,
                        hint="connect with replication=true (pg_receivewal, a standby's primary_conninfo)")
        await self._authenticate(encrypted)
        self.writer.write(pgwire.auth_ok() + b"".join(
            pgwire.parameter_status(k, params.get("application_name", "") if k == "application_name" else v)
            for k, v in _PARAMETERS) + pgwire.backend_key_data(os.getpid(), secrets.randbits(32))
            + pgwire.ready_for_query())
        await self.writer.drain()
        self.log.info("reader connected", tls=encrypted, cert_role=self.identity.role if self.identity else None)
        return True

    async def _answer(self, data: bytes) -> None:
        """A refused negotiation's answer, then back to the loop: a stranger's bytes never run in one go."""
        self.writer.write(data)
        await self.writer.drain()
        await asyncio.sleep(0)  # drain() returns at once below its high-water mark

    async def _authenticate(self, encrypted: bool) -> None:
        o = self.server.options
        if o.auth is None:
            if o.insecure:
                return  # trust
            raise Fatal(f'no reader may connect: this safekeeper has no --pg-auth-file (user "{self.user}")',
                        pgwire.INVALID_AUTHORIZATION,
                        hint="start the safekeeper with --pg-auth-file made by `walsidecar readers add`")
        try:
            o.auth.reload()
        except AuthFileError as e:
            self.log.error("reader auth file unusable; refusing readers", error=str(e))
            raise Fatal("reader authentication is unavailable on this safekeeper (see its log)",
                        pgwire.INVALID_AUTHORIZATION) from None
        found = o.auth.lookup(self.user)
        verifier: Verifier = found or mock_verifier(self.user, self.server.mock_secret, *o.auth.usual_shape())
        known = found is not None
        # As PostgreSQL over SSL: the channel-bound mechanism first, the plain one for clients without it.
        plus = o.server_end_point if encrypted else None
        self.writer.write(pgwire.auth_sasl([MECHANISM_PLUS, MECHANISM] if plus else [MECHANISM]))
        await self.writer.drain()
        failed = Fatal(f'password authentication failed for user "{self.user}"', pgwire.INVALID_PASSWORD)
        mechanism, first = pgwire.parse_sasl_initial(await self._password_packet())
        if mechanism not in ((MECHANISM_PLUS, MECHANISM) if plus else (MECHANISM,)):
            raise Fatal(f"client selected an invalid SASL authentication mechanism {mechanism!r}",
                        pgwire.PROTOCOL_VIOLATION)
        if plus and mechanism == MECHANISM and first.startswith(b"y"):
            # The client can bind and believes the server cannot: someone removed PLUS from the offer.
            raise Fatal("SCRAM channel binding negotiation error: the client supports it, and it was offered",
                        pgwire.PROTOCOL_VIOLATION)
        binding = ("tls-server-end-point", plus) if mechanism == MECHANISM_PLUS else None
        scram = ScramMechanism(mechanism).make_server(lambda _name: verifier.auth_info(), channel_binding=binding)
        try:
            scram_client_first(scram, first.decode())
            self.writer.write(pgwire.auth_sasl_continue(scram.get_server_first().encode()))
            await self.writer.drain()
            scram.set_client_final((await self._password_packet()).decode())
            if not known:
                raise failed
            self.writer.write(pgwire.auth_sasl_final(scram.get_server_final().encode()))
        except (ScramException, UnicodeDecodeError) as e:
            self.log.warning("reader authentication failed", reason=str(e) if known else "unknown user",
                             mechanism=mechanism)
            raise failed from None

    async def _password_packet(self) -> bytes:
        msg = await self._message()
        if not isinstance(msg, pgwire.PasswordPacket):
            raise pgwire.ProtocolViolation(f"expected SASL response, got {type(msg).__name__}")
        return msg.body

    async def _message(self) -> pgwire.FrontendMessage:
        kind, n = pgwire.message_length(await self.reader.readexactly(5))
        return pgwire.parse_message(kind, await self.reader.readexactly(n))

    # ---- commands ---------------------------------------------------------------------------

    async def _commands(self) -> None:
        while True:
            msg = await self._message()
            if isinstance(msg, pgwire.Terminate):
                self.log.info("reader disconnected")
                return
            if isinstance(msg, (pgwire.CopyData, pgwire.CopyDone, pgwire.CopyFail)):
                continue  # after a stream that ended with an error: ignored, as the protocol says
            if isinstance(msg, pgwire.Unexpected):
                raise Fatal(f"extended query protocol not supported in a replication connection ({msg.kind})",
                            pgwire.PROTOCOL_VIOLATION)
            if not isinstance(msg, pgwire.Query):
                raise pgwire.ProtocolViolation(f"unexpected {type(msg).__name__} message")
            try:
                await self._query(msg.text)
            except (CommandError, ReadRefused, SlotError) as e:
                self.log.info("command refused", command=msg.text[:200], reason=str(e), sqlstate=e.sqlstate)
                self.writer.write(pgwire.error_response(e.sqlstate, str(e), hint=getattr(e, "hint", None)))
            self.writer.write(pgwire.ready_for_query())
            await self.writer.drain()

    async def _query(self, text: str) -> None:
        if not text.strip().rstrip(";").strip():
            self.writer.write(pgwire.empty_query_response())
            return
        try:
            cmd = pgrepl.parse_command(text)
        except pgrepl.ReplicationProtocolError as e:
            raise CommandError(str(e), pgwire.SYNTAX_ERROR) from None
        self.log.info("command", command=text[:200])
        match cmd:
            case pgrepl.IdentifySystem():
                await self._identify_system()
            case pgrepl.Show():
                self._show(cmd.name)
            case pgrepl.TimelineHistoryCommand():
                await self._timeline_history(cmd.timeline)
            case pgrepl.ReadReplicationSlot():
                await self._read_slot(cmd.slot)
            case pgrepl.CreateReplicationSlot():
                await self._create_slot(cmd)
            case pgrepl.DropReplicationSlot():
                await self.sk.slots.drop(cmd.slot, owner=self)
                self.writer.write(pgwire.command_complete("DROP_REPLICATION_SLOT"))
            case pgrepl.StartReplication():
                await self._start_replication(cmd)
            case pgrepl.Unsupported(what="BASE_BACKUP"):
                raise CommandError("BASE_BACKUP is not served by a safekeeper", pgwire.FEATURE_NOT_SUPPORTED,
                                   hint="take base backups from the primary (pg_basebackup -d its address)")
            case pgrepl.Unsupported(what="SQL"):
                raise CommandError("cannot execute SQL commands on a safekeeper's reader port",
                                   pgwire.FEATURE_NOT_SUPPORTED,
                                   hint="it serves IDENTIFY_SYSTEM, TIMELINE_HISTORY, replication slots and "
                                        "START_REPLICATION ... PHYSICAL")
            case pgrepl.Unsupported():
                raise CommandError(f"{cmd.what} is not served by a safekeeper", pgwire.FEATURE_NOT_SUPPORTED)

    async def _identify_system(self) -> None:
        s = await self.sk.current_state()
        self.writer.write(pgwire.result(
            [("systemid", pgwire.TEXT_OID), ("timeline", pgwire.INT4_OID), ("xlogpos", pgwire.TEXT_OID),
             ("dbname", pgwire.TEXT_OID)],
            [(str(self.sk.system_id), str(s.timeline or 1), format_lsn(readable_end(s)), None)], "IDENTIFY_SYSTEM"))

    def _show(self, name: str) -> None:
        if name == "wal_segment_size":
            size = self.sk.wal_seg_size
            if not size:
                raise CommandError("this safekeeper holds no WAL yet: its segment size is not known",
                                   "55000")
            value = f"{size >> 20}MB" if size % (1 << 20) == 0 else f"{size >> 10}kB"
        elif name == "data_directory_mode":
            value = "0700"
        else:
            raise CommandError(f'unrecognized configuration parameter "{name}"', pgwire.UNDEFINED_OBJECT)
        self.writer.write(pgwire.result([(name, pgwire.TEXT_OID)], [(value,)], "SHOW"))

    async def _timeline_history(self, tli: int) -> None:
        s = await self.sk.current_state()
        name = pgrepl.history_file_name(tli)
        if tli == 1 or not pgrepl.on_lineage(s.history, s.timeline, tli):
            raise CommandError(f'could not open file "pg_wal/{name}": No such file or directory', "58P01")
        content = pgrepl.format_timeline_history(pgrepl.history_up_to(s.history, tli))
        # walsender.c sends both columns as text (raw bytes, no conversion).
        self.writer.write(pgwire.result([("filename", pgwire.TEXT_OID), ("content", pgwire.TEXT_OID)],
                                        [(name, content)], "TIMELINE_HISTORY"))

    async def _read_slot(self, name: str) -> None:
        slot = await self.sk.slots.lookup(name)
        row: tuple[str | None, ...] = (None, None, None)
        if slot is not None:  # an invalidated slot has no restart_lsn, as in PostgreSQL
            row = ("physical", format_lsn(slot.holds) if slot.holds else None,
                   str(slot.timeline) if slot.holds else None)
        self.writer.write(pgwire.result([("slot_type", pgwire.TEXT_OID), ("restart_lsn", pgwire.TEXT_OID),
                                         ("restart_tli", pgwire.INT8_OID)], [row], "READ_REPLICATION_SLOT"))

    async def _create_slot(self, cmd: pgrepl.CreateReplicationSlot) -> None:
        lsn, timeline = reserve_from(await self.sk.current_state()) if cmd.reserve_wal else (0, 0)
        slot = await self.sk.slots.create(cmd.slot, cmd.temporary, lsn, timeline, reader=self.user, owner=self)
        if cmd.temporary:
            self.temporary.append(slot)
        self.log.info("slot created", slot=cmd.slot, temporary=cmd.temporary, reader=self.user,
                      restart_lsn=format_lsn(lsn) if lsn else None)
        self.writer.write(pgwire.result(
            [("slot_name", pgwire.TEXT_OID), ("consistent_point", pgwire.TEXT_OID), ("snapshot_name", pgwire.TEXT_OID),
             ("output_plugin", pgwire.TEXT_OID)], [(cmd.slot, format_lsn(lsn), None, None)],
            "CREATE_REPLICATION_SLOT"))

    def _may_read_above_commit(self) -> bool:
        """TERM t: the proposer's certificate; or a port without TLS (--insecure), where anyone may act as the
        proposer on the consensus port too, so that the check would protect nothing."""
        o = self.server.options
        if o.ssl_context is None:
            return o.insecure
        return self.identity is not None and self.identity.role == "proposer"

    async def _start_replication(self, cmd: pgrepl.StartReplication) -> None:
        if cmd.term and not self._may_read_above_commit():
            # Refused before the term is compared, so that guessing learns nothing about it.
            raise CommandError("START_REPLICATION ... TERM (reading above the commit position) is for the "
                               "proposer only", "42501",
                               hint="connect over TLS with a proposer certificate (sslcert, sslkey), as "
                                    "`walsidecar start` and `failover` do with their --certs-dir")
        slot = await self.sk.slots.acquire(cmd.slot, owner=self) if cmd.slot else None
        sender = WalSender(self.sk, self.writer, self._message, cmd, slot, self.sk.slots,
                           self.log.bind(command="START_REPLICATION"), self.server.options.wal_sender_timeout)
        self.streaming = True
        self.server.on_count()
        try:
            await sender.run()
        finally:
            self.streaming = False
            self.server.on_count()
            if slot is not None:
                self.sk.slots.stream_ended(slot)
            self.log.info("stream finished", sent_bytes=sender.sent_bytes,
                          slot_lsn=format_lsn(slot.restart_lsn) if slot is not None and slot.restart_lsn else None)

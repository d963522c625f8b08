"""PostgreSQL's streaming replication protocol, sans IO: the CopyData messages, the commands, .history files.

Both ends use it: the proposer's client of the primary (`proposer/replication.py`), the safekeeper's
WAL server (`safekeeper/walsender.py`) and the clients of safekeepers (`restore-wal`, `failover`).
Layout as in PostgreSQL's "Streaming Replication Protocol" page and walsender.c.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from sidecar.timelines import TimelineEntry, TimelineHistory
from sidecar.lsn import format_lsn, parse_lsn

_W_HDR = struct.Struct(">cQQQ")  # b'w', walStart, serverWalEnd, sendTime
_K_MSG = struct.Struct(">cQQB")  # b'k', serverWalEnd, sendTime, replyRequested
_R_MSG = struct.Struct(">cQQQQB")  # b'r', write, flush, apply, clientTime, replyRequested
_H_MSG = struct.Struct(">cQIIII")  # b'h', clientTime, xmin, xmin epoch, catalog xmin, its epoch
XLOGDATA_HEADER = _W_HDR.size
PG_EPOCH_US = 946_684_800 * 1_000_000  # 2000-01-01 in Unix microseconds
# walsender.c's MAX_SEND_SIZE: WAL bytes in one XLogData message.
MAX_SEND_SIZE = 16 * 8192
MAX_TIMELINE = 0xFFFFFFFF


class ReplicationProtocolError(ValueError):
    """A replication message or command that does not parse."""


def pg_time(unix_ns: int) -> int:
    """The protocol's timestamp (microseconds since 2000-01-01 UTC) for a Unix time in nanoseconds."""
    return unix_ns // 1000 - PG_EPOCH_US


# ---- CopyData messages ---------------------------------------------------------------------


@dataclass(frozen=True)
class XLogData:
    start: int
    wal_end: int
    send_time: int
    data: memoryview


@dataclass(frozen=True)
class Keepalive:
    wal_end: int
    send_time: int
    reply_requested: bool


@dataclass(frozen=True)
class StandbyStatus:
    write: int
    flush: int
    apply: int
    client_time: int
    reply_requested: bool


@dataclass(frozen=True)
class HotStandbyFeedback:
    client_time: int
    xmin: int
    xmin_epoch: int
    catalog_xmin: int
    catalog_xmin_epoch: int


CopyMessage = XLogData | Keepalive | StandbyStatus | HotStandbyFeedback


def xlogdata_header(start: int, wal_end: int, send_time: int) -> bytes:
    """The 25 bytes before the WAL in an XLogData message (the caller appends the WAL)."""
    return _W_HDR.pack(b"w", start, wal_end, send_time)


def encode_keepalive(wal_end: int, send_time: int, reply_requested: bool = False) -> bytes:
    return _K_MSG.pack(b"k", wal_end, send_time, 1 if reply_requested else 0)


def encode_status(write: int, flush: int, apply: int, client_time: int, reply_requested: bool = False) -> bytes:
    return _R_MSG.pack(b"r", write, flush, apply, client_time, 1 if reply_requested else 0)


def encode_feedback(client_time: int, xmin: int = 0, xmin_epoch: int = 0,
                    catalog_xmin: int = 0, catalog_xmin_epoch: int = 0) -> bytes:
    return _H_MSG.pack(b"h", client_time, xmin, xmin_epoch, catalog_xmin, catalog_xmin_epoch)


def parse_copy_data(payload: bytes | bytearray | memoryview) -> CopyMessage:
    """Decode one CopyData payload of a physical replication stream, in either direction."""
    view = memoryview(payload)
    kind = bytes(view[:1])
    try:
        if kind == b"w":
            _, start, end, t = _W_HDR.unpack_from(view)
            return XLogData(start, end, t, view[XLOGDATA_HEADER:])
        if kind == b"k":
            _, end, t, reply = _K_MSG.unpack_from(view)
            _exact(view, _K_MSG, "keepalive")
            return Keepalive(end, t, reply != 0)
        if kind == b"r":
            _, w, f, a, t, reply = _R_MSG.unpack_from(view)
            _exact(view, _R_MSG, "standby status")
            return StandbyStatus(w, f, a, t, reply != 0)
        if kind == b"h":
            _, t, xmin, xe, cxmin, cxe = _H_MSG.unpack_from(view)
            _exact(view, _H_MSG, "hot standby feedback")
            return HotStandbyFeedback(t, xmin, xe, cxmin, cxe)
    except struct.error:
        raise ReplicationProtocolError(f"{_NAMES[kind]} message of {len(view)} bytes is too short") from None
    raise ReplicationProtocolError(f"unexpected replication message type {kind!r}")


_NAMES = {b"w": "XLogData", b"k": "keepalive", b"r": "standby status", b"h": "hot standby feedback"}


def _exact(view: memoryview, layout: struct.Struct, what: str) -> None:
    if len(view) != layout.size:
        raise ReplicationProtocolError(f"{what} message of {len(view)} bytes; expected {layout.size}")


# ---- timeline history files -----------------------------------------------------------------


def history_file_name(timeline: int) -> str:
    """PostgreSQL's name for the history file that leads to `timeline`: `00000002.history`."""
    return f"{timeline:08X}.history"


def parse_timeline_history(content: str) -> TimelineHistory:
    """Parse a .history file: lines `parent_tli<TAB>X/Y<TAB>reason`, '#' comments allowed."""
    entries: list[TimelineEntry] = []
    for lineno, line in enumerate(content.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(None, 2)
        try:
            tli = int(fields[0])
            switch = parse_lsn(fields[1])
        except (IndexError, ValueError):
            raise ReplicationProtocolError(f"timeline history line {lineno} is malformed: {line!r}") from None
        if not 1 <= tli <= MAX_TIMELINE:
            raise ReplicationProtocolError(f"timeline history line {lineno} names timeline {tli}")
        if entries and (tli <= entries[-1].timeline or switch < entries[-1].switch_lsn):
            raise ReplicationProtocolError(f"timeline history line {lineno} is out of order: {line!r}")
        entries.append(TimelineEntry(timeline=tli, switch_lsn=switch))
    return tuple(entries)


def format_timeline_history(history: TimelineHistory) -> str:
    """The .history file for the timeline after `history`'s last entry, as PostgreSQL writes it."""
    return "".join(f"{e.timeline}\t{format_lsn(e.switch_lsn)}\tno recovery target specified\n" for e in history)


def history_up_to(history: TimelineHistory, timeline: int) -> TimelineHistory:
    """The entries that lead to `timeline` (the content of its .history file)."""
    return tuple(e for e in history if e.timeline < timeline)


def timeline_end(history: TimelineHistory, current: int, timeline: int) -> TimelineEntry | None:
    """(the timeline that follows `timeline`, the LSN where it begins), or None for the current one.

    `timeline` holds the WAL below the switch LSN.
    """
    for i, e in enumerate(history):
        if e.timeline == timeline:
            following = history[i + 1].timeline if i + 1 < len(history) else current
            return TimelineEntry(following, e.switch_lsn)
    return None


def timeline_of(history: TimelineHistory, current: int, lsn: int) -> int:
    """The timeline that holds the WAL at `lsn` (tliOfPointInHistory): a switch point belongs to the new one."""
    for e in history:
        if lsn < e.switch_lsn:
            return e.timeline
    return current


def segment_timeline(history: TimelineHistory, current: int, segno: int, seg_size: int) -> int:
    """The timeline in whose file segment `segno` is read: the newest one begun by the segment's end, as
    PostgreSQL's recovery picks it (XLogFileReadAnyTLI). The file of a segment holding a switch point is the
    new timeline's; it holds the old timeline's WAL before the switch too."""
    return timeline_of(history, current, (segno + 1) * seg_size - 1)


def on_lineage(history: TimelineHistory, current: int, timeline: int) -> bool:
    """True if `timeline` is the current one or one it descends from."""
    return timeline == current or any(e.timeline == timeline for e in history)


# ---- commands --------------------------------------------------------------------------------


@dataclass(frozen=True)
class IdentifySystem:
    pass


@dataclass(frozen=True)
class Show:
    name: str


@dataclass(frozen=True)
class TimelineHistoryCommand:
    timeline: int


@dataclass(frozen=True)
class ReadReplicationSlot:
    slot: str


@dataclass(frozen=True)
class StartReplication:
    """`term` is walsidecar's own extension: a reader naming the current term may read up to the flush."""

    slot: str | None
    lsn: int
    timeline: int  # 0: the server's current timeline
    term: int = 0


@dataclass(frozen=True)
class CreateReplicationSlot:
    slot: str
    temporary: bool
    reserve_wal: bool


@dataclass(frozen=True)
class DropReplicationSlot:
    slot: str
    wait: bool


@dataclass(frozen=True)
class Unsupported:
    """A command this WAL server does not serve; `what` names it for the error message."""

    what: str


Command = (IdentifySystem | Show | TimelineHistoryCommand | ReadReplicationSlot | StartReplication
           | CreateReplicationSlot | DropReplicationSlot | Unsupported)

_TOKEN = re.compile(r'\s*(?:"((?:[^"]|"")*)"|(\()|(\))|(,)|([^\s(),"]+))')
MAX_COMMAND = 4096
_SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")


def _tokens(text: str) -> list[tuple[str, bool]]:
    """(token, quoted) pairs; quoted identifiers keep their case, others are as written."""
    out: list[tuple[str, bool]] = []
    pos = 0
    text = text.strip().rstrip(";").strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ReplicationProtocolError(f"syntax error at or near {text[pos:pos + 20]!r}")
        quoted, lp, rp, comma, word = m.groups()
        if quoted is not None:
            out.append((quoted.replace('""', '"'), True))
        else:
            out.append((lp or rp or comma or word, False))
        pos = m.end()
    return out


def check_slot_name(name: str) -> str:
    """PostgreSQL's rule for slot names: lower-case letters, digits and underscores, at most 63."""
    if not _SLOT_NAME.fullmatch(name):
        raise ReplicationProtocolError(
            f"invalid replication slot name {name!r}: use lower-case letters, digits and underscores (at most 63)")
    return name


def parse_command(text: str) -> Command:
    """Parse one replication command sent as a simple Query."""
    if len(text) > MAX_COMMAND:
        raise ReplicationProtocolError(f"command of {len(text)} characters is too long")
    toks = _tokens(text)
    if not toks:
        raise ReplicationProtocolError("empty command")
    words = [t.upper() if not q else t for t, q in toks]
    head = words[0]
    p = _Parser(toks, words)
    if head == "IDENTIFY_SYSTEM":
        p.pos = 1
        p.end()
        return IdentifySystem()
    if head == "SHOW":
        p.pos = 1
        name = p.name().lower()
        p.end()
        return Show(name)
    if head == "TIMELINE_HISTORY":
        p.pos = 1
        tli = p.integer("timeline")
        p.end()
        if not 1 <= tli <= MAX_TIMELINE:
            raise ReplicationProtocolError(f"invalid timeline {tli}")
        return TimelineHistoryCommand(tli)
    if head == "READ_REPLICATION_SLOT":
        p.pos = 1
        slot = p.name()
        p.end()
        return ReadReplicationSlot(slot)
    if head == "START_REPLICATION":
        return _start_replication(p)
    if head == "CREATE_REPLICATION_SLOT":
        return _create_slot(p)
    if head == "DROP_REPLICATION_SLOT":
        p.pos = 1
        slot = p.name()
        wait = p.accept("WAIT")
        p.end()
        return DropReplicationSlot(slot, wait)
    if head in ("BASE_BACKUP", "ALTER_REPLICATION_SLOT", "UPLOAD_MANIFEST"):
        return Unsupported(head)
    return Unsupported("SQL" if head not in _REPLICATION_WORDS else head)


_REPLICATION_WORDS = {"START_REPLICATION", "CREATE_REPLICATION_SLOT", "DROP_REPLICATION_SLOT"}


class _Parser:
    def __init__(self, toks: list[tuple[str, bool]], words: list[str]) -> None:
        self.toks, self.words, self.pos = toks, words, 0

    def peek(self) -> str | None:
        return self.words[self.pos] if self.pos < len(self.words) else None

    def accept(self, word: str) -> bool:
        if self.peek() == word and not self.toks[self.pos][1]:
            self.pos += 1
            return True
        return False

    def name(self) -> str:
        if self.pos >= len(self.toks):
            raise ReplicationProtocolError("syntax error at end of input")
        tok, quoted = self.toks[self.pos]
        self.pos += 1
        return tok if quoted else tok.lower()

    def integer(self, what: str) -> int:
        tok = self.name()
        # ASCII only, as PostgreSQL's grammar: str.isdigit() takes '²' (int() refuses it) and '٣'.
        if not (tok.isascii() and tok.isdigit()) or len(tok) > 10:
            raise ReplicationProtocolError(f"invalid {what} {tok!r}")
        return int(tok)

    def lsn(self) -> int:
        tok = self.name()
        try:
            return parse_lsn(tok)
        except ValueError:
            raise ReplicationProtocolError(f"invalid WAL position {tok!r}: expected X/Y in hexadecimal") from None

    def end(self) -> None:
        if self.pos != len(self.toks):
            raise ReplicationProtocolError(f"syntax error at or near {self.toks[self.pos][0]!r}")


def _start_replication(p: _Parser) -> Command:
    p.pos = 1
    slot = None
    if p.accept("SLOT"):
        slot = p.name()
    if p.accept("LOGICAL"):
        return Unsupported("logical replication")
    p.accept("PHYSICAL")
    lsn = p.lsn()
    timeline = term = 0
    if p.accept("TIMELINE"):
        timeline = p.integer("timeline")
        if not 1 <= timeline <= MAX_TIMELINE:
            raise ReplicationProtocolError(f"invalid timeline {timeline}")
    if p.accept("TERM"):
        term = p.integer("term")
    p.end()
    return StartReplication(slot, lsn, timeline, term)


def _create_slot(p: _Parser) -> Command:
    p.pos = 1
    slot = p.name()
    temporary = p.accept("TEMPORARY")
    if p.accept("LOGICAL"):
        return Unsupported("logical replication")
    if not p.accept("PHYSICAL"):
        raise ReplicationProtocolError("CREATE_REPLICATION_SLOT: only PHYSICAL slots are served here")
    reserve = False
    if p.accept("RESERVE_WAL"):
        reserve = True
    elif p.accept("("):
        # The new-style option list: RESERVE_WAL [true|false], comma separated.
        while not p.accept(")"):
            opt = p.name().upper()
            value = True
            if p.peek() not in (",", ")", None):
                value = p.name().lower() in ("true", "on", "1")
            if opt != "RESERVE_WAL":
                raise ReplicationProtocolError(f"unrecognized option {opt!r} for a physical slot")
            reserve = value
            p.accept(",")
            if p.peek() is None:
                raise ReplicationProtocolError("syntax error at end of input")
    p.end()
    return CreateReplicationSlot(slot, temporary, reserve)


def format_start_replication(lsn: int, timeline: int = 0, slot: str | None = None, term: int = 0) -> str:
    """The START_REPLICATION command for a physical stream from `lsn`."""
    parts = ["START_REPLICATION"]
    if slot:
        parts.append(f'SLOT "{check_slot_name(slot)}"')
    parts.append(f"PHYSICAL {format_lsn(lsn)}")
    if timeline:
        parts.append(f"TIMELINE {timeline}")
    if term:
        parts.append(f"TERM {term}")
    return " ".join(parts)

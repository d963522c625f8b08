"""The replication protocol's messages, commands and .history files (sidecar/pgrepl.py)."""

from __future__ import annotations

import pytest

from sidecar import pgrepl
from sidecar.timelines import TimelineEntry
from sidecar.pgrepl import ReplicationProtocolError


def test_copy_data_round_trips() -> None:
    w = pgrepl.xlogdata_header(0x1000000, 0x1000010, 5) + b"0123456789abcdef"
    msg = pgrepl.parse_copy_data(w)
    assert isinstance(msg, pgrepl.XLogData)
    assert (msg.start, msg.wal_end, msg.send_time, bytes(msg.data)) == (0x1000000, 0x1000010, 5, b"0123456789abcdef")
    assert pgrepl.parse_copy_data(pgrepl.encode_keepalive(7, 8, True)) == pgrepl.Keepalive(7, 8, True)
    assert pgrepl.parse_copy_data(pgrepl.encode_status(1, 2, 3, 4)) == pgrepl.StandbyStatus(1, 2, 3, 4, False)
    assert pgrepl.parse_copy_data(pgrepl.encode_feedback(9, 10)) == pgrepl.HotStandbyFeedback(9, 10, 0, 0, 0)
    assert len(pgrepl.xlogdata_header(0, 0, 0)) == pgrepl.XLOGDATA_HEADER == 25


@pytest.mark.parametrize("payload, match", [
    (b"w" + bytes(20), "XLogData message of 21 bytes is too short"),
    (b"k" + bytes(5), "keepalive message of 6 bytes"),
    (b"k" + bytes(18), "keepalive message of 19 bytes"),
    (b"r" + bytes(40), "standby status message of 41 bytes"),
    (b"?", "unexpected replication message type"),
    (b"", "unexpected replication message type"),
])
def test_malformed_copy_data(payload: bytes, match: str) -> None:
    with pytest.raises(ReplicationProtocolError, match=match):
        pgrepl.parse_copy_data(payload)


def test_pg_time() -> None:
    assert pgrepl.pg_time(946_684_800 * 10**9) == 0
    assert pgrepl.pg_time(946_684_801 * 10**9) == 1_000_000


HISTORY = (TimelineEntry(1, 0x3000158), TimelineEntry(2, 0x1000000A0))


def test_history_files() -> None:
    text = pgrepl.format_timeline_history(HISTORY)
    assert text == "1\t0/3000158\tno recovery target specified\n2\t1/A0\tno recovery target specified\n"
    assert pgrepl.parse_timeline_history(text) == HISTORY
    assert pgrepl.parse_timeline_history("# comment\n\n1\t0/3000158\treason with spaces\n") == HISTORY[:1]
    assert pgrepl.history_file_name(2) == "00000002.history"
    assert pgrepl.history_file_name(0x1A) == "0000001A.history"
    assert pgrepl.history_up_to(HISTORY, 2) == HISTORY[:1]
    assert pgrepl.history_up_to(HISTORY, 3) == HISTORY


@pytest.mark.parametrize("text", ["1\tnot-an-lsn\tx\n", "2\t0/2000000\tx\n1\t0/3000000\ty\n", "0\t0/1\tx\n", "x\n"])
def test_bad_history_files(text: str) -> None:
    with pytest.raises(ReplicationProtocolError):
        pgrepl.parse_timeline_history(text)


def test_timelines() -> None:
    assert pgrepl.timeline_end(HISTORY, 3, 1) == TimelineEntry(2, 0x3000158)
    assert pgrepl.timeline_end(HISTORY, 3, 2) == TimelineEntry(3, 0x1000000A0)
    assert pgrepl.timeline_end(HISTORY, 3, 3) is None
    assert pgrepl.timeline_of(HISTORY, 3, 0x3000157) == 1
    assert pgrepl.timeline_of(HISTORY, 3, 0x3000158) == 2
    assert pgrepl.timeline_of(HISTORY, 3, 0x1000000A0) == 3
    # A segment holding a switch is read from the new timeline's file (XLogFileReadAnyTLI).
    assert pgrepl.segment_timeline(HISTORY, 3, 2, 0x1000000) == 1
    assert pgrepl.segment_timeline(HISTORY, 3, 3, 0x1000000) == 2
    assert pgrepl.segment_timeline(HISTORY, 3, 0x100, 0x1000000) == 3
    assert pgrepl.on_lineage(HISTORY, 3, 1) and pgrepl.on_lineage(HISTORY, 3, 3)
    assert not pgrepl.on_lineage(HISTORY, 3, 4)


@pytest.mark.parametrize("text, command", [
    ("IDENTIFY_SYSTEM", pgrepl.IdentifySystem()),
    ("identify_system;", pgrepl.IdentifySystem()),
    ("SHOW wal_segment_size", pgrepl.Show("wal_segment_size")),
    ("SHOW data_directory_mode", pgrepl.Show("data_directory_mode")),
    ("TIMELINE_HISTORY 2", pgrepl.TimelineHistoryCommand(2)),
    ("READ_REPLICATION_SLOT s1", pgrepl.ReadReplicationSlot("s1")),
    ('START_REPLICATION SLOT "s1" 0/1000000 TIMELINE 1', pgrepl.StartReplication("s1", 0x1000000, 1)),
    ("START_REPLICATION 0/3000000 TIMELINE 1", pgrepl.StartReplication(None, 0x3000000, 1)),
    ("START_REPLICATION PHYSICAL 0/3000000", pgrepl.StartReplication(None, 0x3000000, 0)),
    ("START_REPLICATION PHYSICAL 1/0 TIMELINE 2 TERM 7", pgrepl.StartReplication(None, 1 << 32, 2, 7)),
    ("CREATE_REPLICATION_SLOT s PHYSICAL", pgrepl.CreateReplicationSlot("s", False, False)),
    ("CREATE_REPLICATION_SLOT s TEMPORARY PHYSICAL RESERVE_WAL", pgrepl.CreateReplicationSlot("s", True, True)),
    ('CREATE_REPLICATION_SLOT "pg_basebackup_1" TEMPORARY PHYSICAL ( RESERVE_WAL)',
     pgrepl.CreateReplicationSlot("pg_basebackup_1", True, True)),
    ("DROP_REPLICATION_SLOT s WAIT", pgrepl.DropReplicationSlot("s", True)),
    ("BASE_BACKUP (LABEL 'x')", pgrepl.Unsupported("BASE_BACKUP")),
    ("START_REPLICATION SLOT s LOGICAL 0/0", pgrepl.Unsupported("logical replication")),
    ("CREATE_REPLICATION_SLOT s LOGICAL pgoutput", pgrepl.Unsupported("logical replication")),
    ("SELECT 1", pgrepl.Unsupported("SQL")),
])
def test_commands(text: str, command: pgrepl.Command) -> None:
    assert pgrepl.parse_command(text) == command


@pytest.mark.parametrize("text, match", [
    ("", "empty command"),
    ("IDENTIFY_SYSTEM now", "syntax error"),
    ("START_REPLICATION PHYSICAL 0-1", "invalid WAL position"),
    ("START_REPLICATION PHYSICAL 0/1 TIMELINE 0", "invalid timeline"),
    ("TIMELINE_HISTORY x", "invalid timeline"),
    ("TIMELINE_HISTORY \u0663", "invalid timeline"),  # an Arabic-Indic 3: a digit to str.isdigit()
    ("START_REPLICATION PHYSICAL 0/0 TERM \u00b2", "invalid term"),  # a superscript 2, which int() refuses
    ("SHOW", "end of input"),
    ("CREATE_REPLICATION_SLOT s PHYSICAL (FOO)", "unrecognized option"),
    ("X" * (pgrepl.MAX_COMMAND + 1), "too long"),
])
def test_bad_commands(text: str, match: str) -> None:
    with pytest.raises(ReplicationProtocolError, match=match):
        pgrepl.parse_command(text)


def test_start_replication_round_trips() -> None:
    text = pgrepl.format_start_replication(0x1000000, 2, "s1", term=5)
    assert text == 'START_REPLICATION SLOT "s1" PHYSICAL 0/1000000 TIMELINE 2 TERM 5'
    assert pgrepl.parse_command(text) == pgrepl.StartReplication("s1", 0x1000000, 2, 5)
    with pytest.raises(ReplicationProtocolError, match="invalid replication slot name"):
        pgrepl.format_start_replication(0, slot="Bad-Slot")

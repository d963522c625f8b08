"""The safekeeper control file: round trip, corruption detection, interrupted saves."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import google_crc32c
import pytest

from sidecar.consensus.messages import NO_DEGRADED, NO_FENCE, DegradedRange, TermEntry, TimelineFence
from sidecar.timelines import TimelineEntry
from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.control import (
    CONTROL_FILE, ControlData, ControlFileError, load_control, remove_leftovers, save_control,
)

SAMPLE = ControlData(
    node_id=3,
    state=AcceptorState(
        system_id=7_312_345_678_901_234_567, wal_seg_size=16 * 1024 * 1024, pg_version=150004,
        timeline=2, term=9,
        term_history=(TermEntry(1, 0x1000000), TermEntry(4, 0x1234568), TermEntry(9, 0x2000028)),
        timeline_history=(TimelineEntry(1, 0x1800000),),
        commit_lsn=0x2000000, backup_lsn=0x1000000, peer_horizon_lsn=0x1F00000,
        fence=TimelineFence(8, 1, 0x1900000), members=5, lost_disk_term=7,
        degraded=DegradedRange(9, 0x2000100, 2, frozenset({3, 1})), degrade_term=9,
    ),
)


def reframe(body: bytes) -> bytes:
    """A well-framed control file around an arbitrary body."""
    return struct.pack("<4sIII", b"WSKC", 4, len(body), google_crc32c.value(body)) + body


def test_missing_file_means_fresh(tmp_path: Path) -> None:
    assert load_control(tmp_path) is None


def test_round_trip(tmp_path: Path) -> None:
    save_control(tmp_path, SAMPLE)
    assert load_control(tmp_path) == SAMPLE
    assert [p.name for p in tmp_path.iterdir()] == [CONTROL_FILE]


def test_save_replaces(tmp_path: Path) -> None:
    save_control(tmp_path, SAMPLE)
    newer = ControlData(3, AcceptorState(term=10))
    save_control(tmp_path, newer)
    assert load_control(tmp_path) == newer


def test_file_layout(tmp_path: Path) -> None:
    save_control(tmp_path, SAMPLE)
    raw = (tmp_path / CONTROL_FILE).read_bytes()
    magic, version, length, crc = struct.unpack_from("<4sIII", raw)
    body = raw[16:]
    assert (magic, version, length, crc) == (b"WSKC", 4, len(body), google_crc32c.value(body))
    obj = json.loads(body)
    assert obj["node_id"] == 3
    assert obj["term_history"] == [[1, 0x1000000], [4, 0x1234568], [9, 0x2000028]]
    assert obj["timeline_history"] == [[1, 0x1800000]]
    assert obj["fence"] == [8, 1, 0x1900000]
    assert (obj["members"], obj["lost_disk_term"]) == (5, 7)
    assert obj["degraded"] == [9, 0x2000100, 2, [1, 3]]


def test_a_version_3_file_reads_as_no_degraded_range(tmp_path: Path) -> None:
    """The previous release never recorded a degraded range: its control file reads as none."""
    save_control(tmp_path, SAMPLE)
    obj = json.loads((tmp_path / CONTROL_FILE).read_bytes()[16:])
    del obj["degraded"], obj["degrade_term"]
    body = json.dumps(obj).encode()
    (tmp_path / CONTROL_FILE).write_bytes(struct.pack("<4sIII", b"WSKC", 3, len(body), google_crc32c.value(body)) + body)
    loaded = load_control(tmp_path)
    assert loaded is not None and loaded.state == dataclasses.replace(SAMPLE.state, degraded=NO_DEGRADED,
                                                                           degrade_term=0)


def test_a_version_1_file_reads_as_no_fence(tmp_path: Path) -> None:
    """The previous release's control file (no fence) is read by this one, as if no failover had set one."""
    save_control(tmp_path, SAMPLE)
    obj = json.loads((tmp_path / CONTROL_FILE).read_bytes()[16:])
    del obj["fence"], obj["members"], obj["lost_disk_term"], obj["degraded"], obj["degrade_term"]
    body = json.dumps(obj).encode()
    (tmp_path / CONTROL_FILE).write_bytes(struct.pack("<4sIII", b"WSKC", 1, len(body), google_crc32c.value(body)) + body)
    loaded = load_control(tmp_path)
    assert loaded is not None and \
        loaded.state == dataclasses.replace(SAMPLE.state, fence=NO_FENCE, members=0, lost_disk_term=0,
                                            degraded=NO_DEGRADED, degrade_term=0)


def test_a_version_2_file_reads_as_no_member_count_and_no_lost_disk(tmp_path: Path) -> None:
    """The previous release's control file (a fence, no member count) reads as an unknown count (the next Greeting
    tells it) and no lost disk being recovered."""
    save_control(tmp_path, SAMPLE)
    obj = json.loads((tmp_path / CONTROL_FILE).read_bytes()[16:])
    del obj["members"], obj["lost_disk_term"], obj["degraded"], obj["degrade_term"]
    body = json.dumps(obj).encode()
    (tmp_path / CONTROL_FILE).write_bytes(struct.pack("<4sIII", b"WSKC", 2, len(body), google_crc32c.value(body)) + body)
    loaded = load_control(tmp_path)
    assert loaded is not None and loaded.state == dataclasses.replace(SAMPLE.state, members=0, lost_disk_term=0,
                                                                         degraded=NO_DEGRADED, degrade_term=0)
    (tmp_path / CONTROL_FILE).write_bytes(reframe(body))  # a version 4 file lacking them is corrupt
    with pytest.raises(ControlFileError, match="missing fields"):
        load_control(tmp_path)


@pytest.mark.parametrize("where", [0, 5, 13, 20, -2])
def test_any_flipped_byte_is_detected(tmp_path: Path, where: int) -> None:
    save_control(tmp_path, SAMPLE)
    path = tmp_path / CONTROL_FILE
    raw = bytearray(path.read_bytes())
    raw[where] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ControlFileError, match=str(path)):
        load_control(tmp_path)


def test_body_corruption_says_checksum(tmp_path: Path) -> None:
    save_control(tmp_path, SAMPLE)
    path = tmp_path / CONTROL_FILE
    raw = bytearray(path.read_bytes())
    raw[30] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ControlFileError, match="checksum mismatch: the control file is corrupt; restore it"):
        load_control(tmp_path)


@pytest.mark.parametrize("keep", [0, 3, 15, 16, 40])
def test_truncated_file(tmp_path: Path, keep: int) -> None:
    save_control(tmp_path, SAMPLE)
    path = tmp_path / CONTROL_FILE
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ControlFileError, match="truncated"):
        load_control(tmp_path)


def test_trailing_bytes(tmp_path: Path) -> None:
    save_control(tmp_path, SAMPLE)
    path = tmp_path / CONTROL_FILE
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(ControlFileError, match="trailing"):
        load_control(tmp_path)


def test_bad_magic_and_version(tmp_path: Path) -> None:
    path = tmp_path / CONTROL_FILE
    path.write_bytes(b"XXXX" + reframe(b"{}")[4:])
    with pytest.raises(ControlFileError, match="not a walsidecar control file"):
        load_control(tmp_path)
    path.write_bytes(struct.pack("<4sIII", b"WSKC", 5, 2, google_crc32c.value(b"{}")) + b"{}")
    with pytest.raises(ControlFileError, match="version 5"):
        load_control(tmp_path)


@pytest.mark.parametrize("body", [
    b"not json",
    b"[1, 2]",
    b"\xff\xfe",
    b'{"node_id": 1}',
])
def test_checksummed_garbage_is_rejected(tmp_path: Path, body: bytes) -> None:
    (tmp_path / CONTROL_FILE).write_bytes(reframe(body))
    with pytest.raises(ControlFileError, match="unreadable contents"):
        load_control(tmp_path)


@pytest.mark.parametrize("field, value", [
    ("term", -1), ("term", "9"), ("term", True), ("term", 1.5),
    ("term_history", [[1]]), ("term_history", {"1": 2}), ("timeline_history", [[1, "x"]]),
])
def test_bad_field_values_are_rejected(tmp_path: Path, field: str, value: object) -> None:
    save_control(tmp_path, SAMPLE)
    path = tmp_path / CONTROL_FILE
    obj = json.loads(path.read_bytes()[16:])
    obj[field] = value
    path.write_bytes(reframe(json.dumps(obj).encode()))
    with pytest.raises(ControlFileError, match=field):
        load_control(tmp_path)


def test_unknown_field_is_rejected(tmp_path: Path) -> None:
    save_control(tmp_path, SAMPLE)
    path = tmp_path / CONTROL_FILE
    obj = json.loads(path.read_bytes()[16:])
    obj["flush_lsn"] = 5
    path.write_bytes(reframe(json.dumps(obj).encode()))
    with pytest.raises(ControlFileError, match="unknown fields"):
        load_control(tmp_path)


def test_leftover_tmp_from_interrupted_save_is_ignored_and_removed_by_its_owner(tmp_path: Path) -> None:
    save_control(tmp_path, SAMPLE)
    tmp = tmp_path / (CONTROL_FILE + ".tmp")
    tmp.write_bytes(b"WSKC half-written")
    assert load_control(tmp_path) == SAMPLE
    assert tmp.exists(), "a reader must not remove the temp file: it may be a save in progress"
    remove_leftovers(tmp_path)
    assert not tmp.exists()


def test_leftover_tmp_without_control_file_is_still_fresh(tmp_path: Path) -> None:
    (tmp_path / (CONTROL_FILE + ".tmp")).write_bytes(reframe(b"{}"))
    assert load_control(tmp_path) is None
    remove_leftovers(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_keeps_the_old_control_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    import dataclasses
    import errno
    import subprocess

    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        save_control(small, SAMPLE)
        fd = os.open(small / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError):  # take every block left
                while True:
                    os.write(fd, bytes(4096))
        finally:
            os.close(fd)
        bigger = dataclasses.replace(SAMPLE.state, term_history=tuple(TermEntry(t, t << 24) for t in range(1, 400)))
        with pytest.raises(OSError) as err:
            save_control(small, ControlData(3, bigger))
        assert err.value.errno == errno.ENOSPC
        assert load_control(small) == SAMPLE
        assert sorted(p.name for p in small.iterdir()) == sorted([CONTROL_FILE, "filler"])
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)

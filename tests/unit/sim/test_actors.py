"""The simulator's pieces on their own: the end of valid WAL on a simulated disk, the checker
built from the safekeepers alone, and the refusal to run an action it does not know."""

from __future__ import annotations

import random
import zlib

import pytest

from sidecar.consensus.acceptor import RecordEnd
from sidecar.consensus.messages import InfoReply, InfoRequest
from sidecar.consensus.session import AcceptorSession, Role
from sidecar.sim.checker import Checker
from sidecar.sim.nodes import SimSafekeeper
from sidecar.sim.profile import SimConfig
from sidecar.sim.wal import BOOT, Disk, Primary, record_end
from sidecar.sim.world import World


def _disk_with(records: int, torn: bytes = b"") -> tuple[Disk, Primary]:
    pg = Primary("pg", 1, ())
    rng = random.Random(3)
    for _ in range(records):
        pg.write_record(rng)
    disk = Disk()
    disk.truncate(BOOT)
    disk.write(BOOT, pg.read(BOOT, pg.end) + torn)
    return disk, pg


def test_record_end_is_the_end_of_the_last_complete_record() -> None:
    assert record_end(Disk(), 0) == RecordEnd(0)
    disk, pg = _disk_with(5, torn=b"\x07" * 30)
    last_start, last_end = pg.starts[-1], pg.ends[-1]
    crc = zlib.crc32(pg.read(last_start, last_end))
    assert record_end(disk, disk.end) == RecordEnd(last_end, last_start, crc)
    assert record_end(disk, last_end - 1, fingerprint=False) == RecordEnd(pg.ends[-2])
    assert record_end(disk, BOOT + 3) == RecordEnd(BOOT)  # no record complete: the store's start


def test_the_checker_needs_only_the_safekeepers() -> None:
    disk, _ = _disk_with(3)
    sks = [SimSafekeeper(f"sk{i}", i, disk=disk if i == 1 else Disk()) for i in (1, 2, 3)]
    checker = Checker(sks)
    assert checker.q == 2 and len(checker.quorums) == 3
    checker.after_step()  # nothing acknowledged: nothing to hold


def test_an_info_request_is_answered_by_the_acceptor() -> None:
    w = World(1, SimConfig(safekeepers=3), scripted=True)
    sk = w.by_name["sk2"]
    c = w.net.open("reader", "reader", None, sk, Role.CLIENT)
    assert w.sks.receive(c, InfoRequest())
    assert list(c.to_prop) == [InfoReply(2, 0, 0, 0, 0, 0, 0, 0, 0, False, members=3)]  # created with 3 members


def test_an_action_the_simulator_does_not_know_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(1, SimConfig(safekeepers=3), scripted=True)
    svc = w.start_service()
    w.connect(svc, "sk1")
    monkeypatch.setattr(AcceptorSession, "receive", lambda self, msg, end=None: [object()])
    with pytest.raises(AssertionError, match="does not know the action"):
        w.settle()

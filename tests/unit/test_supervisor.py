"""The supervisor of `walsidecar up` against fake members and a fake clock: backoff, holding, the primary's exit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sidecar.ctl import answer
from sidecar.supervisor import Backoff, PrimaryExited, Supervisor


class FakeMember:
    process = None  # no process of its own to report
    takes_over = False

    def __init__(self, name: str) -> None:
        self.name, self.running, self.starts = name, True, 0
        self.log_path = Path(f"/logs/{name}.log")
        self.problem: str | None = None

    def streaming_problem(self) -> str | None:
        return self.problem

    def start(self) -> None:
        self.running, self.starts = True, self.starts + 1

    def stop(self) -> None:
        self.running = False

    def kill(self) -> None:
        self.running, self.killed = False, True


class FakeDeployment:
    def __init__(self) -> None:
        self.members = {n: FakeMember(n) for n in ("primary", "safekeeper1", "proposer")}


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    error = info


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sup() -> Supervisor:
    return Supervisor(FakeDeployment(), Log(), clock=Clock())  # type: ignore[arg-type]


def test_backoff_doubles_up_to_the_cap_and_resets_after_a_long_run() -> None:
    b = Backoff(first=0.5, cap=4, reset_after=60)
    assert [b.delay(1) for _ in range(6)] == [0.5, 1, 2, 4, 4, 4]
    assert b.delay(60) == 0.5


def test_a_member_that_dies_is_logged_and_restarted_after_its_backoff(sup: Supervisor) -> None:
    sk = sup.d.members["safekeeper1"]
    sk.running = False
    sup.tick()
    event, fields = sup.log.lines[-1]
    assert event == "member exited; restarting it" and fields["member"] == "safekeeper1"
    assert fields["log"] == "/logs/safekeeper1.log" and fields["restart_in"] == 0.5
    assert sup.members()[1]["state"] == "restarting in 0.5s"
    sup.clock.now += 0.4
    sup.tick()
    assert not sk.running
    sup.clock.now += 0.1
    sup.tick()
    assert sk.running and sup.members()[1]["restarts"] == 1
    sk.running = False  # dies again at once: the next wait is twice as long
    sup.tick()
    assert sup.log.lines[-1][1]["restart_in"] == 1.0


def test_a_member_stopped_on_purpose_stays_stopped_until_started(sup: Supervisor) -> None:
    assert answer(sup, {"action": "stop", "member": "safekeeper1"})["ok"]
    sup.clock.now += 1000
    sup.tick()
    assert not sup.d.members["safekeeper1"].running and sup.members()[1]["state"] == "stopped"
    reply = answer(sup, {"action": "start", "member": "safekeeper1"})
    assert reply["ok"] and sup.d.members["safekeeper1"].running and sup.members()[1]["restarts"] == 0


def test_the_primary_exiting_ends_supervision_unless_stopped_on_purpose(sup: Supervisor) -> None:
    answer(sup, {"action": "stop", "member": "primary"})
    sup.tick()
    answer(sup, {"action": "start", "member": "primary"})
    sup.d.members["primary"].running = False
    with pytest.raises(PrimaryExited, match="PostgreSQL .* exited.*primary.log"):
        sup.tick()


def test_with_a_standby_the_primary_exiting_leaves_the_others_running_for_a_failover() -> None:
    d = FakeDeployment()
    d.members["standby"] = FakeMember("standby")
    d.members["standby"].takes_over = True
    log, clock = Log(), Clock()
    sup = Supervisor(d, log, clock=clock)  # type: ignore[arg-type]
    d.members["primary"].running = False
    d.members["safekeeper1"].running = False
    sup.tick()
    assert any("failover" in event for event, _ in log.lines)
    clock.now += 60
    sup.tick()
    assert d.members["safekeeper1"].starts == 1  # still supervised
    assert d.members["primary"].starts == 0  # the standby takes over, not the old primary
    assert {m["name"]: m["state"] for m in sup.members()}["primary"] == "stopped"


def test_answers_to_bad_requests(sup: Supervisor) -> None:
    assert answer(sup, {"action": "explode"}) == {"ok": False, "message": "unknown action 'explode': one of "
                                                  "members, stop, start, restart, kill"}
    assert "needs a MEMBER" in answer(sup, {"action": "stop"})["message"]
    assert "no member 'sk9'" in answer(sup, {"action": "start", "member": "sk9"})["message"]
    assert [m["name"] for m in answer(sup, {"action": "members"})["members"]] == ["primary", "safekeeper1",
                                                                                  "proposer"]


def test_a_member_that_keeps_failing_to_get_its_wal_is_logged_once_and_shown_until_it_streams(
        sup: Supervisor) -> None:
    clock, log = sup.clock, sup.log
    sup.d.members["standby"] = standby = FakeMember("standby")  # type: ignore[attr-defined]
    sup.watched["standby"] = type(sup.watched["primary"])(standby, clock())  # type: ignore[arg-type]
    cause = "not streaming (WAL receiver not running), replayed up to 0/3000000; its log: FATAL:  requested WAL"
    standby.problem = cause
    for _ in range(3):  # 10 s: a WAL receiver between two tries is not failing yet
        clock.now += 5
        sup.tick()
    assert not [e for e, _ in log.lines if e == "member keeps failing to get its WAL"]
    assert answer(sup, {"action": "members"})["members"][-1]["state"] == "running"
    clock.now += 5
    sup.tick()
    clock.now += 5
    sup.tick()
    failing = [f for e, f in log.lines if e == "member keeps failing to get its WAL"]
    assert failing == [{"member": "standby", "problem": cause, "seconds": 15, "log": "/logs/standby.log"}]
    assert answer(sup, {"action": "members"})["members"][-1]["state"] == f"running, failing for 20s: {cause}"
    standby.problem = None
    clock.now += 5
    sup.tick()
    assert log.lines[-1] == ("member streams again", {"member": "standby"})
    assert answer(sup, {"action": "members"})["members"][-1]["state"] == "running"


class Settling:
    """`back` for `up`'s members: None (not back) `pending` times, then `how`; the fake clock moves on each sleep."""

    def __init__(self, sup: Supervisor, pending: int, how: str = "the proposer streams to it (catching up)") -> None:
        self.sup, self.pending, self.how, self.asked = sup, pending, how, 0

    def __call__(self, name: str) -> str | None:
        self.asked += 1
        return None if self.asked <= self.pending else self.how

    def sleep(self, seconds: float) -> None:
        self.sup.clock.now += seconds  # type: ignore[attr-defined]


def settling(sup: Supervisor, pending: int) -> Settling:
    s = Settling(sup, pending)
    sup.back, sup.sleep = s, s.sleep
    return s


def test_start_on_request_answers_once_the_member_is_back(sup: Supervisor) -> None:
    answer(sup, {"action": "stop", "member": "safekeeper1"})
    back = settling(sup, pending=3)
    reply = answer(sup, {"action": "start", "member": "safekeeper1"})
    assert reply["message"] == "started safekeeper1 (pid None); the proposer streams to it (catching up)"
    assert back.asked == 4
    reply = answer(sup, {"action": "restart", "member": "safekeeper1"})
    assert reply["message"] == "restarted safekeeper1 (pid None); the proposer streams to it (catching up)"


def test_start_on_request_waits_for_the_member_a_bounded_time(sup: Supervisor) -> None:
    answer(sup, {"action": "stop", "member": "safekeeper1"})
    settling(sup, pending=10**6)
    started = sup.clock()
    reply = answer(sup, {"action": "start", "member": "safekeeper1"})
    assert reply["ok"] and reply["message"] == ("started safekeeper1 (pid None); not back in the cluster after 10s: "
                                                "see /logs/safekeeper1.log")
    assert sup.clock() - started == pytest.approx(10, abs=0.1)
    answer(sup, {"action": "stop", "member": "safekeeper1"})
    back = settling(sup, pending=10**6)
    sup.d.members["safekeeper1"].start = lambda: None  # spawned, and already gone
    reply = answer(sup, {"action": "start", "member": "safekeeper1"})
    assert reply["message"] == "started safekeeper1 (pid None); it exited at once: see /logs/safekeeper1.log"
    assert back.asked == 1


def test_nothing_to_wait_for_adds_nothing(sup: Supervisor) -> None:
    answer(sup, {"action": "stop", "member": "proposer"})
    back = Settling(sup, pending=0, how="")
    sup.back = back
    assert answer(sup, {"action": "start", "member": "proposer"})["message"] == "started proposer (pid None)"


def test_a_member_killed_on_request_stays_down_until_started_and_members_describe_it() -> None:
    d = FakeDeployment()
    clock = Clock()
    sup = Supervisor(d, Log(), clock=clock, describe=lambda name: "primary, timeline 2" if name == "proposer" else None)  # type: ignore[arg-type]
    assert answer(sup, {"action": "kill", "member": "proposer"})["ok"]
    assert getattr(d.members["proposer"], "killed", False)
    clock.now += 3600
    sup.tick()
    assert d.members["proposer"].starts == 0  # a host loss on request is not undone by the supervisor
    states = {r["name"]: r["state"] for r in sup.members()}
    assert states["proposer"] == "stopped"
    sup.start("proposer")
    assert {r["name"]: r["state"] for r in sup.members()}["proposer"] == "running: primary, timeline 2"

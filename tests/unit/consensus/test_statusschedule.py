"""The status schedule: when the proposer's standby status goes to the primary (consensus/statusschedule.py)."""

from __future__ import annotations

import random

import pytest

from sidecar.consensus.statusschedule import SendStatus, StatusSchedule


def sent_now(s: StatusSchedule, now: float, heard_at: float | None = None) -> SendStatus:
    decision = s.poll(now, now if heard_at is None else heard_at)
    assert isinstance(decision, SendStatus), decision
    s.sent(decision, now)
    return decision


def started(now: float = 10.0) -> StatusSchedule:
    s = StatusSchedule(delay=0.01, keepalive_interval=1.0, answer_interval=0.1)
    s.report(100, 100, 100, now)
    assert sent_now(s, now) == SendStatus(100, 100, 100)
    return s


def test_the_first_status_and_every_flush_move_go_out_at_once() -> None:
    s = started()
    s.report(200, 150, 100, 10.2)
    assert sent_now(s, 10.2) == SendStatus(200, 150, 100)
    # Nothing new: the next look is the periodic repeat.
    assert s.poll(10.3, 10.3) == pytest.approx(11.2)


def test_write_or_apply_alone_waits_for_the_delay_unless_flush_moves_first() -> None:
    s = started()
    s.report(300, 100, 100, 10.5)
    assert s.poll(10.5, 10.5) == pytest.approx(10.51)
    s.report(400, 100, 150, 10.505)
    assert s.poll(10.505, 10.505) == pytest.approx(10.51), "the wait runs from the first unsent move"
    assert sent_now(s, 10.51) == SendStatus(400, 100, 150)
    s.report(500, 100, 150, 10.6)
    s.report(500, 450, 150, 10.601)
    assert sent_now(s, 10.601) == SendStatus(500, 450, 150), "a flush move does not wait"


def test_flush_never_goes_back() -> None:
    s = started()
    with pytest.raises(ValueError, match="backwards"):
        s.report(100, 99, 100, 10.1)
    assert s.positions == (100, 100, 100)
    assert s.poll(10.1, 10.1) == pytest.approx(11.0), "a refused report changes nothing"


def test_silence_repeats_the_positions_and_asks_a_silent_primary_for_a_reply() -> None:
    s = started()
    assert s.poll(10.9, 10.9) == pytest.approx(11.0)
    assert sent_now(s, 11.0, heard_at=10.5) == SendStatus(100, 100, 100, reply_requested=False)
    assert sent_now(s, 12.0, heard_at=10.5) == SendStatus(100, 100, 100, reply_requested=True)


def test_a_keepalive_is_answered_at_once_with_news_else_at_most_once_per_answer_interval() -> None:
    s = started()
    s.keepalive()
    assert s.poll(10.05, 10.05) == pytest.approx(10.1)
    assert sent_now(s, 10.1) == SendStatus(100, 100, 100)
    s.keepalive()
    assert sent_now(s, 10.3) == SendStatus(100, 100, 100), "a reply asked after the interval goes at once"
    s.report(120, 100, 100, 10.31)
    s.keepalive()
    assert sent_now(s, 10.31) == SendStatus(120, 100, 100), "news goes with the answer without waiting"


def test_random_reports_never_send_a_flush_lower_than_sent_and_send_every_flush_move_when_reported() -> None:
    rng = random.Random(23)
    s = StatusSchedule(delay=0.01, keepalive_interval=1.0, answer_interval=0.1)
    now, write, flush, apply, last_flush, pending_at = 0.0, 0, 0, 0, -1, None
    for _ in range(5000):
        now += rng.choice((0.0, 0.001, 0.004, 0.02, 0.3))
        kind = rng.random()
        if kind < 0.4:
            flush += rng.choice((0, 0, 8, 100))
            write, apply = max(write, flush) + rng.choice((0, 50)), min(flush, apply + rng.choice((0, 30)))
            moved_flush = flush != s.positions[1]
            s.report(write, flush, apply, now)
            if moved_flush:
                pending_at = now
        elif kind < 0.5:
            s.keepalive()
        decision = s.poll(now, now)
        if isinstance(decision, SendStatus):
            assert decision.positions == s.positions, "a status carries the latest positions"
            assert decision.flush >= last_flush, "invariant 4: the reported flush never goes back"
            last_flush = decision.flush
            pending_at = None
            s.sent(decision, now)
        else:
            assert isinstance(decision, float) and decision > now
            assert pending_at is None, "a flush move waited: commits would wait for it"

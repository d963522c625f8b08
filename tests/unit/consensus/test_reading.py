"""What a reader may be sent next (consensus/reading.py): commit cap, term readers, timeline ends, cuts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.timelines import TimelineEntry
from sidecar.consensus.reading import (
    INVALID_PARAMETER, NOT_IN_PREREQUISITE, UNDEFINED_FILE, ReadCursor, ReadRefused, Send, ServerState,
    TimelineDone, Wait, readable_end,
)
from sidecar.pgrepl import MAX_SEND_SIZE

SEG = 16 << 20
S = ServerState(term=3, flush_lsn=SEG + 5000, commit_lsn=SEG + 3000, generation=0, timeline=1, history=(),
                first_lsn=SEG)


def drain(cursor: ReadCursor, s: ServerState) -> tuple[int, object]:
    """Send everything the cursor allows; (where it stopped, the step that stopped it)."""
    while True:
        step = cursor.next(s)
        if not isinstance(step, Send):
            return cursor.sent, step
        assert step.start == cursor.sent and step.end - step.start <= MAX_SEND_SIZE
        cursor.advance(step.end)


def test_a_reader_is_sent_wal_up_to_the_commit_position_and_no_further() -> None:
    c = ReadCursor(SEG, 0, S)
    assert c.next(S) == Send(SEG, SEG + 3000)
    c.advance(SEG + 3000)
    assert c.next(S) == Wait(SEG + 3000)
    # The flush moving does not matter; the commit moving does.
    assert c.next(replace(S, flush_lsn=SEG + 9000)) == Wait(SEG + 3000)
    assert c.next(replace(S, commit_lsn=SEG + 4000)) == Send(SEG + 3000, SEG + 4000)


def test_a_lagging_safekeeper_serves_only_what_it_holds() -> None:
    s = replace(S, commit_lsn=SEG + 9000)  # commit learned beyond its own flush
    assert readable_end(s) == SEG + 5000
    assert drain(ReadCursor(SEG, 0, s), s) == (SEG + 5000, Wait(SEG + 5000))


def test_sends_are_at_most_max_send_size() -> None:
    s = replace(S, flush_lsn=SEG + 5 * MAX_SEND_SIZE, commit_lsn=SEG + 5 * MAX_SEND_SIZE + 1 - 2)
    c = ReadCursor(SEG, 1, s)
    assert c.next(s) == Send(SEG, SEG + MAX_SEND_SIZE)
    assert drain(c, s)[0] == s.commit_lsn


def test_a_reader_of_the_current_term_reads_up_to_the_flush_while_the_term_lasts() -> None:
    c = ReadCursor(SEG, 0, S, term=3)
    assert drain(c, S) == (SEG + 5000, Wait(SEG + 5000))
    with pytest.raises(ReadRefused) as e:
        c.next(replace(S, term=4))
    assert e.value.sqlstate == NOT_IN_PREREQUISITE
    with pytest.raises(ReadRefused, match="term 2 is not this safekeeper.s current term") as e:
        ReadCursor(SEG, 0, S, term=2)
    assert e.value.sqlstate == NOT_IN_PREREQUISITE


@pytest.mark.parametrize("start, timeline, sqlstate, match", [
    (0, 0, UNDEFINED_FILE, "not stored here"),
    (SEG - 1, 1, UNDEFINED_FILE, "holds WAL from 0/1000000"),
    (SEG + 3001, 0, INVALID_PARAMETER, "ahead of the WAL"),
    (SEG, 2, INVALID_PARAMETER, "timeline 2 is not in this server's history"),
])
def test_requests_that_cannot_be_served(start: int, timeline: int, sqlstate: str, match: str) -> None:
    with pytest.raises(ReadRefused, match=match) as e:
        ReadCursor(start, timeline, S)
    assert e.value.sqlstate == sqlstate


def test_a_safekeeper_that_stores_nothing_refuses() -> None:
    with pytest.raises(ReadRefused, match="holds no WAL") as e:
        ReadCursor(0, 0, replace(S, first_lsn=None, flush_lsn=0, commit_lsn=0))
    assert e.value.sqlstate == UNDEFINED_FILE


def test_the_commit_position_itself_is_a_valid_start() -> None:
    c = ReadCursor(SEG + 3000, 0, S)
    assert c.next(S) == Wait(SEG + 3000)


SWITCH = SEG + 2000
T2 = replace(S, timeline=2, history=(TimelineEntry(1, SWITCH),))


def test_an_old_timeline_ends_at_its_switch_point() -> None:
    c = ReadCursor(SEG, 1, T2)
    assert c.timeline == 1
    assert drain(c, T2) == (SWITCH, TimelineDone(2, SWITCH))
    # The current timeline goes on past it.
    c2 = ReadCursor(SWITCH, 2, T2)
    assert drain(c2, T2) == (SEG + 3000, Wait(SEG + 3000))


def test_an_old_timeline_is_capped_by_the_commit_before_its_end() -> None:
    s = replace(T2, commit_lsn=SEG + 1000)
    c = ReadCursor(SEG, 1, s)
    assert drain(c, s) == (SEG + 1000, Wait(SEG + 1000))
    assert drain(c, T2) == (SWITCH, TimelineDone(2, SWITCH))


def test_a_start_beyond_the_end_of_its_timeline_is_refused() -> None:
    with pytest.raises(ReadRefused, match="timeline 1 ends at") as e:
        ReadCursor(SWITCH + 1, 1, T2)
    assert e.value.sqlstate == INVALID_PARAMETER


def test_a_cut_below_what_was_sent_ends_the_read() -> None:
    c = ReadCursor(SEG, 0, S, term=3)
    drain(c, S)  # sent up to the flush, SEG + 5000
    # A new term keeps the committed WAL and cuts the rest: this term reader must not go on.
    cut = replace(S, term=3, flush_lsn=SEG + 4000, generation=1)
    with pytest.raises(ReadRefused, match="was cut") as e:
        c.next(cut)
    assert e.value.sqlstate == NOT_IN_PREREQUISITE


def test_a_cut_above_what_was_sent_changes_nothing_for_a_commit_reader() -> None:
    c = ReadCursor(SEG, 0, S)
    drain(c, S)  # sent up to the commit, SEG + 3000
    cut = replace(S, term=4, flush_lsn=SEG + 3500, generation=1)
    assert c.next(cut) == Wait(SEG + 3000)
    assert c.next(replace(cut, flush_lsn=SEG + 8000, commit_lsn=SEG + 6000)) == Send(SEG + 3000, SEG + 6000)


def test_a_reader_that_missed_a_cut_below_what_it_was_sent_is_refused_even_once_wal_is_written_again() -> None:
    """Never two versions of one position: the lowest cut since it last looked counts, not today's flush."""
    c = ReadCursor(SEG, 0, replace(S, cuts=(SEG,)))
    c.advance(SEG + 3000)
    # Two terms later: the first cut at SEG + 2000, and WAL written again (committed) beyond SEG + 3000.
    later = replace(S, generation=2, flush_lsn=SEG + 8000, commit_lsn=SEG + 7000, cuts=(SEG, SEG + 2000, SEG + 8000))
    with pytest.raises(ReadRefused, match="was cut at 0/10007D0") as e:
        c.next(later)
    assert e.value.sqlstate == NOT_IN_PREREQUISITE
    # Cuts above what it was sent leave it reading on.
    c = ReadCursor(SEG, 0, replace(S, cuts=(SEG,)))
    c.advance(SEG + 3000)
    assert c.next(replace(later, cuts=(SEG, SEG + 3000, SEG + 8000))) == Send(SEG + 3000, SEG + 7000)
    # More cuts than remembered: it cannot know, so it is refused.
    c = ReadCursor(SEG, 0, replace(S, cuts=(SEG,)))
    c.advance(SEG + 100)
    with pytest.raises(ReadRefused):
        c.next(replace(later, generation=9))

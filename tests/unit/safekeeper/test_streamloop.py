"""The safekeeper's two stream loops, the Python reference and the compiled one, on the same streams.

Each stream is sent over a real socket to a real safekeeper (its proposer port, its WAL directory,
fdatasync), once per implementation, in several cuttings of the same bytes, in phases that each wait
for their acknowledgement. Acknowledgements come as group commit finds the socket drained, so how
many there are depends on timing: what is compared is every other reply in order (refusals word for
word), the highest acknowledgement, the state left behind (acceptor, positions, control file, every
WAL file byte for byte) and how the connection ended.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sidecar.consensus import codec
from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, AppendReply, Elected, Greeting, InfoRequest, Message, TermEntry, TimelineFence,
    VoteRequest,
)
from sidecar.safekeeper import streamloop
from sidecar.safekeeper.control import load_control
from sidecar.safekeeper.server import Safekeeper
from sidecar.safekeeper.walcheck import StartupError
from support.helpers import created, run
from support.serving import serving
from support.walbuilder import WalBuilder

SEG = 1 << 20
SYSID = 7_300_000_000_000_000_044
OPENING = (Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15), VoteRequest(1), Elected(1, SEG, (TermEntry(1, SEG),)))


def _appends(begin: int, sizes: list[int], seed: int, term: int = 1) -> tuple[list[Message], int]:
    """Appends of pseudo-random WAL from `begin`, with a commit position that mostly moves on and
    sometimes goes back (the acceptor keeps the highest), and a heartbeat now and then."""
    rng = random.Random(seed)
    out: list[Message] = []
    lsn, commit = begin, begin
    for size in sizes:
        commit = max(begin, lsn - rng.randrange(0, 4096)) if rng.random() < 0.2 else lsn
        out.append(Append(term, lsn, commit, commit // 2, rng.randbytes(size)))
        lsn += size
        if rng.random() < 0.15:
            out.append(Append(term, lsn, lsn, 0))
    return out, lsn


def _frames(messages: list[Message] | tuple[Message, ...]) -> bytes:
    return b"".join(codec.encode(m) for m in messages)


@dataclass
class Outcome:
    replies: list[Message]  # every reply but acknowledgements, in order
    acked: tuple[int, int]  # the highest flush_lsn acknowledged, and the highest commit_lsn told with it
    ended: str  # "open": we closed it; "closed": the safekeeper did
    state: Any
    positions: Any
    write_lsn: int
    flush_lsn: int
    control: Any
    wal: dict[str, bytes]
    served_in_place: int  # Appends the compiled loop wrote itself


# Bytes to send, then what to wait for: the flush_lsn acknowledged, -n for n more replies that are no
# acknowledgements, or None to end the stream and read until the safekeeper closes.
Phase = tuple[bytes, "int | None"]


def _converse(tmp_path: Path, impl: str, opening: tuple[Message, ...], phases: list[Phase], pieces: int) -> Outcome:
    """Send `opening` and read its answers, then each phase's bytes cut into pieces of `pieces` bytes (0:
    whole), each followed by a wait for its acknowledgement, or by the end of the stream and reading until
    the safekeeper closes; then stop the safekeeper and look at what it left."""
    data_dir = tmp_path / impl / str(pieces)
    served = 0

    async def main() -> Outcome:
        nonlocal served
        sk = Safekeeper.open(1, created(data_dir, 1), "127.0.0.1", 0)
        sk.stream_loop = streamloop.chosen(impl)
        wrote = sk._wrote_in_place

        def counting(*args: int) -> None:
            nonlocal served
            served += 1
            wrote(*args)
        sk._wrote_in_place = counting  # type: ignore[method-assign]
        server, port = await serving(sk)
        try:
            replies, acked, ended = await asyncio.to_thread(_client, port, opening, phases, pieces)
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
        acc = sk.acceptor
        wal = {p.name: p.read_bytes() for p in sorted((data_dir / "wal").glob("*")) if p.is_file()}
        return Outcome(replies, acked, ended, acc.state, sk.positions.value, acc.write_lsn, acc.flush_lsn,
                       load_control(data_dir).state, wal, served)

    return run(main())


def _client(port: int, opening: tuple[Message, ...], phases: list[Phase],
            pieces: int) -> tuple[list[Message], tuple[int, int], str]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    decoder = codec.FrameDecoder(codec.MAX_FRAME)
    replies: list[Message] = []
    acked = told = 0

    def receive() -> bool:
        nonlocal acked, told
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            data = b""
        for m in decoder.feed(data):
            if type(m) is AppendReply and m.term == 1:  # an acknowledgement, or a heartbeat's answer
                if m.flush_lsn > acked:
                    acked, told = m.flush_lsn, m.commit_lsn
                elif m.flush_lsn == acked:
                    told = max(told, m.commit_lsn)
            else:
                replies.append(m)
        return bool(data)

    try:
        sock.sendall(_frames(opening))
        while len(replies) < len(opening):
            assert receive(), f"closed after {replies}"
        for stream, wait_for in phases:
            step = pieces or len(stream)
            for i in range(0, len(stream), step):
                try:
                    sock.sendall(stream[i:i + step])
                except (BrokenPipeError, ConnectionResetError):  # refused and closed before the rest arrived
                    break
            if wait_for is None:  # the end of the stream: a safekeeper that refused nothing sees it close
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                while receive():
                    pass
                return replies, (acked, told), "closed"
            replied = len(replies) - wait_for if wait_for < 0 else 0
            while acked < wait_for or len(replies) < replied:
                if not receive():
                    return replies, (acked, told), "closed"
        return replies, (acked, told), "open"
    finally:
        sock.close()


def _both(tmp_path: Path, phases: list[Phase], cuttings: tuple[int, ...] = (0, 4093, 1 << 16),
          opening: tuple[Message, ...] = OPENING) -> int:
    """The reference and the compiled loop leave the same outcome, in every cutting of the stream; the
    fewest Appends the compiled loop served itself in one of them."""
    served = []
    for pieces in cuttings:
        ref = _converse(tmp_path, "python", opening, phases, pieces)
        com = _converse(tmp_path, "compiled", opening, phases, pieces)
        assert ref.served_in_place == 0
        served.append(com.served_in_place)
        ref.served_in_place = com.served_in_place = 0
        assert com == ref, f"cut into pieces of {pieces or 'the whole'} bytes"
    return min(served)


def _plain(messages: list[Message]) -> int:
    """Appends the compiled loop may serve itself (WAL, not a heartbeat)."""
    return sum(1 for m in messages if type(m) is Append and m.data)


# ---- valid streams -------------------------------------------------------------------------------

def test_appends_across_segments_with_heartbeats_and_a_commit_going_back_leave_the_same_wal_and_state(
        tmp_path: Path) -> None:
    sizes = [100, 8192, 1, 50_000, 3000, 131_072, 7] * 6 + [SEG + SEG // 3]
    appends, end = _appends(SEG, sizes, seed=1)
    # One Append ends exactly at a segment's end, and the next begins the next segment.
    exact, end2 = _appends(end, [4 * SEG - end], seed=2)
    assert end2 == 4 * SEG
    more, end3 = _appends(end2, [500, 70_000], seed=3)
    # The first Append opens the segment (the reference's); the rest arrive while the compiled loop receives,
    # the one that fills a segment on its own.
    assert _both(tmp_path, [(_frames(appends[:1]), appends[0].end_lsn),  # type: ignore[attr-defined]
                            (_frames(appends[1:]), end), (_frames(exact), end2), (_frames(more), end3)]) >= 1


def test_a_question_in_the_middle_of_the_stream_is_answered_and_the_stream_goes_on(tmp_path: Path) -> None:
    first, mid = _appends(SEG, [4000, 20_000, 9], seed=4)
    second, end = _appends(mid, [12_000, 1], seed=5)
    assert _both(tmp_path, [(_frames(first[:1]), 4000 + SEG),
                            (_frames([*first[1:], InfoRequest(), *second]), end)]) >= 1


# ---- hostile streams: what is refused, and how, is the reference's ---------------------------------

def _refused(tmp_path: Path, tail: list[Message] | bytes, cuttings: tuple[int, ...] = (0, 4093)) -> None:
    """Appends, acknowledged; then one more, acknowledged, which the compiled loop serves; then `tail`,
    which it meets itself."""
    first, end = _appends(SEG, [5000, 300, 40_000], seed=6)
    last = Append(1, end, end, 0, b"w" * 700)
    stream = tail if isinstance(tail, bytes) else _frames(tail)
    assert _both(tmp_path, [(_frames(first), end), (_frames([last]), last.end_lsn), (stream, None)],
                 cuttings=cuttings) >= 1


def _end_of(messages: list[Message]) -> int:
    """The end of `_refused`'s Appends."""
    last = messages[-1]
    assert isinstance(last, Append)
    return last.end_lsn + 700


def test_an_append_that_leaves_a_gap_is_refused_alike(tmp_path: Path) -> None:
    first, _ = _appends(SEG, [5000, 300, 40_000], seed=6)
    _refused(tmp_path, [Append(1, _end_of(first) + 8, 0, 0, b"x" * 100)])


def test_an_append_that_overlaps_what_is_written_is_refused_alike(tmp_path: Path) -> None:
    first, _ = _appends(SEG, [5000, 300, 40_000], seed=6)
    _refused(tmp_path, [Append(1, _end_of(first) - 1, 0, 0, b"x" * 100)])


def test_an_append_in_a_term_never_elected_is_refused_alike(tmp_path: Path) -> None:
    first, _ = _appends(SEG, [5000, 300, 40_000], seed=6)
    _refused(tmp_path, [Append(2, _end_of(first), 0, 0, b"x" * 100)])


def test_an_append_from_a_lower_term_gets_the_term_and_no_write(tmp_path: Path) -> None:
    first, _ = _appends(SEG, [5000, 300, 40_000], seed=6)
    _refused(tmp_path, [VoteRequest(3), Append(1, _end_of(first), 0, 0, b"x" * 100), Append(1, 0, 0, 0)])


def test_an_append_after_this_connection_promised_a_higher_term_gets_that_term_and_no_write(tmp_path: Path) -> None:
    """The compiled loop still holds the connection (a vote does not move the term's owner): the Append
    of the elected term is no longer the current term's."""
    first, end = _appends(SEG, [5000, 300], seed=8)
    late = Append(1, end, end, 0, b"v" * 900)
    _both(tmp_path, [(_frames(first), end), (_frames([VoteRequest(3)]), -1), (_frames([late]), -1),
                     (_frames([late]), None)])


def test_an_append_past_a_failover_terms_start_is_refused_alike(tmp_path: Path) -> None:
    """A failover's fence term streams no WAL past its start; the segment is open, so the compiled loop meets it."""
    b = WalBuilder(SEG, seg_size=SEG, sysid=SYSID)
    b.fill_to(SEG + 30_000, 300)
    wal, end = b.bytes(), b.records[-1].end_lsn
    fence = Elected(2, end, (TermEntry(1, SEG), TermEntry(2, end)), 1, (), TimelineFence(2, 1, end))
    assert _both(tmp_path, [(_frames([Append(1, SEG, 0, 0, wal[:end - SEG])]), end),
                            (_frames([VoteRequest(2)]), -1), (_frames([fence]), -1),
                            (_frames([Append(2, end, 0, 0, b"u" * 100)]), None)]) == 0


@pytest.mark.parametrize("field", ["term", "commit", "horizon", "end"])
def test_an_append_with_a_field_out_of_bounds_is_refused_alike(tmp_path: Path, field: str) -> None:
    first, _ = _appends(SEG, [5000, 300, 40_000], seed=6)
    end = _end_of(first)
    values = {"term": (2**63, end, 0, 0), "commit": (1, end, 2**64 - 1, 0), "horizon": (1, end, 0, 2**64 - 1),
              "end": (1, 2**64 - 2**30 - 10, 0, 0)}[field]
    frame = struct.pack(">IBQQQQ", 1 + 32 + 100, codec.TAG_APPEND, *values) + b"y" * 100
    _refused(tmp_path, frame)


@pytest.mark.parametrize("length", [0, codec.MAX_FRAME + 1, 2**32 - 1])
def test_a_frame_length_out_of_bounds_closes_the_connection_alike(tmp_path: Path, length: int) -> None:
    _refused(tmp_path, struct.pack(">I", length) + b"a" * 64)


def test_an_unknown_message_after_the_appends_is_refused_alike(tmp_path: Path) -> None:
    _refused(tmp_path, struct.pack(">IB", 9, ord("~")) + b"\0" * 8)


def test_a_stream_cut_off_in_the_middle_of_an_append_keeps_what_came_before_alike(tmp_path: Path) -> None:
    first, _ = _appends(SEG, [5000, 300, 40_000], seed=6)
    half = codec.encode(Append(1, _end_of(first), 0, 0, b"z" * 30_000))[:20_000]
    _refused(tmp_path, half, cuttings=(0, 4093, 1 << 16))


def test_appends_before_any_elected_are_refused_alike(tmp_path: Path) -> None:
    appends, _ = _appends(SEG, [100, 200], seed=7)
    assert _both(tmp_path, [(_frames(appends), None)], cuttings=(0,), opening=OPENING[:2]) == 0


# ---- the choice --------------------------------------------------------------------------------

def test_the_implementation_is_chosen_in_one_place_and_a_missing_compiled_loop_is_an_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert streamloop.chosen("python") is None
    assert streamloop.chosen("compiled") is not None  # built for the suite (scripts/test.sh)
    with pytest.raises(streamloop.ImplError, match="expected one of python, compiled"):
        streamloop.chosen("fast")

    def missing() -> None:
        raise ImportError("no module named _streamloop")
    monkeypatch.setattr(streamloop, "_load", missing)
    assert streamloop.chosen("") is None  # unset: the reference where nothing was built
    with pytest.raises(streamloop.ImplError, match="compiled stream loop does not load: no module"):
        streamloop.chosen("compiled")
    monkeypatch.setenv(streamloop.IMPL_ENV, "compiled")
    with pytest.raises(StartupError, match="WALSIDECAR_IMPL=compiled"):
        Safekeeper.open(1, created(tmp_path, 1), "127.0.0.1", 0)

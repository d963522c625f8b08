"""An empty data directory (a lost disk) with --peers: real safekeepers on 127.0.0.1 tell it their terms before it
votes; only those that did not lose their own disk count, as many as the cluster's membership asks."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.control import ControlData, load_control, save_control
from sidecar.safekeeper.server import Safekeeper
from support.helpers import free_port, run, until


def _remembering(data_dir: Path, node_id: int, term: int, members: int = 3) -> None:
    data_dir.mkdir()
    save_control(data_dir, ControlData(node_id, AcceptorState(term=term, members=members)))


async def _serving(*sks: Safekeeper) -> list[asyncio.Future[None]]:
    return [asyncio.ensure_future(sk.serve()) for sk in sks]


async def _stop(tasks: list[asyncio.Future[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_an_empty_directory_learns_the_highest_term_of_the_peers_that_remember(tmp_path: Path) -> None:
    p1, p2, p3 = free_port(), free_port(), free_port()
    _remembering(tmp_path / "1", 1, term=7)
    _remembering(tmp_path / "2", 2, term=5)

    async def main() -> None:
        sk1 = Safekeeper.open(1, tmp_path / "1", "127.0.0.1", p1)
        sk2 = Safekeeper.open(2, tmp_path / "2", "127.0.0.1", p2)
        sk3 = Safekeeper.open(3, tmp_path / "3", "127.0.0.1", p3, peers=(f"127.0.0.1:{p1}", f"127.0.0.1:{p2}"))
        assert sk3.acceptor.amnesic and not sk1.acceptor.amnesic and sk3.view().learning_term_from == 2
        tasks = await _serving(sk1, sk2, sk3)
        try:
            await until(lambda: not sk3.acceptor.amnesic, "safekeeper 3 to learn its term", timeout=30)
            assert sk3.view().lost_disk_term == 7  # no vote until its WAL holds the start of a later term
        finally:
            await _stop(tasks)

    run(main())
    control = load_control(tmp_path / "3")
    assert control is not None and (control.state.term, control.state.lost_disk_term, control.state.members) == \
        (7, 7, 3)


def test_two_lost_disks_wait_for_each_other(tmp_path: Path) -> None:
    """N=3, two empty directories: each hears one peer that remembers and one that does not, which is not enough."""
    p1, p2, p3 = free_port(), free_port(), free_port()
    _remembering(tmp_path / "1", 1, term=7)

    async def main() -> None:
        sk1 = Safekeeper.open(1, tmp_path / "1", "127.0.0.1", p1)
        sk2 = Safekeeper.open(2, tmp_path / "2", "127.0.0.1", p2, peers=(f"127.0.0.1:{p1}", f"127.0.0.1:{p3}"))
        sk3 = Safekeeper.open(3, tmp_path / "3", "127.0.0.1", p3, peers=(f"127.0.0.1:{p1}", f"127.0.0.1:{p2}"))
        tasks = await _serving(sk1, sk2, sk3)
        try:
            learner = sk3.learner
            assert learner is not None
            await until(lambda: learner.answered and learner.amnesic_peers, "both peers to answer", timeout=30)
            assert sk3.acceptor.amnesic and sk2.acceptor.amnesic
            assert learner.waiting_for == [f"127.0.0.1:{p2}"]  # asked again: it may learn meanwhile
        finally:
            await _stop(tasks)

    run(main())
    assert load_control(tmp_path / "2") is None and load_control(tmp_path / "3") is None


def test_it_waits_while_too_few_peers_answer(tmp_path: Path) -> None:
    p1, p3, down = free_port(), free_port(), free_port()
    _remembering(tmp_path / "1", 1, term=4)

    async def main() -> None:
        sk1 = Safekeeper.open(1, tmp_path / "1", "127.0.0.1", p1)
        sk3 = Safekeeper.open(3, tmp_path / "3", "127.0.0.1", p3, peers=(f"127.0.0.1:{p1}", f"127.0.0.1:{down}"))
        tasks = await _serving(sk1, sk3)
        try:
            learner = sk3.learner
            assert learner is not None
            await until(lambda: learner.answered, "safekeeper 1 to answer", timeout=30)
            assert sk3.acceptor.amnesic and learner.waiting_for == [f"127.0.0.1:{down}"]
        finally:
            await _stop(tasks)

    run(main())
    assert load_control(tmp_path / "3") is None, "nothing is persisted before enough peers answered"


def test_a_short_peers_list_does_not_lower_how_many_must_answer(tmp_path: Path) -> None:
    """L-7: in a 3-safekeeper cluster, --peers naming one of the two others. That peer says the cluster has 3
    members: one answer is not enough, and the safekeeper says its list is short."""
    p1, p3 = free_port(), free_port()
    _remembering(tmp_path / "1", 1, term=4, members=3)

    async def main() -> None:
        sk1 = Safekeeper.open(1, tmp_path / "1", "127.0.0.1", p1)
        sk3 = Safekeeper.open(3, tmp_path / "3", "127.0.0.1", p3, peers=(f"127.0.0.1:{p1}",))
        tasks = await _serving(sk1, sk3)
        try:
            learner = sk3.learner
            assert learner is not None
            await until(lambda: learner.answered and learner._short_list_said, "safekeeper 1 to answer", timeout=30)
            assert sk3.acceptor.amnesic and sk3.acceptor.members == 3 and sk3.view().learning_term_from == 2
        finally:
            await _stop(tasks)

    run(main())
    assert load_control(tmp_path / "3") is None


def test_without_peers_an_empty_directory_never_votes(tmp_path: Path) -> None:
    sk = Safekeeper.open(3, tmp_path / "3", "127.0.0.1", free_port())
    assert sk.acceptor.amnesic and sk.learner is None

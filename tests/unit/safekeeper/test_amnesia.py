"""An empty data directory with --peers: real safekeepers on 127.0.0.1 tell it their terms before it votes."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.control import ControlData, load_control, save_control
from sidecar.safekeeper.server import Safekeeper
from support.helpers import free_port, run, until


def _remembering(data_dir: Path, node_id: int, term: int) -> None:
    data_dir.mkdir()
    save_control(data_dir, ControlData(node_id, AcceptorState(term=term)))


def test_an_empty_directory_learns_the_highest_term_of_its_peers_an_amnesic_ones_zero_included(
        tmp_path: Path) -> None:
    p1, p2, p3 = free_port(), free_port(), free_port()
    _remembering(tmp_path / "1", 1, term=7)

    async def main() -> None:
        sk1 = Safekeeper.open(1, tmp_path / "1", "127.0.0.1", p1)
        # Amnesic too: its own answer, term 0, counts as what it knows.
        sk2 = Safekeeper.open(2, tmp_path / "2", "127.0.0.1", p2, peers=(f"127.0.0.1:{p1}", f"127.0.0.1:{p3}"))
        sk3 = Safekeeper.open(3, tmp_path / "3", "127.0.0.1", p3, peers=(f"127.0.0.1:{p1}", f"127.0.0.1:{p2}"))
        assert sk2.acceptor.amnesic and sk3.acceptor.amnesic and not sk1.acceptor.amnesic
        assert sk3.view().learning_term_from == 2
        tasks = [asyncio.ensure_future(sk.serve()) for sk in (sk1, sk2, sk3)]
        try:
            await until(lambda: not sk3.acceptor.amnesic and not sk2.acceptor.amnesic, "both to learn their term",
                        timeout=30)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(main())
    for i in (2, 3):
        control = load_control(tmp_path / str(i))
        assert control is not None and control.state.term == 7


def test_it_waits_while_too_few_peers_answer(tmp_path: Path) -> None:
    p1, p3, down = free_port(), free_port(), free_port()
    _remembering(tmp_path / "1", 1, term=4)

    async def main() -> None:
        sk1 = Safekeeper.open(1, tmp_path / "1", "127.0.0.1", p1)
        sk3 = Safekeeper.open(3, tmp_path / "3", "127.0.0.1", p3, peers=(f"127.0.0.1:{p1}", f"127.0.0.1:{down}"))
        tasks = [asyncio.ensure_future(sk.serve()) for sk in (sk1, sk3)]
        try:
            learner = sk3.learner
            assert learner is not None
            await until(lambda: learner.answered, "safekeeper 1 to answer", timeout=30)
            assert sk3.acceptor.amnesic and learner.waiting_for == [f"127.0.0.1:{down}"]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(main())
    assert load_control(tmp_path / "3") is None, "nothing is persisted before enough peers answered"

"""The consensus port's places (budget.py): counted from accept, the proposer's kept free."""

from __future__ import annotations

import resource

import pytest

from sidecar.safekeeper import budget as budget_mod
from sidecar.safekeeper.budget import ConnectionBudget, TooFewDescriptors, raise_descriptor_limit


def test_the_oldest_unauthenticated_connection_makes_way_for_a_new_one() -> None:
    b = ConnectionBudget(limit=10, handshaking=3, reserved=2)
    dropped: list[str] = []
    places = [b.admit(lambda n=n: dropped.append(n), n)[0] for n in ("a", "b", "c")]
    place, evicted = b.admit(lambda: dropped.append("d"), "d")
    assert place is not None and evicted is places[0] and dropped == ["a"]
    assert b.handshaking == 3 and b.total == 3
    places[0].release()  # its connection_lost, later: counted once
    assert b.total == 3


def test_other_roles_leave_the_proposer_its_places() -> None:
    b = ConnectionBudget(limit=10, handshaking=3, reserved=2)
    clients = []
    while True:
        place, _ = b.admit(lambda: None, "client")
        assert place is not None
        if not place.authenticated("client"):
            place.release()
            break
        clients.append(place)
    assert len(clients) == b.others_max == 5
    # Even with every authenticating place taken as well, the proposer gets in, and stays.
    for _ in range(3):
        b.admit(lambda: None, "silent")
    proposer, evicted = b.admit(lambda: None, "proposer")
    assert proposer is not None and proposer.authenticated("proposer")
    assert b.proposers == 1 and b.others == 5


def test_the_descriptor_limit_is_raised_or_the_start_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(budget_mod.resource, "setrlimit", lambda what, lim: set_to.append(lim))
    monkeypatch.setattr(budget_mod.resource, "getrlimit", lambda what: (64, 4096))
    assert raise_descriptor_limit(300) == (64, 4096) and set_to == [(4096, 4096)]
    monkeypatch.setattr(budget_mod.resource, "getrlimit", lambda what: (64, 64))
    with pytest.raises(TooFewDescriptors, match="RLIMIT_NOFILE"):
        raise_descriptor_limit(300)
    monkeypatch.setattr(budget_mod.resource, "getrlimit", lambda what: (1024, resource.RLIM_INFINITY))
    assert raise_descriptor_limit(300)[1] >= 1024

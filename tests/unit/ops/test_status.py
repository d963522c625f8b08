"""`walsidecar status`'s lines, from the document it gathers."""

from __future__ import annotations

from sidecar.ops.status import table


def doc(**parts: object) -> dict:
    return {"time": "2026-11-27T05:00:00+00:00", "safekeepers": [], **parts}


def test_a_standby_that_does_not_stream_is_said_so_with_where_it_stands() -> None:
    out = table(doc(standby={"dsn": "host=x", "in_recovery": True, "receiver": None, "sender": None,
                             "replay_lsn": "0/3000000"}))
    assert (" Standby:  NOT streaming (WAL receiver not running), replayed up to 0/3000000: failover cannot "
            "promote it until it catches up; its log says why") in out


def test_a_streaming_standby_names_its_reader_port() -> None:
    out = table(doc(standby={"dsn": "host=x", "in_recovery": True, "receiver": "streaming",
                             "sender": "127.0.0.1:7621", "replay_lsn": "0/5000000"}))
    assert " Standby:  streaming from 127.0.0.1:7621, replayed up to 0/5000000" in out


def test_an_unreachable_or_promoted_standby() -> None:
    assert " Standby:  unreachable: connection refused" in table(doc(standby={"error": "connection refused"}))
    promoted = {"dsn": "host=x", "in_recovery": False, "receiver": None, "sender": None, "replay_lsn": "0/0"}
    assert " Standby:  a primary now (promoted)" in table(doc(standby=promoted))


def test_an_open_degraded_range_is_shown_from_etcd_the_proposer_and_each_copy() -> None:
    rng = {"term": 4, "start_lsn": "0/3000000", "version": 2, "members": [1]}
    out = table(doc(broker={"endpoints": ["http://e:2379"], "degraded": rng, "clusters": {}},
                    proposer={"endpoint": "p:1", "degraded": {**rng, "acknowledging": True}},
                    safekeepers=[{"address": "a:1", "id": 1, "state": "streaming", "own": {"degraded": rng}}]))
    assert (" DEGRADED: etcd holds an open range, term 4 from 0/3000000, version 2, members 1: commits were "
            "acknowledged without a quorum; failovers refuse unless a member votes") in out
    assert " DEGRADED: the proposer's open range, term 4 from 0/3000000, version 2, members 1 (acknowledging" in out
    assert " Degraded: copies on safekeepers 1: term 4 from 0/3000000, version 2, members 1" in out
    assert "DEGRADED" not in table(doc())

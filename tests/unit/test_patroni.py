"""follow-leader's lost-leader check: when it ends the leader's etcd lease, and where Patroni's key is."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.broker import Broker
from sidecar.patroni import FollowLeader, LeaderLoss, PatroniDcs, leader_member, patroni_dcs
from support.etcd import EtcdServer
from support.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_the_leader_is_lost_only_after_answering_nothing_for_the_whole_time() -> None:
    loss = LeaderLoss(3.0)
    assert not loss.observe(0.0, "node1", answered=False)
    assert not loss.observe(2.9, "node1", answered=False)
    assert loss.observe(3.0, "node1", answered=False)
    # One answer starts the count again.
    assert not loss.observe(3.5, "node1", answered=True)
    assert not loss.observe(4.0, "node1", answered=False)
    assert not loss.observe(6.9, "node1", answered=False)
    assert loss.observe(7.0, "node1", answered=False)


def test_a_new_leader_or_none_starts_the_count_again() -> None:
    loss = LeaderLoss(3.0)
    loss.observe(0.0, "node1", answered=False)
    assert not loss.observe(3.0, "node2", answered=False)  # node2 has been silent for 0 s, not 3
    assert loss.observe(6.0, "node2", answered=False)
    assert not loss.observe(7.0, None, answered=False)
    assert loss.silent_for(7.0) == 0.0


def test_etcd_must_agree_that_the_lease_went_unrenewed() -> None:
    loss = LeaderLoss(3.0)
    assert not loss.lease_lost(seconds_left=20, granted=20)  # renewed just now: a live leader cut off from here
    assert not loss.lease_lost(seconds_left=18, granted=20)  # within a loop_wait of its last renewal
    assert loss.lease_lost(seconds_left=17, granted=20)
    assert loss.lease_lost(seconds_left=-1, granted=0)  # gone already


def test_a_nonpositive_time_is_refused() -> None:
    with pytest.raises(ValueError, match="above 0"):
        LeaderLoss(0)


def test_the_leader_member_is_probed_at_its_postgresql_and_its_rest_api() -> None:
    cluster = {"members": [
        {"name": "node2", "role": "replica", "host": "127.0.0.1", "port": 5433, "api_url": "http://127.0.0.1:8009/patroni"},
        {"name": "node1", "role": "primary", "host": "10.0.0.1", "port": 5432, "api_url": "https://10.0.0.1:8008/patroni"},
    ]}
    leader = leader_member(cluster)
    assert leader is not None and leader.name == "node1"
    assert leader.addresses == (("10.0.0.1", 5432), ("10.0.0.1", 8008))
    assert leader_member({"members": [cluster["members"][0]]}) is None


def _yaml(tmp_path: Path, etcd3: str, extra: str = "") -> Path:
    path = tmp_path / "patroni.yml"
    path.write_text(f"scope: pgmain\nname: node1\n{extra}etcd3:\n{etcd3}\n"
                    "restapi:\n  listen: 127.0.0.1:8008\n  connect_address: 127.0.0.1:8008\n")
    return path


def test_patroni_dcs_reads_where_the_leader_key_is(tmp_path: Path) -> None:
    pytest.importorskip("patroni")
    dcs = patroni_dcs(_yaml(tmp_path, "  hosts: 127.0.0.1:2379,127.0.0.1:2380"))
    assert dcs == PatroniDcs(("http://127.0.0.1:2379", "http://127.0.0.1:2380"), "/service/pgmain/leader", None)
    dcs = patroni_dcs(_yaml(tmp_path, "  host: 127.0.0.1:2379\n  protocol: https\n  cacert: /ca.pem\n"
                                      "  cert: /c.pem\n  key: /k.pem", extra="namespace: /db/\n"))
    assert dcs.endpoints == ("https://127.0.0.1:2379",) and dcs.leader_key == "/db/pgmain/leader"
    assert dcs.tls is not None and (dcs.tls.ca, dcs.tls.cert, dcs.tls.key) == ("/ca.pem", "/c.pem", "/k.pem")


def test_reading_patroni_yml_leaves_the_umask_alone(tmp_path: Path) -> None:
    """Importing Patroni sets the process's umask to 077 (patroni.file_perm): the follower's files, and those
    of the sidecar it starts (some read by the postgres user), keep the umask they were given. A fresh
    process: the umask changes at Patroni's first import only."""
    pytest.importorskip("patroni")
    path = _yaml(tmp_path, "  hosts: 127.0.0.1:2379")
    out = subprocess.run([sys.executable, "-c", "import os, sys; from sidecar.patroni import patroni_dcs; "
                          "os.umask(0o022); patroni_dcs(sys.argv[1]); print(oct(os.umask(0)))", str(path)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0o22"


@pytest.mark.parametrize("etcd3, message", [
    ("  username: u\n  password: p\n  hosts: 127.0.0.1:2379", "etcd3 username, password: not supported"),
    ("  protocol: http", "names no hosts, host or url"),
])
def test_patroni_dcs_says_what_it_cannot_use(tmp_path: Path, etcd3: str, message: str) -> None:
    pytest.importorskip("patroni")
    with pytest.raises(ValueError, match=message):
        patroni_dcs(_yaml(tmp_path, etcd3))


def test_patroni_dcs_needs_an_etcd3_section(tmp_path: Path) -> None:
    pytest.importorskip("patroni")
    path = tmp_path / "patroni.yml"
    path.write_text("scope: pgmain\nname: node1\n")
    with pytest.raises(ValueError, match="no etcd3 section"):
        patroni_dcs(path)


def test_a_lease_renewed_in_etcd_is_left_alone_and_an_unrenewed_one_ended(etcd: EtcdServer, tmp_path: Path) -> None:
    """The etcd half of the check, against a real etcd: the leader key of node1 hangs on its lease."""
    dcs = PatroniDcs((etcd.url,), "/service/pgmain/leader")
    follower = FollowLeader("http://127.0.0.1:9", tmp_path / "walsidecar.toml", dcs=dcs, leader_lost_after=2.0)

    async def setup() -> int:
        b = Broker([etcd.url])
        try:
            lease = await b.grant(20)
            assert await b.create(dcs.leader_key, "node1", lease)
            return lease
        finally:
            b.close()

    async def key() -> tuple[str, int] | None:
        b = Broker([etcd.url])
        try:
            return await b.holder(dcs.leader_key)
        finally:
            b.close()

    async def seconds_left(lease: int) -> int:
        b = Broker([etcd.url])
        try:
            return (await b.lease_ttl(lease))[0]
        finally:
            b.close()

    lease = asyncio.run(setup())
    # Renewed a moment ago: a leader that answers nothing here may be cut off from this node alone.
    asyncio.run(follower._end_lost_lease(dcs, "node1", 5.0))
    assert asyncio.run(key()) == ("node1", lease)
    # Another node's key is never ended, however silent node1 is.
    asyncio.run(follower._end_lost_lease(dcs, "node2", 5.0))
    assert asyncio.run(key()) == ("node1", lease)
    # Unrenewed for leader_lost_after: ended, and the key with it.
    wait_for(lambda: asyncio.run(seconds_left(lease)) <= 18, timeout=30, what="the lease to go 2 s unrenewed")
    asyncio.run(follower._end_lost_lease(dcs, "node1", 5.0))
    assert asyncio.run(key()) is None

"""sidecar/broker.py against a real etcd: state keys under a lease, endpoints, the upload lease election, TLS."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from sidecar.broker import (
    Broker, BrokerError, Lease, LeaseElection, SafekeeperState, decode_degraded, encode_degraded, group_states,
    parse_endpoints, safekeepers_prefix, entry_key_beside, uploader_key,
)
from sidecar.consensus.messages import NO_DEGRADED, DegradedRange
from sidecar.certs import create_node
from sidecar.deployment import free_port
from support.etcd import EtcdServer
from support.helpers import until
from support.pki import TestPKI, foreign_ca
from support.procs import ProcessTracker

STATE = SafekeeperState(2, flush_lsn=0x3000128, commit_lsn=0x3000100, backup_lsn=0x2000000, term=7, last_log_term=6,
                        proposer_connected=True, last_updated=1764000000.25, address="10.0.0.2:7601",
                        pg_address="10.0.0.2:7602")


def test_state_round_trips_through_text_keys_and_ignores_what_is_not_ours() -> None:
    keys = STATE.to_keys()
    assert keys["flush_lsn"] == "0/3000128" and keys["proposer_connected"] == "true" and "id" not in keys
    prefix = safekeepers_prefix("prod", 1)
    kvs = {f"{prefix}2/{k}": v for k, v in keys.items()}
    kvs[f"{prefix}3/term"] = "not a number"  # a malformed field keeps its default
    kvs["walsidecar/prod/1/uploader"] = "2"
    kvs["walsidecar/prod/1/safekeepers/x/term"] = "1"
    assert group_states(kvs) == {"prod": {1: {2: STATE, 3: SafekeeperState(3)}}}


def test_endpoints_are_urls_of_http_or_https() -> None:
    assert parse_endpoints(["http://127.0.0.1:2379", "https://etcd.example:4001/", "http://[::1]:1"]) == (
        "http://127.0.0.1:2379", "https://etcd.example:4001", "http://[::1]:1")
    for bad in ("127.0.0.1:2379", "ftp://h:1", "http://h:1/v3", "http://h:x"):
        with pytest.raises(ValueError):
            parse_endpoints([bad])


def test_keys_live_as_long_as_their_lease_and_a_dead_endpoint_is_skipped(etcd: EtcdServer) -> None:
    async def main() -> None:
        # The first endpoint refuses connections: every call falls over to the second.
        broker = Broker([f"http://127.0.0.1:{free_port()}", etcd.url])
        try:
            lease = Lease(broker, ttl=2)
            prefix = safekeepers_prefix("c", 1)
            keys = {f"{prefix}2/{k}": v for k, v in STATE.to_keys().items()}
            assert await broker.put_all(keys, await lease.ensure())
            assert group_states(await broker.read_prefix("walsidecar/")) == {"c": {1: {2: STATE}}}
            # Not renewed: etcd drops the keys with the lease, and a put under it says so.
            await until(lambda: _empty(broker, prefix), "the keys to go with the lease", timeout=15, interval=0.2)
            assert not await broker.put_all(keys, lease.id)
            lease.lost()
            assert await broker.put_all(keys, await lease.ensure())
            await broker.revoke(lease.id)
            assert await broker.read_prefix(prefix) == {}
        finally:
            broker.close()

    asyncio.run(main())


async def _empty(broker: Broker, prefix: str) -> bool:
    return await broker.read_prefix(prefix) == {}


def test_no_endpoint_answering_is_a_broker_error() -> None:
    async def main() -> None:
        broker = Broker([f"http://127.0.0.1:{free_port()}"], timeout=1)
        try:
            with pytest.raises(BrokerError, match="no etcd endpoint answered.*connection refused"):
                await broker.health()
        finally:
            broker.close()

    asyncio.run(main())


def test_one_uploader_at_a_time_and_the_next_takes_over_when_its_lease_ends(etcd: EtcdServer) -> None:
    async def main() -> None:
        brokers = [Broker([etcd.url]) for _ in range(3)]
        elections = [LeaseElection(b, Lease(b, ttl=2), node_id=i + 1) for i, b in enumerate(brokers)]
        key = uploader_key("c", 1)

        async def campaign(e: LeaseElection, eligible: bool) -> None:
            await publish(e, key)  # as the publisher does before each campaign
            await e.campaign(key, eligible=eligible)
        try:
            await campaign(elections[0], eligible=False)  # lagging: does not take it
            for e in elections[1:]:
                await campaign(e, eligible=True)
            assert [e.may_upload(0) for e in elections] == [False, True, False]
            assert [e.holder for e in elections] == [None, 2, 2]
            # The holder falls behind: it resigns, and the next eligible one takes the key.
            await campaign(elections[1], eligible=False)
            await campaign(elections[2], eligible=True)
            assert [e.may_upload(0) for e in elections] == [False, False, True]
            # The holder dies (its lease is never renewed): after the TTL another takes over.
            await campaign(elections[0], eligible=True)
            assert not elections[0].may_upload(0)

            async def taken_over() -> bool:
                await campaign(elections[0], eligible=True)
                return elections[0].may_upload(0)
            await until(taken_over, "safekeeper 1 to take the upload lease", timeout=15, interval=0.2)
            # The old holder, were it to wake, sees the lease as stale and stops at once.
            assert not elections[2].may_upload(0)
        finally:
            for b in brokers:
                b.close()

    asyncio.run(main())


async def publish(e: LeaseElection, key: str) -> None:
    """An entry of e's safekeeper beside `key`, on its lease (what the publisher writes each round)."""
    await e.broker.put_all({entry_key_beside(key, e.node_id): "0"}, await e.lease.ensure())


def test_an_upload_lease_key_no_safekeeper_wrote_does_not_stop_uploads(etcd: EtcdServer) -> None:
    """Write access to etcd (audit-2 L-6): a key without a lease, naming no safekeeper, or on a lease no
    safekeeper's entry hangs on (one its writer may renew for ever) is not a holder."""
    async def main() -> None:
        b, forger = Broker([etcd.url]), Broker([etcd.url])
        election = LeaseElection(b, Lease(b, ttl=5), node_id=1)
        key = uploader_key("c", 1)
        try:
            lease = await forger.grant(600)  # alive for the whole test
            forgeries = [("99", 0), ("someone", 0), ("99", lease), ("1", lease), ("2", lease)]
            for value, on in forgeries:
                await forger.put_all({key: value}, on) if on else await b._call("forge", lambda c: c.put(key, value))
                await publish(election, key)
                await election.campaign(key, eligible=True)
                assert election.may_upload(0) and election.holder == 1, (value, on)
                assert (await b.holder(key)) == ("1", election.lease.id)
                await election.resign()
            # A safekeeper's own key, on the lease its entry hangs on, is obeyed.
            other = LeaseElection(forger, Lease(forger, ttl=5), node_id=2)
            await publish(other, key)
            await other.campaign(key, eligible=True)
            await publish(election, key)
            await election.campaign(key, eligible=True)
            assert not election.may_upload(0) and election.holder == 2
        finally:
            b.close()
            forger.close()

    asyncio.run(main())


def test_tls_with_client_certificates(procs: ProcessTracker, test_dir: Path, pki: TestPKI) -> None:
    server_certs = test_dir / "etcd-certs"
    create_node(pki.ca_dir, server_certs, "client", hosts=("127.0.0.1", "localhost"))
    etcd = EtcdServer(test_dir / "etcd", certs_dir=server_certs, client_cert_auth=True)
    procs.track(etcd.child)
    etcd.start()

    async def main() -> None:
        broker = Broker([etcd.url], pki.certs("safekeeper", 1))
        try:
            assert await broker.put_all({"walsidecar/t/1/safekeepers/1/term": "3"}, await broker.grant(5))
            assert await broker.read_prefix("walsidecar/t/") == {"walsidecar/t/1/safekeepers/1/term": "3"}
        finally:
            broker.close()
        # A client that trusts etcd's certificate but whose own is from another CA: etcd refuses it.
        stranger = foreign_ca(test_dir, "safekeeper", 1)
        shutil.copy(pki.ca_dir / "ca.crt", stranger / "ca.crt")
        refused = Broker([etcd.url], stranger, timeout=2)
        try:
            with pytest.raises(BrokerError, match="no etcd endpoint answered"):
                await refused.health()
        finally:
            refused.close()

    asyncio.run(main())


def test_a_degraded_range_is_written_over_the_one_before_and_a_failover_ends_older_terms_ranges(
        etcd: EtcdServer) -> None:
    one = DegradedRange(3, 0x3000000, 1, frozenset({1}))
    two = DegradedRange(3, 0x3000000, 2, frozenset({1, 2}))

    async def main() -> None:
        broker = Broker([etcd.url])
        try:
            assert await broker.read_degraded("c") == NO_DEGRADED
            assert not await broker.degrade_after_marked("c")
            await broker.mark_degrade_after("c")
            assert await broker.degrade_after_marked("c") and not await broker.degrade_after_marked("d")
            assert await broker.store_degraded("c", one, NO_DEGRADED)
            assert not await broker.store_degraded("c", one, NO_DEGRADED)  # a range is open already
            assert not await broker.store_degraded("c", two, DegradedRange(3, 0x3000000, 7, frozenset({1})))
            assert await broker.store_degraded("c", two, one)
            assert await broker.read_degraded("c") == two
            assert not await broker.close_degraded("c", one)  # not the version it holds
            # A failover whose votes covered version 1 finds version 2: nothing changes, it refuses.
            assert not await broker.failover_final("c", one, 9)
            assert await broker.read_degraded("c") == two
            assert await broker.failover_final("c", two, 9)
            assert await broker.read_degraded("c") == NO_DEGRADED
            # The fenced-out sidecar (term 3) can neither record a new version nor open a new range; term 10 can.
            assert not await broker.store_degraded("c", DegradedRange(3, 0x3000000, 3, frozenset({2})), two)
            assert not await broker.store_degraded("c", DegradedRange(3, 0x4000000, 4, frozenset({2})), NO_DEGRADED)
            later = DegradedRange(10, 0x5000000, 1, frozenset({3}))
            assert await broker.store_degraded("c", later, NO_DEGRADED)
            assert await broker.close_degraded("c", later)
            assert await broker.read_degraded("c") == NO_DEGRADED
            # With no range open, a failover still raises the term an older sidecar cannot open a range below.
            assert await broker.failover_final("c", NO_DEGRADED, 12)
            assert not await broker.store_degraded("c", DegradedRange(11, 0x6000000, 1, frozenset({1})), NO_DEGRADED)
            # What etcdctl shows, and what is refused as not ours.
            assert encode_degraded(two) == '{"members":[1,2],"start_lsn":"0/3000000","term":3,"version":2}'
            with pytest.raises(ValueError):
                decode_degraded('{"members":[2,1],"start_lsn":"0/3000000","term":3,"version":2}')
        finally:
            broker.close()

    asyncio.run(main())
